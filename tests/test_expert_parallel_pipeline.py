"""Expert parallelism in a pipeline: a step with P replicas sharing each MoE layer's
experts is the P=1 step with the same R replicas (loss, auxiliary losses, gradients and
SGD-updated weights within 1e-5, float64, capacity that drops nothing), on the logical CPUs of
conftest.py: P in {1, 2, 4} x R in {P, 2P} x K in {1, 2} with R*K <= 8, and P=2 x T=2, under
cell functions (the default); P=2, R=2, K=2 points also on the unrolled executor."""
import os
import re

import numpy as np
import pytest
import tensorflow as tf

import tfpipe
from tests import model_zoo as mz
from tfpipe import checkpoints, fprop_context, layers, variable_shards
from tfpipe.base_layer import flatten_by_path
from tfpipe.layers.mixture_of_experts import MoEFeedForward
from tfpipe.layers.tensor_parallel_dense import ColumnParallelDense
from tfpipe.pipeline import expert_parallel, partition

F64 = tf.float64
STEP = 7
EXPERT_WEIGHTS = ('wi', 'bi', 'wo', 'bo')
GRID = [(p, r, k) for p in (1, 2, 4) for r in (p, 2 * p) for k in (1, 2) if r * k <= 8]


def body(fc0=layers.Dense):
    return [
        fc0.Params().Set(name='fc0', input_dim=6, output_dim=8, activation='tanh', dtype=F64),
        MoEFeedForward.Params().Set(name='moe', model_dim=8, hidden_dim=6, num_experts=4,
                                    capacity_factor=2.0, z_loss_weight=0.01, dtype=F64),
        layers.Dense.Params().Set(name='fc2', input_dim=8, output_dim=5, dtype=F64),
    ]


def pipeline(p, r, k, m=2, fc0=layers.Dense, **kw):
    return tfpipe.PipeliningLayer.Params().Set(
        name='pipe', body=body(fc0), balance=partition.even_balance(3, k), num_micro_batches=m,
        num_replicas=r, expert_parallel=p, **kw).Instantiate()


def whole(pipe, per_replica, p):
    """{path: value}: replica 0's, with each expert weight the concatenation of the P
    members' slices (replicas 0..P-1)."""
    out = dict(per_replica[0])
    for path in out:
        if path.rsplit('/', 1)[-1] in EXPERT_WEIGHTS and p > 1:
            out[path] = np.concatenate([per_replica[r][path] for r in range(p)])
    return out


def step(pipe, p, check_graph=None):
    """One SGD step of every replica through ForwardBackward(ReplicaThetas()) (the
    trainer's form): (loss and auxiliary losses, whole gradients, whole updated weights).
    check_graph(graph) looks at the traced step before it runs (a deadlock would hang)."""
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=[16, 6]), F64)
    y = tf.constant(rng.integers(0, 5, size=[16]), tf.int32)

    @tf.function(autograph=False)
    def run():
        sink = fprop_context.AuxLossSink()
        with fprop_context.training(step=STEP), fprop_context.scope(aux_losses=sink):
            loss, grads = pipe.ForwardBackward(pipe.ReplicaThetas(), x, mz.loss_fn, y)
            for theta, g in zip(pipe.ReplicaThetas(), grads):
                for v, d in zip(tf.nest.flatten(theta), tf.nest.flatten(g)):
                    v.assign_sub(0.1 * d)
        return [loss, sink.metrics()['aux_loss'], sink.metrics()['z_loss']], grads
    if check_graph is not None:
        check_graph(run.get_concrete_function().graph)
    loss, grads = run()
    grads = grads if isinstance(grads, list) else [grads]
    grads = [{q: g.numpy() for q, g in flatten_by_path(gr, 'pipe').items()} for gr in grads]
    weights = [{q: v.numpy() for q, v in vs.items()} for vs in pipe.ReplicaVariablesByPath()]
    return np.array(loss), whole(pipe, grads, p), whole(pipe, weights, p)


_runs = {}


def run_of(p, r, k):
    """The step of grid point (P, R, K), once per process (the P=1 ones are references)."""
    if (p, r, k) not in _runs:
        _runs[p, r, k] = step(pipeline(p, r, k), p)
    return _runs[p, r, k]


@pytest.mark.parametrize('p,r,k', [g for g in GRID if g[0] > 1])
def test_step_equals_p1(p, r, k):
    loss, grads, weights = run_of(p, r, k)
    ref_loss, ref_grads, ref_weights = run_of(1, r, k)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for what, got, want in (('grads', grads, ref_grads), ('weights', weights, ref_weights)):
        assert sorted(got) == sorted(want)
        for path in want:
            np.testing.assert_allclose(got[path], want[path], rtol=1e-5, atol=1e-12,
                                       err_msg=f'{what} {path}')
    assert np.abs(ref_grads['pipe/moe/wi']).max() > 1e-4
    assert ref_loss[1] > 0.01 and ref_loss[2] > 0  # the auxiliary losses were compared


