"""ZeRO stage 3 (task.train.sharding='weights'): each replica holds 1/R of every weight.

The reference is the unsharded pipeline with one optimizer per replica; stage 3 swaps
each replica's weights for its flat part (tfpipe/pipeline/sharded_weights.py), gathers
them once per step, reduce-scatters the gradients and updates the parts in place. The
model is tests/test_sharded_gradients.py's float64 pipeline (Dropout, an fc3 bias of 5
that neither R divides: at R=4 the last part is empty) with the trainer's update
(clipping by the global norm included, active at every step: the norm is summed over
the parts). A covering design over optimizer x K x R x executor: each of Adam,
Adafactor (factored, momentum, parameter scale: its whole-weight statistic gathers
the weight), SGD with Nesterov momentum and plain SGD (no slot at all) at K in {1, 2},
R in {2, 4}, and both the cell-function and the unrolled executor (with recompute on
and off). Three points regather per task (task.train.regather_per_micro_batch), one with
a last cell that keeps its activations (recompute='except_last': it gathers once), one
with a split backward (zb_h1: the weight task uses the input task's gather). Three
points tie a weight (fc2 reads fc1's: across cells, and within one at K=1), one with a
user cell that keeps its activations reading a recomputing cell's weight. A
float32 model computing in bfloat16 (fprop_dtype) is compared with its own unsharded
bfloat16 run.
"""
import gc
import weakref

import numpy as np
import pytest
import tensorflow as tf

from tests import test_tensor_parallel_optimizers as tp_optimizers
from tests.test_sharded_gradients import PipelineRun
from tests.test_sharded_optimizer import OPTIMIZERS
from tfpipe import optimizers
from tfpipe.pipeline import sharding, ties

STEPS = 4
CLIP = 0.5  # PipelineRun's: below every step's norm here, so every step clips
RULES = {**OPTIMIZERS, 'sgd': optimizers.SGD.Params()}
GRID = {  # name: (optimizer, K, R, pipeline params, regather_per_micro_batch)
    'adam_k2_r2_functional': ('adam', 2, 2, {}, False),
    'adafactor_k1_r4_functional': ('adafactor', 1, 4, {}, False),
    'adam_k1_r4_unrolled': ('adam', 1, 4, {'cell_functions': False}, False),
    'adafactor_k2_r2_unrolled_no_recompute': ('adafactor', 2, 2, {'cell_functions': False,
                                                                  'recompute': 'never'}, False),
    'sgd_momentum_k2_r4_functional': ('sgd_momentum', 2, 4, {}, False),
    'sgd_k1_r2_unrolled': ('sgd', 1, 2, {'cell_functions': False}, False),
    'regather_adam_k2_r2_functional': ('adam', 2, 2, {}, True),
    'regather_adafactor_k2_r4_unrolled_except_last': (
        'adafactor', 2, 4, {'cell_functions': False, 'recompute': 'except_last'}, True),
    'regather_sgd_momentum_k2_r2_zb_h1': ('sgd_momentum', 2, 2, {'schedule': 'zb_h1'}, True),
    # fc2 reads fc1's weight (ties.py): across cells at K=2, within the cell at K=1.
    'tied_adam_k2_r4_functional': ('adam', 2, 4, {'tied': True}, False),
    'tied_regather_adafactor_k2_r2_unrolled_except_last': (
        'adafactor', 2, 2, {'tied': True, 'cell_functions': False, 'recompute': 'except_last'},
        True),
    'tied_regather_sgd_momentum_k1_r2_functional': ('sgd_momentum', 1, 2, {'tied': True}, True),
}


@pytest.fixture(scope='module', params=sorted(GRID))
def trained(request):
    """The unsharded and the stage-3 run of one grid point after STEPS steps, and their
    losses."""
    name, k, r, pipeline_params, regather = GRID[request.param]
    rule = RULES[name].Copy().Set(name=name)
    ref = PipelineRun(1, k, r, sharding.NONE, rule, **pipeline_params)
    run = PipelineRun(1, k, r, sharding.WEIGHTS, rule, regather=regather, **pipeline_params)
    return ref, run, ref.train(STEPS), run.train(STEPS), rule


