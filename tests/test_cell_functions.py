"""PipeliningLayer(cell_functions=True, the default; jit_compile=...): per-cell traced functions.

Each cell's forward and backward are traced once and called per micro-batch; the
step must equal the unrolled executor's step (loss, gradients, updated weights,
BatchNorm moving statistics), keep every call and every op of cell k on device
k, and fall back to the unrolled tasks where the functions cannot follow.
"""
import numpy as np
import pytest
import tensorflow as tf

from tests import model_zoo as mz
from tests import test_pipeline_placement as placement
from tfpipe import fprop_context, layers
from tfpipe.layers.dropout import stateless_uniform_slice
from tfpipe.tuning import trace

STEP = 7
CALL_OPS = ('StatefulPartitionedCall', 'PartitionedCall')


def body_with_dropout_and_batch_norm():
    """Dense, Dropout and BatchNorm in every cell of a K=4 cut."""
    body = []
    for i in range(4):
        body += [layers.Dense.Params().Set(name=f'fc{i}', input_dim=12 if i == 0 else 16,
                                           output_dim=16, activation='relu'),
                 layers.Dropout.Params().Set(name=f'drop{i}', keep_prob=0.8),
                 layers.BatchNorm.Params().Set(name=f'bn{i}', dim=16, decay=0.9)]
    body.append(layers.Dense.Params().Set(name='logits', input_dim=16, output_dim=5))
    for p in body:
        p.dtype = tf.float64
    return body


def trainer_step(pipe, x, y):
    """One SGD step through ForwardBackward: loss, grads, weights and BN statistics after."""
    loss, grads = mz.sgd_step_forward_backward(pipe, x, y, STEP)
    after = {path: v.numpy() for path, v in pipe.VariablesByPath().items()}
    return loss, grads, after


def assert_same_step(actual, expected, rtol=1e-10, atol_of_largest=0.0):
    """atol_of_largest: each gradient may also differ by this fraction of its largest
    entry (another kernel's rounding of a sum that cancels to near zero)."""
    np.testing.assert_allclose(actual[0], expected[0], rtol=rtol)
    assert len(actual[1]) == len(expected[1])
    for i, (a, e) in enumerate(zip(actual[1], expected[1])):
        atol = max(1e-12, atol_of_largest * float(np.max(np.abs(e))))
        np.testing.assert_allclose(a, e, rtol=rtol, atol=atol, err_msg=f'grad {i}')
    assert sorted(actual[2]) == sorted(expected[2])
    for path in expected[2]:
        np.testing.assert_allclose(actual[2][path], expected[2][path], rtol=rtol, atol=1e-12,
                                   err_msg=path)


_unrolled_steps = {}


def unrolled_step(num_micro_batches):
    """The unrolled executor's step at K=2, recompute='always', traced once per M for every
    K and policy below: the unrolled step does not depend on K or on the recompute policy
    (bitwise; each (K, policy) of it is held to the unpartitioned step by
    tests/test_pipeline_transparency.py), while BatchNorm's statistics and the dropout
    offsets do depend on M."""
    if num_micro_batches not in _unrolled_steps:
        body = body_with_dropout_and_batch_norm()
        x, y = mz.inputs_for(body)
        _unrolled_steps[num_micro_batches] = trainer_step(
            mz.pipeline(body, 2, num_micro_batches, 'always', cell_functions=False), x, y)
    return _unrolled_steps[num_micro_batches]


@pytest.mark.parametrize('num_cells', [2, 4])
@pytest.mark.parametrize('num_micro_batches', [1, 3])
@pytest.mark.parametrize('recompute', ['always', 'except_last', 'never'])
def test_forward_backward_equals_unrolled(num_cells, num_micro_batches, recompute):
    body = body_with_dropout_and_batch_norm()
    x, y = mz.inputs_for(body)
    pipe = mz.pipeline(body, num_cells, num_micro_batches, recompute, cell_functions=True)
    assert_same_step(trainer_step(pipe, x, y), unrolled_step(num_micro_batches))


