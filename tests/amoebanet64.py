"""AmoebaNetPipe in float64 with Adafactor: the model that shows ZeRO stages 2 and 3 exact
with Adafactor on a BatchNorm net across trainer clients.

Loaded by the trainer as `--model=tests.amoebanet64.AmoebaNetPipe64Adafactor`
(tests/test_clients_sharded_amoebanet.py). In float32 the sharded stages sum Adafactor's
whole-weight statistics over the parts in another order than one whole weight does, an
ulp apart, and AmoebaNet's ReLUs and max pools amplify that: at step 3 a kink is crossed
and the float32 runs part by up to 1.1% of a moment after 4 steps, in one process as
across clients (docs/optimizer_sharding.md). In float64 the same reordering is 1e-16
apart, far from any kink, so the comparison sees the algorithm, not the rounding:
every body layer holds and computes float64 (AmoebaNet's BatchNorms take their cell's
dtype), as tests/model_zoo.py's in-process grids do.
"""
import tensorflow as tf

from model_registry import RegisterSingleTaskModel
from params.image.shapes import AmoebaNetPipe
from tfpipe import optimizers


@RegisterSingleTaskModel
class AmoebaNetPipe64Adafactor(AmoebaNetPipe):
    """AmoebaNetPipe with float64 weights and activations, trained by Adafactor."""

    def Task(self):
        p = super().Task()
        for layer in p.pipeline.body:
            layer.dtype = tf.float64
        p.train.optimizer = optimizers.Adafactor.Params()
        return p
