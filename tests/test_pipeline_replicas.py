"""Data parallel x pipeline in one process, on real logical-CPU placement.

R replicas x K cells x M micro-batches run the micro-batches that one pipeline
with R*M micro-batches runs, so one replicated step must equal that pipeline's
step: loss, gradients, updated weights and BatchNorm moving statistics. Without
BatchNorm (whose training statistics are per micro-batch, as in GPipe) it must
also equal the unpartitioned model (K=1, M=1). Dropout masks are keyed by the
global example index, so they do not change with R.
"""
import numpy as np
import pytest
import tensorflow as tf

from tests import model_zoo as mz
from tfpipe import fprop_context
from tfpipe.tuning.trace import ops_per_device

STEP = 3
LR = 0.1


def replicated(body, num_replicas, num_cells, num_micro_batches, **kw):
    return mz.pipeline(body, num_cells, num_micro_batches, num_replicas=num_replicas, **kw)


def mirrored_sgd_steps(pipe, x, y, steps, schedule_name=None):
    """The trainer's form: every replica applies its all-reduced gradients to its copy."""
    @tf.function
    def run(step):
        with fprop_context.training(step=step):
            loss, grads = pipe.ForwardBackward(pipe.ReplicaThetas(), x, mz.loss_fn, y)
        for theta, replica_grads in zip(pipe.ReplicaThetas(), grads):
            for v, g in zip(tf.nest.flatten(theta), tf.nest.flatten(replica_grads)):
                v.assign_sub(LR * g)
        return loss, grads[0]

    out = []
    for i in range(steps):
        loss, grads = run(tf.constant(STEP + i, tf.int64))
        out.append((loss.numpy(), [g.numpy() for g in tf.nest.flatten(grads)]))
    return out


def plain_sgd_steps(pipe, x, y, steps):
    @tf.function
    def run(step):
        with fprop_context.training(step=step):
            loss, grads = pipe.ForwardBackward(pipe.theta, x, mz.loss_fn, y)
        for v, g in zip(tf.nest.flatten(pipe.theta), tf.nest.flatten(grads)):
            v.assign_sub(LR * g)
        return loss, grads

    out = []
    for i in range(steps):
        loss, grads = run(tf.constant(STEP + i, tf.int64))
        out.append((loss.numpy(), [g.numpy() for g in tf.nest.flatten(grads)]))
    return out


def assert_close(a, b, what):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-9, err_msg=what)


def assert_same_steps(got, want):
    for i, ((loss_a, grads_a), (loss_b, grads_b)) in enumerate(zip(got, want)):
        assert_close(loss_a, loss_b, f'loss at step {i}')
        for j, (ga, gb) in enumerate(zip(grads_a, grads_b)):
            assert_close(ga, gb, f'gradient {j} at step {i}')


def bn_stats(pipe):
    return {n: (pipe.children[n].moving_mean.numpy(), pipe.children[n].moving_variance.numpy())
            for n in pipe.children if n.startswith('bn')}


def assert_replicas_identical(pipe):
    copies = pipe.ReplicaVariablesByPath()
    for path, var in copies[0].items():
        for r, mirror in enumerate(copies[1:], start=1):
            assert mirror[path] is not var
            np.testing.assert_array_equal(mirror[path].numpy(), var.numpy(),
                                          err_msg=f'replica {r} {path}')


_unpartitioned = {}


def unpartitioned_mlp_steps():
    """3 SGD steps of the unpartitioned MLP (K=1, M=1) and its weights after them, run
    once per module: several tests compare with them (tracing is the cost)."""
    if not _unpartitioned:
        body = mz.mlp_body()
        x, y = mz.inputs_for(body)
        reference = mz.pipeline(body, 1, 1)
        _unpartitioned['steps'] = plain_sgd_steps(reference, x, y, 3)
        _unpartitioned['weights'] = mz.snapshot(tf.nest.flatten(reference.theta))
    return _unpartitioned['steps'], _unpartitioned['weights']


@pytest.mark.parametrize('schedule_name', ['fill_drain', '1f1b'])
@pytest.mark.parametrize('recompute', ['always', 'never'])
def test_mlp_with_dropout_equals_unpartitioned(schedule_name, recompute):
    body = mz.mlp_body()
    x, y = mz.inputs_for(body)
    pipe = replicated(body, 2, 2, 2, recompute=recompute, schedule=schedule_name)
    want, want_weights = unpartitioned_mlp_steps()
    got = mirrored_sgd_steps(pipe, x, y, 3)
    assert len(got) == len(want) == 3
    assert_same_steps(got, want)
    weights = tf.nest.flatten(pipe.theta)
    assert len(weights) == len(want_weights)
    for a, b in zip(weights, want_weights):
        assert_close(a.numpy(), b, 'weights after 3 steps')
    assert_replicas_identical(pipe)


@pytest.mark.parametrize('schedule_name', ['fill_drain', '1f1b'])
def test_batch_norm_equals_one_pipeline_over_the_whole_batch(schedule_name):
    """R=2, M=2 runs the 4 micro-batches of R=1, M=4: same BN statistics per micro-batch."""
    body = mz.conv_body(batch_norm=True)
    x, y = mz.inputs_for(body)
    pipe = replicated(body, 2, 2, 2, schedule=schedule_name)
    reference = mz.pipeline(body, 1, 4)
    assert_same_steps(mirrored_sgd_steps(pipe, x, y, 3), plain_sgd_steps(reference, x, y, 3))
    for name, (mean, var) in bn_stats(reference).items():
        got_mean, got_var = bn_stats(pipe)[name]
        assert_close(got_mean, mean, f'{name} moving mean')
        assert_close(got_var, var, f'{name} moving variance')
        assert not np.allclose(mean, 0.0), 'the moving mean never moved: the test proves nothing'
    assert_replicas_identical(pipe)