def test_fprop_under_tape_and_eval_equal_unrolled():
    body = body_with_dropout_and_batch_norm()
    x, y = mz.inputs_for(body)
    results = []
    for cell_functions in (False, True):
        pipe = mz.pipeline(body, 4, 3, 'except_last', cell_functions=cell_functions)
        out, loss, grads = mz.sgd_step_tape(pipe, x, y, STEP)
        with fprop_context.evaluation():
            evaluated = tf.function(pipe.FProp)(pipe.theta, x).numpy()
        results.append((out, loss, grads, evaluated))
    (out0, loss0, grads0, eval0), (out1, loss1, grads1, eval1) = results
    np.testing.assert_allclose(out1, out0, rtol=1e-10)
    np.testing.assert_allclose(loss1, loss0, rtol=1e-10)
    for a, e in zip(grads1, grads0):
        np.testing.assert_allclose(a, e, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(eval1, eval0, rtol=1e-10)


def test_skips_bfloat16_and_replicas_equal_unrolled():
    body = [layers.Dense.Params().Set(name='fc0', input_dim=12, output_dim=16),
            layers.Stash.Params().Set(name='stash', key='skip'),
            layers.Dense.Params().Set(name='fc1', input_dim=16, output_dim=16,
                                      activation='relu'),
            layers.Dense.Params().Set(name='fc2', input_dim=16, output_dim=16,
                                      activation='relu'),
            layers.Pop.Params().Set(name='pop', key='skip'),
            layers.Dense.Params().Set(name='logits', input_dim=16, output_dim=5)]
    x, y = mz.inputs_for(body, dtype=tf.float32)
    for extra in ({}, {'fprop_dtype': tf.bfloat16}, {'num_replicas': 2}):
        expected = trainer_step(mz.pipeline(body, 3, 2, cell_functions=False, **extra), x, y)
        got = trainer_step(mz.pipeline(body, 3, 2, cell_functions=True, **extra),
                           x, y)
        assert_same_step(got, expected, rtol=1e-5)


def test_batch_norm_nested_in_a_composite_layer_records_its_statistics():
    block = layers.Sequential.Params().Set(name='block', body=[
        layers.Dense.Params().Set(name='fc', input_dim=12, output_dim=16, activation='relu'),
        layers.BatchNorm.Params().Set(name='bn', dim=16, decay=0.9)])
    body = [block, layers.Dense.Params().Set(name='logits', input_dim=16, output_dim=5)]
    for p in body + block.body:
        p.dtype = tf.float64
    x, y = mz.inputs_for(mz.mlp_body())  # 12 features
    expected = trainer_step(mz.pipeline(body, 2, 3, cell_functions=False), x, y)
    got = trainer_step(mz.pipeline(body, 2, 3, cell_functions=True), x, y)
    assert_same_step(got, expected)
    assert not np.allclose(got[2]['pipe/block/bn/moving_mean'], 0.0)  # updated


def _traced_step(pipe, x, y):
    @tf.function
    def step():
        with fprop_context.training(step=STEP):
            return pipe.ForwardBackward(pipe.theta, x, mz.loss_fn, y)
    return step.get_concrete_function()


def test_one_call_per_task_on_its_cells_device_and_every_op_inside_placed():
    body = body_with_dropout_and_batch_norm()
    x, y = mz.inputs_for(body)
    pipe = mz.pipeline(body, 4, 3, 'except_last', cell_functions=True)
    concrete = _traced_step(pipe, x, y)
    calls = [op for op in concrete.graph.get_operations() if op.type in CALL_OPS]
    # Forward and backward calls of the 3 recomputing cells, but for each cell's last
    # backward, unrolled so that its final sums leave one by one. The last cell keeps
    # its activations, so it trains as unrolled ops (faster than the gradient of a call).
    assert len(calls) == 3 * 3 + 3 * 2
    for op in calls:
        cell = trace.cell_of_node(op.name)
        assert trace.device_index(op.device) == f'CPU:{cell}', op.name
    # Every op the cell functions hold is placed explicitly, and so is every op of the
    # unrolled last cell.
    inside = [n for n in trace.nodes(concrete) if n.function and n.op not in trace.PLUMBING_OPS]
    assert inside and all(n.device for n in inside), [n for n in inside if not n.device][:3]
    assert {trace.device_index(n.device) for n in inside} == {f'CPU:{k}' for k in range(3)}
    last = [op for op in concrete.graph.get_operations()
            if trace.cell_of_node(op.name) == 3 and op.type == 'MatMul']
    assert last and {trace.device_index(op.device) for op in last} == {'CPU:3'}


@pytest.mark.parametrize('recompute', ['always', 'never'])
def test_1f1b_order_on_each_device_is_kept(recompute):
    num_micro = 6
    body = mz.mlp_body()
    x, y = mz.inputs_for(body)
    pipe = mz.pipeline(body, 4, num_micro, recompute, schedule='1f1b', cell_functions=True)
    waits = placement.task_waits(_traced_step(pipe, x, y))
    for k in range(4):
        for m in range(1, min(4 - k, num_micro)):  # the warm-up forwards, in order
            assert f'pipe/cell_{k}/forward_{m - 1}' in waits[f'pipe/cell_{k}/forward_{m}']
        warmup = min(4 - k, num_micro)
        for i in range(num_micro - warmup):
            forward = f'pipe/cell_{k}/forward_{warmup + i}'
            assert f'pipe/cell_{k}/backward_{i}' in waits[forward], (k, i)
            assert forward in waits[f'pipe/cell_{k}/backward_{i + 1}'], (k, i)
        for m in range(num_micro):  # the incoming gradient gates the backward
            source = (f'pipe/cell_{k + 1}/backward_{m}' if k + 1 < 4
                      else f'pipe/cell_{k}/loss_{m}')
            assert source in waits[f'pipe/cell_{k}/backward_{m}'], (k, m)


def test_split_backward_falls_back_to_unrolled_tasks():
    body = mz.mlp_body()
    x, y = mz.inputs_for(body)
    pipe = mz.pipeline(body, 2, 2, schedule='zb_h1', cell_functions=True)
    ops = _traced_step(pipe, x, y).graph.get_operations()
    assert not [op for op in ops if op.type in CALL_OPS]
    expected = trainer_step(mz.pipeline(body, 2, 2, schedule='zb_h1', cell_functions=False),
                            x, y)
    assert_same_step(trainer_step(pipe, x, y), expected)


def _task_ancestors(op):
    """The ops of `op`'s task scope that it waits for, directly or not."""
    scope = op.name.rsplit('/', 1)[0] + '/'
    seen, todo = set(), list(op.control_inputs) + [t.op for t in op.inputs]
    while todo:
        a = todo.pop()
        if a not in seen and a.name.startswith(scope):
            seen.add(a)
            todo += list(a.control_inputs) + [t.op for t in a.inputs]
    return seen


@pytest.mark.parametrize('recompute', ['always', 'except_last'])
def test_timeline_records_the_calls_and_the_recompute_inside_the_backward(recompute):
    """RecordTimeline keeps the cell functions: every task of a recomputing cell is still
    one call, stamped outside, and its backward function stamps the end of its recompute
    inside, after the recomputed forward and before any gradient op."""
    body = mz.mlp_body()
    x, y = mz.inputs_for(body)
    pipe = mz.pipeline(body, 2, 2, recompute, cell_functions=True)

    @tf.function
    def recorded():
        with fprop_context.training(step=STEP), pipe.RecordTimeline() as recorder:
            pipe.ForwardBackward(pipe.theta, x, mz.loss_fn, y)
        return recorder.stamps()
    concrete = recorded.get_concrete_function()
    calls = [op for op in concrete.graph.get_operations() if op.type in CALL_OPS]
    # A forward call per (recomputing cell, micro-batch) and a backward call but for the
    # cell's last micro-batch; a cell that keeps its activations trains as unrolled ops,
    # stamped like the unrolled executor's.
    assert len(calls) == (2 + 1) * sum(cell.recompute for cell in pipe.cells)
    for op in calls:  # each call waits for its task's start stamp
        assert 'Timestamp' in {a.type for a in _task_ancestors(op)}, op.name
    graph_def = concrete.graph.as_graph_def()
    stamped = []
    for fn in graph_def.library.function:
        nodes = {n.name: n for n in fn.node_def}
        stamps = [n for n in fn.node_def if n.op == 'Timestamp']
        if not stamps:
            continue
        stamped.append(fn.signature.name)
        (stamp,) = stamps
        # It waits for the recomputed output (the cell's last forward op) ...
        assert stamp.input and all(i.startswith('^') for i in stamp.input)
        assert {nodes[i[1:]].op for i in stamp.input} <= {'Tanh', 'Identity'}, stamp.input
        # ... and every gradient op waits for it.
        after, grown = {stamp.name}, True
        while grown:
            grown = False
            for n in fn.node_def:
                if n.name not in after and any(i.lstrip('^').split(':')[0] in after
                                               for i in n.input):
                    after.add(n.name)
                    grown = True
        gradient_ops = [n for n in fn.node_def if n.op in ('MatMul', 'TanhGrad', 'ReluGrad')
                        and 'gradient' in n.name]
        assert gradient_ops and all(n.name in after for n in gradient_ops)
    # Only the recomputing cells' backward functions hold a stamp.
    assert len(stamped) == sum(cell.recompute for cell in pipe.cells)


def test_jit_compile_equals_unrolled_within_float_tolerance():
    # Without dropout: XLA's kernel of the stateless random op draws another stream.
    body = mz.mlp_body(dtype=tf.float32, dropout=False)
    x, y = mz.inputs_for(body, dtype=tf.float32)
    expected = trainer_step(mz.pipeline(body, 2, 3, 'except_last', cell_functions=False),
                            x, y)
    jit = mz.pipeline(body, 2, 3, 'except_last', cell_functions=True, jit_compile=True)
    got = trainer_step(jit, x, y)
    # XLA's kernels round otherwise: measured 1.4e-9 apart on an entry near zero (AMD EPYC)
    assert_same_step(got, expected, rtol=1e-4, atol_of_largest=1e-6)
    # Every cell is compiled, the one that keeps its activations too (it is a call, and its
    # backward the call's gradient), where without XLA that cell would train unrolled; so
    # is every backward of a recomputing cell, its last too.
    calls = [op for op in _traced_step(jit, x, y).graph.get_operations()
             if op.type in CALL_OPS]
    assert {trace.cell_of_node(op.name) for op in calls} == {0, 1}
    assert len(calls) == 2 * 3 + 1 * 3 + 3


def test_jit_compile_that_cannot_apply_is_refused_when_the_layer_is_built():
    body = mz.mlp_body()
    with pytest.raises(ValueError, match='set cell_functions=True'):
        mz.pipeline(body, 2, 2, jit_compile=True, cell_functions=False)
    with pytest.raises(ValueError, match="schedule='zb_h1' cannot use"):
        mz.pipeline(body, 2, 2, jit_compile=True, schedule='zb_h1')


@pytest.mark.parametrize('first', [0, 5, 22])
def test_dropout_stream_from_a_tensor_offset_equals_the_int_offset(first):
    expected = stateless_uniform_slice(123, tf.constant(4), first, 37)
    got = tf.function(lambda o: stateless_uniform_slice(123, tf.constant(4), o, 37))(
        tf.constant(first, tf.int64))
    np.testing.assert_array_equal(got.numpy(), expected.numpy())