@pytest.mark.parametrize('recompute,schedule,cell_functions', [
    ('never', '1f1b', True), ('always', '1f1b', False), ('except_last', 'zb_h1', False)])
def test_schedules_recompute_and_executors_equal_p1(recompute, schedule, cell_functions):
    """P=2, R=2, K=2 under other schedules, recompute policies (the recomputed forward
    repeats the all-to-all) and both executors (zb_h1: the split backward's unrolled
    tasks) against the P=1 step, which every schedule equals."""
    pipe = pipeline(2, 2, 2, recompute=recompute, schedule=schedule,
                    cell_functions=cell_functions)
    loss, grads, weights = step(pipe, 2)
    ref_loss, ref_grads, ref_weights = run_of(1, 2, 2)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for got, want in ((grads, ref_grads), (weights, ref_weights)):
        for path in want:
            np.testing.assert_allclose(got[path], want[path], rtol=1e-5, atol=1e-12,
                                       err_msg=path)


def sums_wait_for_their_replica_only(pipe):
    """check_graph: each gradient sum's stack and zeros (StackV2, Empty) wait only for ops
    on its own replica's devices. tf.function's automatic control dependencies had chained
    them after every stateful op built before, replica 0's backward all-to-all among them,
    whose member on replica 1 waits for those sums: the step deadlocked."""
    def check(graph):
        replica_of = {d: r for r, devices in enumerate(pipe.replica_devices) for d in devices}
        sums = [op for op in graph.get_operations() if op.type in ('StackV2', 'Empty')]
        assert len(sums) == 2 * 2 * (2 + 7)  # R x (stack, zeros) x both cells' flat weights
        crossing = [(op.name, c.name) for op in sums for c in op.control_inputs
                    if replica_of[c.device] != replica_of[op.device]]
        assert not crossing
    return check


@pytest.mark.parametrize('cell_functions', [True, False])
def test_experts_in_a_recomputing_last_cell_train_and_equal_p1(cell_functions):
    """The trainer's MoE LM has its experts in its last cell, whose recomputing backward
    under cell functions deadlocked in the all-to-all (K=2, M=2, recompute always) until
    the gradient sums were left out of the step's program-order chain
    (cell_functions._run_independently). Both executors equal P=1."""
    pipe = tfpipe.PipeliningLayer.Params().Set(
        name='pipe', body=body(), balance=[1, 2], num_micro_batches=2, num_replicas=2,
        expert_parallel=2, recompute='always', cell_functions=cell_functions).Instantiate()
    loss, grads, weights = step(pipe, 2,
                                sums_wait_for_their_replica_only(pipe) if cell_functions else None)
    ref_loss, ref_grads, ref_weights = run_of(1, 2, 2)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for got, want in ((grads, ref_grads), (weights, ref_weights)):
        for path in want:
            np.testing.assert_allclose(got[path], want[path], rtol=1e-5, atol=1e-12,
                                       err_msg=path)


def test_replicas_hold_their_experts():
    pipe = pipeline(2, 4, 1)
    held = [vs['pipe/moe/wi'] for vs in pipe.ReplicaVariablesByPath()]
    assert all(v.shape == [2, 8, 6] for v in held)
    assert [expert_parallel.is_expert_variable(v) for v in held] == [True] * 4
    np.testing.assert_array_equal(held[0].numpy(), held[2].numpy())  # same rank, same experts
    assert not np.array_equal(held[0].numpy(), held[1].numpy())


@pytest.mark.parametrize('p,r,experts,fix', [
    (3, 4, 6, 'pipe: expert_parallel=3 does not divide num_replicas=4'),
    (4, 4, 6, 'pipe/moe: num_experts=6 is not divisible by expert_parallel=4')])
def test_bad_expert_parallel_at_instantiation(p, r, experts, fix):
    """P not dividing R, and E not divisible by P, fail when the params are instantiated
    (before any tracing), each in one line naming both numbers."""
    params = tfpipe.PipeliningLayer.Params().Set(name='pipe', body=body(), balance=[3],
                                                 num_replicas=r, expert_parallel=p)
    params.body[1].num_experts = experts
    with pytest.raises(ValueError, match=fix) as info:
        params.Instantiate()
    assert '\n' not in str(info.value)


def test_jit_compile_with_expert_parallel_is_refused_in_one_line():
    """XLA has no kernel for the all-to-all: the step failed to compile."""
    with pytest.raises(ValueError, match=r'^pipe: jit_compile=True .* set jit_compile=False$'
                       ) as info:
        pipeline(2, 2, 1, jit_compile=True)
    assert '\n' not in str(info.value)


