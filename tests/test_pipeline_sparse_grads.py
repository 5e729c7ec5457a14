"""Embedding gradients are summed over micro-batches as slices while that is smaller,
by both executors (cell functions, the default, and the unrolled tasks)."""
import numpy as np
import pytest
import tensorflow as tf

import tfpipe
from tests import model_zoo as mz
from tfpipe import fprop_context, layers

N, D = 10, 8


def embedding_pipeline(vocab, cell_functions):
    body = [layers.Embedding.Params().Set(name='emb', vocab_size=vocab, embedding_dim=D,
                                          dtype=tf.float64),
            layers.Dense.Params().Set(name='fc', input_dim=D, output_dim=5, dtype=tf.float64)]
    pipe = tfpipe.PipeliningLayer.Params().Set(name='pipe', body=body, balance=[1, 1],
                                              num_micro_batches=4,
                                              cell_functions=cell_functions).Instantiate()
    return body, pipe


def dense_table_ops(concrete_fn, vocab):
    """Ops of cell 0's backward that produce a whole [V, D] table gradient."""
    return [op.name for op in concrete_fn.graph.get_operations()
            if '/cell_0/' in op.name and ('backward' in op.name or 'gradient_tape' in op.name)
            and any(t.shape.as_list() == [vocab, D] for t in op.outputs if t.shape.rank == 2)]


@pytest.mark.parametrize('cell_functions', [True, False], ids=['functions', 'unrolled'])
@pytest.mark.parametrize('vocab,sparse', [(64, True), (4, False)])
def test_embedding_gradients_accumulate_sparsely_while_smaller(vocab, sparse, cell_functions):
    """V=64 > all 10 looked-up rows: the slices are concatenated and made dense once;
    V=4 < the rows of two micro-batches: the dense sum is smaller and is used."""
    body, pipe = embedding_pipeline(vocab, cell_functions)
    ids = tf.constant(np.random.default_rng(0).integers(0, vocab, size=[N]), tf.int32)
    y = tf.constant(np.arange(N) % 5, tf.int32)

    @tf.function
    def step():
        with fprop_context.training(step=0):
            return pipe.ForwardBackward(pipe.theta, ids, mz.loss_fn, y)

    table_ops = dense_table_ops(step.get_concrete_function(), vocab)
    if sparse:
        assert len(table_ops) == 1, table_ops  # densified once, not once per micro-batch
    else:
        assert len(table_ops) >= 4, table_ops
    loss, grads = step()
    ref = mz.sequential(body)
    with fprop_context.training(step=0):
        with tf.GradientTape() as tape:
            ref_loss = tf.reduce_mean(mz.loss_fn(ref(ids), y))
    ref_grads = tape.gradient(ref_loss, ref.theta)
    np.testing.assert_allclose(loss.numpy(), ref_loss.numpy(), rtol=1e-12)
    for g, r in zip(tf.nest.flatten(grads), tf.nest.flatten(ref_grads)):
        assert isinstance(g, tf.Tensor)  # callers get whole tensors
        np.testing.assert_allclose(g.numpy(), tf.convert_to_tensor(r).numpy(), rtol=1e-12)
