"""Global-norm clipping with expert parallelism: the P=1 run's norm at any P.

At P > 1 replica r holds the gradients of expert rank r % P only, so a norm of its own
gradients misses the other ranks' experts (it was so before: TinyMoETransformerLM's
grad_norm 2.075639 at P=2 against 2.076002 at P=1). With SGD, which keeps the scale of a
clipped gradient (Adam undoes it), clipping at a norm below every step's makes the P=2
run's losses, norms and weights those of P=1 only if the norm is the whole one.
tests/test_expert_parallel_pipeline.py's body (capacity drops nothing), float64, the
trainer's own update.
"""
import numpy as np
import pytest
import tensorflow as tf

from tests import model_zoo as mz
from tests.test_expert_parallel_pipeline import F64, pipeline
from tests.test_expert_parallel_resume import inputs
from tfpipe import fprop_context, optimizers
from tfpipe.base_layer import flatten_by_path
from tfpipe.pipeline import expert_parallel
from trainer.guarded_update import guarded_update

CLIP = 1e-3  # below every step's norm: every step clips
STEPS = 3


class ClippedRun:
    """P x R (K=1) with plain SGD per replica, clipped by the global norm."""

    def __init__(self, p, r):
        self.p, self.pipe = p, pipeline(p, r, 1, m=4 // r)
        self.variables = [{q: v for q, v in copy.items() if v.trainable}
                          for copy in self.pipe.ReplicaVariablesByPath()]
        self.optimizers = [optimizers.SGD.Params().Set(name='sgd').Instantiate()
                           for _ in self.variables]
        for optimizer, variables in zip(self.optimizers, self.variables):
            optimizer.CreateSlots(variables)
        self.global_step = tf.Variable(0, dtype=tf.int64)
        self.norms = []
        self._step = tf.function(self._build_step, autograph=False)

    def _build_step(self, x, y):
        with fprop_context.training(step=self.global_step):
            loss, grads = self.pipe.ForwardBackward(self.pipe.ReplicaThetas(), x, mz.loss_fn, y)
        norm = guarded_update(loss, [flatten_by_path(g, 'pipe') for g in grads], CLIP,
                              self.optimizers, self.variables, tf.constant(0.5, F64),
                              self.global_step, self.p)
        return loss, norm

    def train(self, steps):
        losses = []
        for _ in range(steps):
            loss, norm = self._step(*inputs(int(self.global_step.numpy())))
            losses.append(float(loss))
            self.norms.append(float(norm))
        return losses

    def whole(self, path):
        """The weight at `path` as P=1 holds it: expert slices of ranks 0..P-1 joined."""
        var = self.variables[0][path]
        if not expert_parallel.is_expert_variable(var):
            return var.numpy()
        return np.concatenate([self.variables[r][path].numpy() for r in range(self.p)])


@pytest.fixture(scope='module')
def runs():
    out = {}
    for p in (1, 2):
        run = ClippedRun(p, 2)
        out[p] = (run, run.train(STEPS))
    return out


def test_p2_clips_by_the_p1_norm_and_takes_its_steps(runs):
    (ref, want), (run, got) = runs[1], runs[2]
    assert min(ref.norms) > CLIP
    np.testing.assert_allclose(run.norms, ref.norms, rtol=1e-9)
    np.testing.assert_allclose(got, want, rtol=1e-9)
    for path in ref.variables[0]:
        np.testing.assert_allclose(run.whole(path), ref.whole(path), rtol=1e-9, atol=1e-12,
                                   err_msg=path)


def test_replicas_keep_equal_copies_of_the_weights_outside_the_experts(runs):
    run, _ = runs[2]
    for path, var in run.variables[0].items():
        if not expert_parallel.is_expert_variable(var):
            np.testing.assert_array_equal(run.variables[1][path].numpy(), var.numpy(), path)