def test_stage3_loss_at_every_step_equals_the_unsharded_one(trained):
    _, _, want, got, _ = trained
    assert len(got) == STEPS
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_stage3_clips_by_the_global_norm_of_the_unsharded_run(trained):
    """The norm summed over the replicas' parts of the reduce-scattered gradients is the
    unsharded gradients' norm, and it clips every step (the weights' test then shows
    the clipped update)."""
    ref, run, _, _, _ = trained
    np.testing.assert_allclose(run.norms, ref.norms, rtol=1e-6)
    assert min(ref.norms) > CLIP


def test_stage3_weights_and_slots_equal_the_unsharded_ones(trained):
    assert_weights_and_slots_equal(*trained[:2], trained[4])


def assert_weights_and_slots_equal(ref, run, rule):
    """Every weight of the stage-3 `run` (its parts joined) and every slot are the
    unsharded `ref`'s within 1e-5."""
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


def test_a_step_gathers_each_cells_weights_once_or_in_each_task(trained):
    """One all-gather per replica, cell and dtype for the whole step (all micro-batches,
    recompute included), none after the update; with regather_per_micro_batch one per
    weight in each of a recomputing cell's M forward and M backward tasks, inside the
    task (a cell that keeps its activations still gathers once, before its tasks). Adafactor's
    parameter scale also gathers each weight whole (one per replica and variable) and
    its factored moments each matrix's whole gradient, as at stage 2."""
    ref, run, _, _, rule = trained
    pipe = run.pipe
    x, y = (tf.zeros([8, 6], tf.float64), tf.zeros([8], tf.int32))
    graph = run._step.get_concrete_function(x, y).graph.as_graph_def()
    nodes = list(graph.node) + [n for f in graph.library.function for n in f.node_def]
    gathers = [n.name for n in nodes if n.op == 'CollectiveGather']
    shards, m = pipe.weight_shards, pipe.params.num_micro_batches
    read = [set(shards.paths_of([pipe.theta[name] for name in cell.names]
                                + ties.owner_weights(pipe.theta, cell.ties)))
            for cell in pipe.cells]  # a tied layer reads its owner's weight, maybe elsewhere
    regathered = [len(paths) if shards.per_micro_batch and cell.recompute else 0
                  for cell, paths in zip(pipe.cells, read)]
    once = set().union(*(paths for paths, n in zip(read, regathered) if not n))
    groups = {(tuple(copy[path].device for copy in shards.parts), shards.parts[0][path].dtype)
              for path in once}  # gathered once a step: one per cell's devices and dtype
    per_replica = 2 * m * sum(regathered) + len(groups)
    if rule.cls.__name__ == 'Adafactor':
        per_replica += sum(1 + (v.shape.rank >= 2) for v in ref.variables[0].values())
    assert len(gathers) == pipe.num_replicas * per_replica
    in_tasks = [g for g in gathers if '/forward_' in g or '/backward_' in g]
    assert len(in_tasks) == pipe.num_replicas * 2 * m * sum(regathered)


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


@pytest.fixture(scope='module')
def bfloat16_runs():
    """A float32 model computing in bfloat16 (fprop_dtype), unsharded and at stage 3
    (Adam, K=2, R=2, cell functions), after STEPS steps."""
    rule = RULES['adam'].Copy().Set(name='adam')
    runs = [PipelineRun(1, 2, 2, stage, rule, dtype=tf.float32, fprop_dtype=tf.bfloat16)
            for stage in (sharding.NONE, sharding.WEIGHTS)]
    return runs, [run.train(STEPS) for run in runs]


def test_stage3_in_bfloat16_follows_the_unsharded_bfloat16_run(bfloat16_runs):
    """float32 parts, gathered whole in float32 and cast to bfloat16 in the cell as the
    unsharded run casts its whole variables: the first step's loss (before any update)
    is the same number. Later steps differ only by the float32 rounding of the sums
    (reduce-scatter and the norm over parts add in another order), which a bfloat16
    cast of a weight can carry to 2^-8 relative: 1e-3 on the losses, 1e-5 on the
    float32 master weights."""
    (ref, run), (want, got) = bfloat16_runs
    assert [cell.fprop_dtype for cell in run.pipe.cells] == [tf.bfloat16] * 2
    assert got[0] == want[0]
    np.testing.assert_allclose(got, want, rtol=1e-3)
    shards = run.pipe.weight_shards
    for path, var in ref.variables[0].items():
        assert shards.parts[0][path].dtype == tf.float32, path  # master weights in float32
        np.testing.assert_allclose(shards.whole(path).numpy(), var.numpy(), rtol=1e-5,
                                   atol=1e-6, err_msg=path)