def test_one_theta_is_broadcast_and_gradients_summed():
    """ForwardBackward(theta) and FProp under a tape: every replica reads the given
    weights, and the gradients of all replicas come back summed."""
    body = mz.mlp_body()
    x, y = mz.inputs_for(body)
    pipe = replicated(body, 2, 2, 2)
    assert_same_steps(plain_sgd_steps(pipe, x, y, 2), unpartitioned_mlp_steps()[0][:2])
    reference = mz.pipeline(body, 1, 1)  # the unpartitioned model at pipe's weights
    for v, w in zip(tf.nest.flatten(reference.theta), tf.nest.flatten(pipe.theta)):
        v.assign(w)
    out, loss, grads = mz.sgd_step_tape(pipe, x, y, STEP)
    want_out, want_loss, want_grads = mz.sgd_step_tape(reference, x, y, STEP)
    assert_close(out, want_out, 'outputs under a tape')
    assert_close(loss, want_loss, 'loss under a tape')
    for g, w in zip(grads, want_grads):
        assert_close(g, w, 'gradient under a tape')


def test_eval_outputs_and_uneven_groups():
    """Eval FProp over R=3 replicas with a batch of 10 (micro-batches 2,2,2,2,1,1)."""
    body = mz.mlp_body()
    x, _ = mz.inputs_for(body)
    pipe = replicated(body, 3, 2, 2)
    reference = mz.sequential(body)
    with fprop_context.evaluation():
        got = tf.function(lambda: pipe(x))()
        want = reference(x)
    assert_close(got.numpy(), want.numpy(), 'eval outputs')


def test_each_replica_runs_on_its_own_devices():
    body = mz.mlp_body()
    x, y = mz.inputs_for(body)
    pipe = replicated(body, 2, 2, 2)
    assert [list(d) for d in pipe.replica_devices] == [
        ['/job:localhost/replica:0/task:0/device:CPU:0',
         '/job:localhost/replica:0/task:0/device:CPU:1'],
        ['/job:localhost/replica:0/task:0/device:CPU:2',
         '/job:localhost/replica:0/task:0/device:CPU:3']]
    for cells in pipe.replica_cells:
        for cell in cells:
            for layer in cell.layers:
                for var in layer.VariablesByPath().values():
                    assert var.device == cell.device

    @tf.function
    def step():
        with fprop_context.training(step=STEP):
            return pipe.ForwardBackward(pipe.ReplicaThetas(), x, mz.loss_fn, y)

    counts = ops_per_device(step.get_concrete_function())
    for device in ('CPU:0', 'CPU:1', 'CPU:2', 'CPU:3'):
        placed = sum(n for d, n in counts.items() if d.endswith(device))
        assert placed > 20, f'{device} runs only {placed} ops: {counts}'
    graph = step.get_concrete_function().graph.as_graph_def()
    reduces = [n for f in [graph] + list(graph.library.function)
               for n in (f.node if hasattr(f, 'node') else f.node_def)
               if n.op.startswith('CollectiveReduce')]
    assert len(reduces) == 2 * 2, 'one packed all-reduce per (cell, replica)'


def test_checkpoint_holds_one_copy_and_sync_restores_mirrors(tmp_path):
    body = mz.mlp_body()
    pipe = replicated(body, 2, 2, 2)
    assert set(pipe.VariablesByPath()) == set(pipe.ReplicaVariablesByPath()[1])
    ckpt = tf.train.Checkpoint(model=pipe.VariablesByPath())
    saved = {p: v.numpy() for p, v in pipe.VariablesByPath().items()}
    path = ckpt.save(str(tmp_path / 'ckpt'))
    names = [n for n, _ in tf.train.list_variables(path) if n.startswith('model/')]
    assert len(names) == len(saved)
    other = replicated(body, 2, 4, 1, random_seed=7)  # another R x K layout, other weights
    assert not np.allclose(other.ReplicaVariablesByPath()[1]['pipe/fc0/w'].numpy(),
                           saved['pipe/fc0/w'])
    tf.train.Checkpoint(model=other.VariablesByPath()).restore(path).assert_consumed()
    other.SyncReplicas()
    for copies in other.ReplicaVariablesByPath():
        for p, v in copies.items():
            np.testing.assert_array_equal(v.numpy(), saved[p])


@pytest.mark.parametrize('bad, message', [
    (dict(num_replicas=0), 'num_replicas=0 must be an int >= 1'),
    (dict(num_replicas=5), 'cells'),
])
def test_bad_replica_params(bad, message):
    with pytest.raises(ValueError, match=message):
        replicated(mz.mlp_body(), bad.pop('num_replicas'), 2, 2, **bad)


def test_batch_smaller_than_replicas_is_refused():
    body = mz.mlp_body()
    x, y = mz.inputs_for(body, batch=2)
    pipe = replicated(body, 3, 1, 1)
    with pytest.raises(ValueError, match='cannot feed num_replicas=3'):
        with fprop_context.training(step=0):
            pipe.ForwardBackward(pipe.ReplicaThetas(), x, mz.loss_fn, y)


def test_wrong_number_of_thetas_is_refused():
    body = mz.mlp_body()
    x, y = mz.inputs_for(body)
    pipe = replicated(body, 2, 2, 1)
    with pytest.raises(ValueError, match='got 3 thetas for num_replicas=2'):
        pipe.ForwardBackward([pipe.theta] * 3, x, mz.loss_fn, y)
