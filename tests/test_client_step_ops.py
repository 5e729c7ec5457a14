"""A trainer client's traced step does not grow with the number of clients R (README).

Each client traces its own replica's K cells plus one collective per cell (its
gradients) and one for the loss, whatever R is; one process holding R replicas
traces R copies. Tracing builds the collectives without running them, so the
client's step is built here in one process as client 0 of R (`JoinClients`),
with no cluster.
"""
import tensorflow as tf

from tests import model_zoo as mz
from tfpipe import fprop_context
from tfpipe.pipeline.across_clients import Peers

K, M, ROWS = 2, 2, 4  # ROWS: examples per micro-batch


def traced_step(clients: int = 1, replicas: int = 1) -> tf.Graph:
    """The graph of ForwardBackward as client 0 of `clients` (or one process of `replicas`)."""
    body = mz.mlp_body()
    pipe = mz.pipeline(body, K, M, num_replicas=replicas,
                       devices=[f'/CPU:{i}' for i in range(K * replicas)])
    if clients > 1:
        pipe.JoinClients(Peers(clients, 0))
    # The global batch grows with R so that each client's micro-batches keep ROWS
    # examples: kernels may be chosen by rows (Dense's small-rows gradient), and a
    # client's step is compared at the same work.
    x, y = mz.inputs_for(body, batch=max(clients, replicas) * M * ROWS)

    @tf.function
    def step():
        with fprop_context.training(step=tf.constant(0, tf.int64)):
            return pipe.ForwardBackward(pipe.theta, x, mz.loss_fn, y)
    return step.get_concrete_function().graph


def ops(graph: tf.Graph) -> list[str]:
    """The op types of the outer graph and of every function it calls."""
    library = graph.as_graph_def().library.function
    return [op.type for op in graph.get_operations()] + [
        node.op for function in library for node in function.node_def]


def test_a_clients_traced_step_is_constant_in_r():
    by_r = {r: ops(traced_step(clients=r)) for r in (2, 4)}
    assert len(by_r[2]) == len(by_r[4]), {r: len(o) for r, o in by_r.items()}
    for r, types in by_r.items():
        collectives = [t for t in types if t.startswith('Collective')]
        assert len(collectives) == K + 1, (r, collectives)  # each cell's gradients, the loss


def test_one_process_of_two_replicas_traces_two_copies():
    """The count above can see growth: R replicas in one process trace R copies."""
    assert len(ops(traced_step(replicas=2))) > 1.5 * len(ops(traced_step()))
