"""ZeRO stage 3 (task.train.sharding='weights'): each replica holds 1/R of every weight.

The reference is the unsharded pipeline with one optimizer per replica; stage 3 swaps
each replica's weights for its flat part (tfpipe/pipeline/sharded_weights.py), gathers
them once per step, reduce-scatters the gradients and updates the parts in place. The
model is tests/test_sharded_gradients.py's float64 pipeline (Dropout, an fc3 bias of 5
that neither R divides: at R=4 the last part is empty) with the trainer's update
(clipping included). A covering design over optimizer x K x R x executor: each of Adam
and Adafactor (factored, momentum, parameter scale: its whole-weight statistic gathers
the weight) at K in {1, 2}, R in {2, 4}, and both the cell-function and the unrolled
executor (with recompute on and off).
"""
import gc
import weakref

import numpy as np
import pytest
import tensorflow as tf

from tests import test_tensor_parallel_optimizers as tp_optimizers
from tests.test_sharded_gradients import PipelineRun
from tests.test_sharded_optimizer import OPTIMIZERS
from tfpipe.pipeline import sharding

STEPS = 4
GRID = {  # name: (optimizer, K, R, pipeline params)
    'adam_k2_r2_functional': ('adam', 2, 2, {}),
    'adafactor_k1_r4_functional': ('adafactor', 1, 4, {}),
    'adam_k1_r4_unrolled': ('adam', 1, 4, {'cell_functions': False}),
    'adafactor_k2_r2_unrolled_no_recompute': ('adafactor', 2, 2, {'cell_functions': False,
                                                                  'recompute': 'never'}),
}


@pytest.fixture(scope='module', params=sorted(GRID))
def trained(request):
    """The unsharded and the stage-3 run of one grid point after STEPS steps, and their
    losses."""
    name, k, r, pipeline_params = GRID[request.param]
    rule = OPTIMIZERS[name].Copy().Set(name=name)
    ref = PipelineRun(1, k, r, sharding.NONE, rule, **pipeline_params)
    run = PipelineRun(1, k, r, sharding.WEIGHTS, rule, **pipeline_params)
    return ref, run, ref.train(STEPS), run.train(STEPS), rule


def test_stage3_loss_at_every_step_equals_the_unsharded_one(trained):
    _, _, want, got, _ = trained
    assert len(got) == STEPS
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_stage3_weights_and_slots_equal_the_unsharded_ones(trained):
    ref, run, _, _, rule = trained
    shards = run.pipe.weight_shards
    assert sorted(shards.shapes) == sorted(ref.variables[0])
    for path, var in ref.variables[0].items():
        np.testing.assert_allclose(shards.whole(path).numpy(), var.numpy(), rtol=1e-5,
                                   atol=1e-8, err_msg=path)
        for slot in rule.Instantiate().SlotShapes(var.shape):
            np.testing.assert_allclose(run.optimizer.GetSlot(path, slot).numpy(),
                                       ref.optimizer.GetSlot(path, slot).numpy(),
                                       rtol=1e-5, atol=1e-8, err_msg=f'{path}/{slot}')


def test_each_replica_holds_its_padded_part_of_every_weight_and_nothing_whole(trained):
    """Replica r's variables are its parts (ceil(n/R) elements, zero past the weight's
    end), on its own devices; the layers no longer hold any whole trainable weight."""
    ref, run, _, _, _ = trained
    shards = run.pipe.weight_shards
    r_count = run.pipe.num_replicas
    copies = run.pipe.ReplicaVariablesByPath()
    for r, copy in enumerate(copies):
        for path, var in ref.variables[r].items():
            part = copy[path]
            n = var.shape.num_elements()
            size = -(-n // r_count)
            assert part.shape == [size] and shards.is_part(part), path
            assert part.device == var.device, path
            flat = np.pad(var.numpy().reshape(-1), [0, size * r_count - n])
            np.testing.assert_allclose(part.numpy(), flat[r * size:(r + 1) * size],
                                       rtol=1e-5, atol=1e-8, err_msg=f'{path} replica {r}')
    held, whole = shards.Bytes()
    assert held < whole / r_count + 8 * len(shards.shapes) * r_count  # 1/R, plus padding
    theta = tf.nest.flatten(run.pipe.ReplicaThetas())
    assert theta and all(shards.is_part(v) for v in theta)


def test_a_step_gathers_each_cells_weights_once(trained):
    """One all-gather per replica, cell and dtype for the whole step (all micro-batches,
    recompute included), none after the update; Adafactor's parameter scale also
    gathers each weight whole (one per replica and variable) and its factored moments
    each matrix's whole gradient, as at stage 2."""
    ref, run, _, _, rule = trained
    x, y = (tf.zeros([8, 6], tf.float64), tf.zeros([8], tf.int32))
    graph = run._step.get_concrete_function(x, y).graph.as_graph_def()
    ops = [n.op for n in graph.node] + [n.op for f in graph.library.function
                                         for n in f.node_def]
    cells, r_count = len(run.pipe.cells), run.pipe.num_replicas
    extra = 0
    if rule.cls.__name__ == 'Adafactor':
        extra = sum(1 + (v.shape.rank >= 2) for v in ref.variables[0].values())
    assert ops.count('CollectiveGather') == r_count * (cells + extra)


def test_sharding_the_weights_frees_the_whole_copies():
    """The layers drop every replica's whole trainable variables for the parts, so nothing
    keeps them alive (between steps a replica holds 1/R of its weights, not 1 + 1/R);
    the non-trainable ones stay."""
    pipe = tp_optimizers.pipeline(1, 2, 2)
    copies = pipe.ReplicaVariablesByPath()
    whole = [weakref.ref(v) for copy in copies for v in copy.values() if v.trainable]
    kept = {path for path, v in copies[0].items() if not v.trainable}
    del copies
    pipe.ShardWeights()
    gc.collect()
    assert whole and all(ref() is None for ref in whole)
    assert {path for path, v in pipe.VariablesByPath().items() if not v.trainable} == kept


def test_stage3_with_tensor_parallel_cells_is_refused_in_one_line():
    pipe = tp_optimizers.pipeline(2, 1, 2)
    with pytest.raises(ValueError, match=r"sharding='weights' with tensor_parallel > 1 is "
                                         'not built') as e:
        pipe.ShardWeights()
    assert '\n' not in str(e.value)
    assert pipe.weight_shards is None