def test_uneven_micro_batches_are_refused():
    pipe = pipeline(2, 2, 1)
    x, y = tf.zeros([6, 6], F64), tf.zeros([6], tf.int32)  # 6 over R*M=4: 2, 2, 1, 1
    with fprop_context.training(step=STEP), pytest.raises(ValueError, match='uneven'):
        pipe.ForwardBackward(pipe.ReplicaThetas(), x, mz.loss_fn, y)


def test_checkpoint_is_independent_of_p(tmp_path):
    """A P=2 checkpoint holds every expert weight whole ([E, ...] under the layer's path)
    and restores into P=1, P=4 and P=2 with R=4 (replicas 2, 3 take their experts from
    the replicas of group 0 with the same rank)."""
    source = pipeline(2, 2, 1, random_seed=11)
    saved = {path: (v.value() if isinstance(v, variable_shards.ShardedWeight) else v).numpy()
             for path, v in variable_shards.whole_view(source.VariablesByPath()).items()}
    assert saved['pipe/moe/wi'].shape == (4, 8, 6)
    path = checkpoints.make(source.VariablesByPath()).write(str(tmp_path / 'ckpt'))
    for p, r in ((1, 2), (4, 4), (2, 4)):
        target = pipeline(p, r, 1)
        assert not np.array_equal(target.theta['fc0']['w'].numpy(), saved['pipe/fc0/w'])
        checkpoints.make(target.VariablesByPath()).read(path).assert_consumed()
        target.SyncReplicas()
        replica_values = [{q: v.numpy() for q, v in vs.items()}
                          for vs in target.ReplicaVariablesByPath()]
        for group in range(r // p):
            got = whole(target, replica_values[group * p:(group + 1) * p], p)
            for q in saved:
                np.testing.assert_array_equal(got[q], saved[q], err_msg=f'P={p} R={r} {q}')


def test_trainer_bad_expert_parallel_exits_2_before_the_logdir(tmp_path, data_dir):
    from tests import trainer_helpers as th
    logdir = str(tmp_path / 'fresh')
    result = th.run(th.FAST, logdir, data_dir, '--max_steps=2', th.overrides(
        **{'task.pipeline.num_replicas': 2, 'task.pipeline.expert_parallel': 3}))
    assert result.returncode == 2, result.stderr[-3000:]
    assert re.search(r'^error: .*expert_parallel=3 does not divide num_replicas=2: .*set '
                     'expert_parallel to a divisor of num_replicas', th.error_line(result))
    assert not os.path.exists(logdir)


def test_evaluation_fprop_reads_each_replicas_experts():
    """FProp with one theta (an evaler's form) at P=2: each replica reads its own experts,
    so the outputs are P=1's."""
    x = tf.constant(np.random.default_rng(1).normal(size=[8, 6]), F64)
    outs = []
    for p in (2, 1):
        pipe = pipeline(p, 2, 1)
        with fprop_context.evaluation():
            outs.append(tf.function(lambda: pipe.FProp(pipe.theta, x), autograph=False)())
    np.testing.assert_allclose(outs[0].numpy(), outs[1].numpy(), rtol=1e-5, atol=1e-12)


def _join_column_shards(values: dict) -> dict:
    """{path: value} with a ColumnParallelDense's w_shard<t> / b_shard<t> joined whole."""
    out = {q: v for q, v in values.items() if '_shard' not in q}
    for q in sorted(q for q in values if q.endswith('_shard0')):
        base = q[:-len('_shard0')]
        parts = [values[f'{base}_shard{t}'] for t in range(2)]
        out[base] = np.concatenate(parts, axis=ColumnParallelDense.AXIS if parts[0].ndim > 1
                                   else 0)
    return out


def test_with_tensor_parallelism_equals_p1():
    """P=2 x T=2 (R=2, K=1): fc0 column-parallel over each replica's T devices, the
    experts and their all-to-all on the replica's home device; the step equals the
    unsplit P=1 step (Dense fc0, whose variables ColumnParallelDense's shards join into)."""
    loss, grads, weights = step(pipeline(2, 2, 1, tensor_parallel=2,
                                         fc0=ColumnParallelDense), 2)
    assert 'pipe/fc0/w_shard1' in grads  # fc0 really split over the T devices
    grads, weights = _join_column_shards(grads), _join_column_shards(weights)
    ref_loss, ref_grads, ref_weights = run_of(1, 2, 1)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for got, want in ((grads, ref_grads), (weights, ref_weights)):
        assert sorted(got) == sorted(want)
        for path in want:
            np.testing.assert_allclose(got[path], want[path], rtol=1e-5, atol=1e-12,
                                       err_msg=path)
