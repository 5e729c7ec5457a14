"""ZeRO stage 3 (task.train.sharding='weights') with tensor-parallel cells (T=2).

R=2 replicas x K in {1, 2} cells x T=2 devices per cell: each replica holds 1/R of each
shard of a split weight (tfpipe/pipeline/sharded_weights.py), gathered among the R
replicas holding the same shard. The reference is the unsharded run at the same R, K
and T (tests/test_sharded_gradients.py's PipelineRun: float64, Dropout, column- and
row-parallel layers, an fc3 bias of 5 that R does not divide, the trainer's update with
clipping active at every step). With Adam and with Adafactor (factored, momentum,
parameter scale), whose statistics are of the whole weight: a column-split weight's row
moment sums over its T shards, each shard's over its R parts, so treating each shard
as a weight of its own is off by 1e-3 in the loss and 30-60% in the factored moments.
Three points regather per task (task.train.regather_per_micro_batch): unrolled, and under
cell functions, whose calls of a tensor-parallel cell are stateful (collectives) and were
chained across replicas by tf.function's automatic control dependencies, which deadlocked
with the regather (cell_functions._unchained). The other schedules run at T=2 too: the
split backward (zb_h1, zb_h2: the unrolled executor, the weight task using the input
task's gather) and interleaved_1f1b (K=2 x v=2: two cells per device slot group, on the
tied model, whose 5 layers make the 4 cells), with the regather at one point: there the
gradient sums' stacks (Empty, StackV2: stateful, no resource) were chained across
replicas the same way and deadlocked, at T=1 as well (cell_functions._new_sum). The model has no attention, so no weight
has the exact zero gradient (a key bias's) whose rounding noise Adam would amplify.
"""
import numpy as np
import pytest
import tensorflow as tf

from tests import test_tensor_parallel_optimizers as tp_optimizers
from tests.test_sharded_gradients import PipelineRun
from tests.test_sharded_optimizer import OPTIMIZERS
from tests.test_sharded_weights import assert_weights_and_slots_equal
from tfpipe import variable_shards
from tfpipe.pipeline import sharding

STEPS = 3
INTERLEAVED = {'schedule': 'interleaved_1f1b', 'virtual_stages': 2, 'tied': True}
GRID = {  # name: (optimizer, K, pipeline params, regather_per_micro_batch)
    'adam_k1': ('adam', 1, {}, False),
    'regather_adam_k2_unrolled': ('adam', 2, {'cell_functions': False}, True),
    'regather_adafactor_k2': ('adafactor', 2, {}, True),
    'adafactor_k1': ('adafactor', 1, {}, False),
    'adafactor_k2': ('adafactor', 2, {}, False),
    'adam_k2_zb_h1': ('adam', 2, {'schedule': 'zb_h1'}, False),
    'adafactor_k2_zb_h2': ('adafactor', 2, {'schedule': 'zb_h2'}, False),
    'tied_adam_k2_v2_interleaved': ('adam', 2, INTERLEAVED, False),
    'tied_regather_adafactor_k2_v2_interleaved': ('adafactor', 2, INTERLEAVED, True)}


@pytest.fixture(scope='module', params=sorted(GRID))
def trained(request):
    """The unsharded and the stage-3 run of one grid point (T=2, R=2) after STEPS steps,
    their losses and the rule."""
    name, k, pipeline_params, regather = GRID[request.param]
    rule = OPTIMIZERS[name].Copy().Set(name=name)
    ref = PipelineRun(2, k, 2, sharding.NONE, rule, **pipeline_params)
    run = PipelineRun(2, k, 2, sharding.WEIGHTS, rule, regather=regather, **pipeline_params)
    return ref, run, ref.train(STEPS), run.train(STEPS), rule


def test_loss_and_clipping_norm_at_every_step_equal_the_unsharded_ones(trained):
    ref, run, want, got, _ = trained
    assert len(got) == STEPS
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_allclose(run.norms, ref.norms, rtol=1e-6)


def test_weights_and_slots_equal_the_unsharded_ones(trained):
    ref, run, _, _, rule = trained
    assert any('_shard1' in path for path in run.pipe.weight_shards.shapes)
    assert_weights_and_slots_equal(ref, run, rule)


