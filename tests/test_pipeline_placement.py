"""Cell k's forward, recompute and backward ops are placed on device k.

Read from the traced graph (and its function library) of a K=4 step, because
TensorFlow silently runs unplaced ops wherever it likes: with a plain outer
tape or tf.recompute_grad about half the backward ops come out unplaced.
Both executors are checked: the default one, where every task is a call of its
cell's traced function (cell_functions.py), and the unrolled one
(cell_functions=False), where every task's ops are in the step's graph.
"""
import collections

import pytest
import tensorflow as tf

from tests import model_zoo as mz
from tfpipe import fprop_context
from tfpipe.tuning import trace

K, M = 4, 2
CALL_OPS = ('StatefulPartitionedCall', 'PartitionedCall')
EXECUTORS = pytest.mark.parametrize('cell_functions', [True, False],
                                    ids=['functions', 'unrolled'])


def forward_backward_step(pipe, x, y):
    @tf.function
    def step():
        with fprop_context.training(step=3):
            loss, grads = pipe.ForwardBackward(pipe.theta, x, mz.loss_fn, y)
        for v, g in zip(tf.nest.flatten(pipe.theta), tf.nest.flatten(grads)):
            v.assign_sub(0.1 * g)
        return loss
    return step.get_concrete_function()


def tape_step(pipe, x, y):
    @tf.function
    def step():
        with fprop_context.training(step=3):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(mz.loss_fn(pipe.FProp(pipe.theta, x), y))
        return tape.gradient(loss, pipe.trainable_variables)
    return step.get_concrete_function()


def task_nodes(concrete_fn):
    """Every node of the step, a node inside a called function named after the call
    that runs it ('pipe/cell_k/forward_m/PartitionedCall/fc0/MatMul'): it belongs to
    that call's task, whichever micro-batch's call it is."""
    graph_def = concrete_fn.graph.as_graph_def()
    library = {f.signature.name: f for f in graph_def.library.function}
    out = []

    def visit(prefix, function, node_defs):
        for n in node_defs:
            out.append(trace.Node(function, prefix + n.name, n.op, n.device))
            if n.op in CALL_OPS:
                callee = n.attr['f'].func.name
                visit(f'{prefix}{n.name}/', callee, library[callee].node_def)

    visit('', '', graph_def.node)
    return out


def pipeline_nodes(concrete_fn):
    """Compute nodes and calls the pipeline created: under its 'pipe/' name scope, or
    the tape's gradients of those ('gradient_tape/pipe/...')."""
    return [n for n in task_nodes(concrete_fn)
            if (n.op not in trace.PLUMBING_OPS or n.op in CALL_OPS)
            and n.name.removeprefix('gradient_tape/').split('/')[0] == 'pipe']


def derived_gradient(node):
    """Inside a gradient function TensorFlow derives for a cell function's call under a
    tape (a cell that does not recompute): TensorFlow traces it without device scopes,
    and the runtime places its ops on the device of its call, which is checked."""
    return '__backward_' in node.function


def phase_of(name):
    if name.startswith('gradient_tape/'):
        return 'backward'
    for part in name.split('/'):
        for phase in ('forward', 'backward'):
            if part.startswith(phase + '_'):
                return phase
    return None


@EXECUTORS
@pytest.mark.parametrize('build_step', [forward_backward_step, tape_step])
@pytest.mark.parametrize('recompute', ['always', 'except_last', 'never'])
def test_every_cell_op_runs_on_its_cell_device(build_step, recompute, cell_functions):
    body = mz.mlp_body()
    x, y = mz.inputs_for(body)
    pipe = mz.pipeline(body, K, M, recompute, cell_functions=cell_functions)
    nodes = pipeline_nodes(build_step(pipe, x, y))
    calls = [n for n in nodes if n.op in CALL_OPS]
    # Functions: one call per forward and per backward task of a recomputing cell (a backward
    # call also runs the cell's recompute) but its last backward, which runs unrolled; a cell
    # that keeps its activations and the unrolled executor: none.
    recomputing = sum(cell.recompute for cell in pipe.cells)
    assert len(calls) == ((2 * M - 1) * recomputing if cell_functions else 0)
    unplaced = [n.name for n in nodes if not n.device and not derived_gradient(n)]
    assert not unplaced, f'unplaced pipeline ops: {unplaced[:10]}'
    seen = collections.Counter()
    for n in nodes:
        k = trace.cell_of_node(n.name)
        if k is None:
            continue
        if n.device or not derived_gradient(n):
            assert trace.device_index(n.device) == f'CPU:{k}', (n.name, n.device)
        seen[(k, phase_of(n.name), n.op)] += 1
    for k in range(K):
        # Every cell holding weights does forward matmuls and backward gradient matmuls.
        if any(layer.trainable_variables for layer in pipe.cells[k].layers):
            assert seen[(k, 'forward', 'MatMul')] > 0, k
            assert seen[(k, 'backward', 'MatMul')] > 0, k
    # Recompute shows up as forward activations (Relu, not ReluGrad) inside the
    # backward scopes of exactly the recomputing cells.
    for k, cell in enumerate(pipe.cells):
        recomputed = sum(seen[(k, 'backward', op)] for op in ('Relu', 'Tanh'))
        has_activation = sum(seen[(k, 'forward', op)] for op in ('Relu', 'Tanh')) > 0
        if cell.recompute and has_activation:
            assert recomputed > 0, f'cell {k} should recompute its forward'
        else:
            assert recomputed == 0, f'cell {k} must not recompute'