def test_each_replica_holds_its_part_of_each_shard_on_the_shards_device(trained):
    """A split weight's shard t stays on its cell's t-th device (the home-device layout),
    each replica holding 1/R of it there; one replica's parts of the T shards stand for
    the whole weight together (variable_shards.of)."""
    ref, run, _, _, _ = trained
    shards = run.pipe.weight_shards
    for r, copy in enumerate(run.pipe.ReplicaVariablesByPath()):
        path_of = {id(var): path for path, var in ref.variables[r].items()}
        for path, var in ref.variables[r].items():
            part = copy[path]
            assert shards.is_part(part) and part.shape == [-(-var.shape.num_elements() // 2)]
            assert part.device == var.device, path
            split = variable_shards.of(var)
            if split is not None:
                joined = variable_shards.of(part)
                assert (joined.path, joined.axis, joined.shape) == (split.path, split.axis,
                                                                     split.shape)
                assert [id(s) for s in joined.shards] == [id(copy[path_of[id(s)]])
                                                          for s in split.shards]


def test_each_gathered_shard_is_read_on_its_own_device(trained):
    """A cell reads each weight where its gather put it: shard t on the cell's t-th device
    (Cell._read_shard), where the shard's compute and gradient sum are, as unsharded,
    rather than via the home device."""
    _, run, _, _, _ = trained
    x, y = tp_optimizers.inputs(0)
    graph = run._step.get_concrete_function(tf.cast(x, tf.float64), y).graph  # the trace run
    reads = [op for op in graph.get_operations()
             if '/theta/' in op.name and op.type == 'Identity']
    assert reads and all(op.device == op.inputs[0].device for op in reads)
    shard_devices = {d for cell in run.pipe.cells for d in cell.shard_devices[1:]}
    assert shard_devices and shard_devices <= {op.device for op in reads}


def test_no_cell_function_call_waits_for_another_task_but_through_its_inputs(trained):
    """Under cell functions each forward call of a tensor-parallel cell (stateful: its
    collectives) is ordered by its inputs alone (the executor's per-device order), not
    chained after the previously built stateful op, which may be another replica's task
    (with the per-task regather that chain deadlocked); nor is the creation of a gradient
    sum's stack (its zeros and the stack: stateful, taking no resource)."""
    _, run, _, _, _ = trained
    x, y = tp_optimizers.inputs(0)
    graph = run._step.get_concrete_function(tf.cast(x, tf.float64), y).graph
    calls = [op for op in graph.get_operations()
             if op.type == 'StatefulPartitionedCall' and '/forward_' in op.name]
    p = run.pipe.params
    # R x M x K*v calls; the unrolled executor (asked for, or a split backward's: zb_*)
    # inlines every task (no calls).
    functional = p.cell_functions and not p.schedule.startswith('zb_')
    assert len(calls) == (2 * 2 * len(run.pipe.cells) if functional else 0)
    stacks = [op for op in graph.get_operations() if op.type in ('StackV2', 'Empty')]
    assert bool(stacks) == functional  # every cell here recomputes
    assert all(not op.control_inputs for op in calls + stacks), [
        (op.name, [c.name for c in op.control_inputs]) for op in calls + stacks]


def test_checkpoint_is_the_unsharded_one_and_restores_into_the_parts(trained, tmp_path):
    """Saved whole under the T=1 keys (no `_shard`), the unsharded run's values within
    1e-5; the unsharded checkpoint restored into the stage-3 run saves back exactly.
    (Last: it overwrites the stage-3 run's values.)"""
    ref, run, _, _, _ = trained
    unsharded = ref.save(tmp_path / 'unsharded')
    want = tp_optimizers.contents(unsharded)
    got = tp_optimizers.contents(run.save(tmp_path / 'stage3'))
    assert not any('shard' in key for key in got), sorted(got)
    assert 'model/pipe.Sfc0.Sw/.ATTRIBUTES/VARIABLE_VALUE' in got  # whole: fc0/w_shard0, 1
    assert sorted(got) == sorted(want)
    for key, value in want.items():  # atol: an Adam moment near 0 (the weights' test's)
        np.testing.assert_allclose(got[key], value, rtol=1e-5, atol=1e-8, err_msg=key)
    run.restore(unsharded)
    tp_optimizers.assert_same(tp_optimizers.contents(run.save(tmp_path / 'restored')), want,
                              rtol=0)