@EXECUTORS
def test_ops_per_device_reports_each_cell(cell_functions):
    body = mz.mlp_body()
    x, y = mz.inputs_for(body)
    pipe = mz.pipeline(body, K, M, cell_functions=cell_functions)
    counts = trace.ops_per_device(forward_backward_step(pipe, x, y))
    for k in range(K):
        assert counts.get(f'CPU:{k}', 0) > 0


def inputs_of(concrete_fn):
    """node name -> names of the nodes it waits for, through control or data edges:
    TensorFlow drops a control edge to an op that is already a data input, which
    happens when a task consumes what the device's previous task produced (a cell
    function's running gradient sum, a forward call's intermediates)."""
    graph_def = concrete_fn.graph.as_graph_def()
    return {n.name: {i.removeprefix('^').split(':')[0] for i in n.input}
            for n in graph_def.node}


def scope_of(name):
    """The task a node belongs to: 'pipe/cell_k/<phase>_m'. Gradient ops are named
    by the tape after the forward ops they differentiate ('gradient_tape/pipe/
    cell_k/forward_m/...'); they belong to that micro-batch's backward task."""
    tape = name.startswith('gradient_tape/')
    parts = name.removeprefix('gradient_tape/').split('/')
    if len(parts) < 3 or parts[0] != 'pipe':
        return None
    if tape:
        parts[2] = parts[2].replace('forward_', 'backward_')
    return '/'.join(parts[:3])


@EXECUTORS
@pytest.mark.parametrize('recompute', ['always', 'never'])
def test_control_dependencies_keep_each_device_in_schedule_order(recompute, cell_functions):
    """The memory bounds rest on these edges: recompute waits for its incoming
    gradient, each device runs its tasks in schedule order, and micro-batch m's
    backward waits for the accumulation of the previous one."""
    body = mz.mlp_body()
    x, y = mz.inputs_for(body)
    pipe = mz.pipeline(body, K, 3, recompute, cell_functions=cell_functions)
    waits = task_waits(forward_backward_step(pipe, x, y))
    for k in range(K):
        for m in range(1, 3):  # forwards of a cell in micro-batch order
            assert f'pipe/cell_{k}/forward_{m - 1}' in waits[f'pipe/cell_{k}/forward_{m}']
        # backward runs micro-batches in reverse; each waits for the previous one's sums
        for m in range(2):
            assert f'pipe/cell_{k}/backward_{m + 1}' in waits[f'pipe/cell_{k}/backward_{m}']
        assert f'pipe/cell_{k}/forward_2' in waits[f'pipe/cell_{k}/backward_2']
        for m in range(3):  # the incoming gradient gates the whole task (recompute included)
            source = f'pipe/cell_{k + 1}/backward_{m}' if k + 1 < K else f'pipe/cell_{k}/loss_{m}'
            assert source in waits[f'pipe/cell_{k}/backward_{m}'], (k, m)


def task_waits(concrete_fn):
    """task scope -> the other task scopes it waits for (control or data edges)."""
    waits = collections.defaultdict(set)
    for name, sources in inputs_of(concrete_fn).items():
        for source in sources:
            if scope_of(name) and scope_of(source) and scope_of(name) != scope_of(source):
                waits[scope_of(name)].add(scope_of(source))
    return waits


@EXECUTORS
@pytest.mark.parametrize('recompute', ['always', 'never'])
def test_1f1b_forward_waits_for_the_backward_it_follows(recompute, cell_functions):
    """1F1B's memory bound: after its warm-up, cell k runs the forward of micro-batch
    warmup+i only after the backward of micro-batch i, so it holds at most warmup
    micro-batches of activations (checked to fail when the executor drops the edge)."""
    num_micro = 6
    body = mz.mlp_body()
    x, y = mz.inputs_for(body)
    pipe = mz.pipeline(body, K, num_micro, recompute, schedule='1f1b',
                       cell_functions=cell_functions)
    waits = task_waits(forward_backward_step(pipe, x, y))
    for k in range(K):
        warmup = min(K - k, num_micro)
        for i in range(num_micro - warmup):
            forward = f'pipe/cell_{k}/forward_{warmup + i}'
            assert f'pipe/cell_{k}/backward_{i}' in waits[forward], (k, i, sorted(waits[forward]))
            # and the next backward follows that forward: B, F alternate on the device
            assert forward in waits[f'pipe/cell_{k}/backward_{i + 1}'], (k, i)
