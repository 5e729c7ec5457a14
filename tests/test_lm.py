"""The language-model task: pipelined == unpartitioned, and packing is exact.

The reference is the same body as a plain `Sequential` under a plain tape, with
the embedding tensor passed by hand as the softmax weight (TensorFlow sums the
two uses' gradients itself): no pipeline, tie or micro-batch code involved.
Float64, so 1e-9 tests the mathematics. Rows come from `lm_inputs.pack_documents`
over generated documents, so they hold several documents each and the last
one ends in padding.
"""
import numpy as np
import pytest
import tensorflow as tf

from tfpipe import bodies, fprop_context, inputs, layers, lm_inputs
from tfpipe.pipeline import partition
from tfpipe.pipeline.pipelining_layer import PipeliningLayer
from tfpipe.tasks.lm import LanguageModel

VOCAB, LENGTH, BATCH = inputs.BYTE_VOCAB_SIZE, 16, 6
CONTEXT = 32  # positions of the model: rows of LENGTH, or up to CONTEXT


def lm_task(num_cells=2, num_micro_batches=2, dtype=tf.float64, fprop_dtype=None):
    body = bodies.transformer_lm_body(VOCAB, CONTEXT, 16, 32, 2, 2)
    for p in body:
        p.Set(dtype=dtype, fprop_dtype=fprop_dtype)
    p = LanguageModel.Params()
    p.pipeline = PipeliningLayer.Params().Set(
        name='pipe', body=body, num_micro_batches=num_micro_batches,
        balance=partition.even_balance(len(body), num_cells),
        tied_weights=dict(bodies.TRANSFORMER_TIES))
    return p.Instantiate()


def documents(texts):
    return tf.data.Dataset.from_tensor_slices({'text': tf.constant(texts, tf.string)})


def rows(texts, length=LENGTH):
    """The packed rows of `texts` as one batch of features."""
    packed = lm_inputs.pack_documents(documents(texts), length, inputs.byte_tokenize)
    features = [lm_inputs.row_features(ex['row']) for ex in packed]
    return {k: tf.stack([f[k] for f in features]) for k in features[0]}


def generated_batch():
    rng = np.random.default_rng(0)
    texts = [''.join(rng.choice(list('abcdefgh xyz'), size=n)) for n in
             rng.integers(1, 20, size=12)]
    batch = rows(texts)
    assert batch['inputs'].shape[0] >= BATCH
    batch = {k: v[-BATCH:] for k, v in batch.items()}
    segments = batch['segment_ids'].numpy()
    assert (segments.max(1) > 1).any() and (segments[-1] == 0).any()  # packing and padding
    return batch


def reference_loss_and_grads(task, batch):
    """Sequential over the same body and the pipeline's own variables, under one tape."""
    seq = layers.Sequential.Params().Set(name='ref', body=task.params.pipeline.body).Instantiate()
    theta = dict(task.theta['pipe'])
    with tf.GradientTape() as tape:
        theta['logits'] = {**theta['logits'], 'w': theta['embedding']['emb']}
        with fprop_context.training(step=1):
            logits = seq.FProp(theta, task.PipelineInputs(batch))
        loss = tf.reduce_mean(task.PerExampleLoss(logits, task.PipelineTargets(batch)))
    return loss, tape.gradient(loss, task.theta)


_reference = {}


def reference_for(task, batch):
    """reference_loss_and_grads at the (deterministic) initial weights, computed once per
    module; the caller checks that its task starts from those weights."""
    if not _reference:
        ref_loss, ref_grads = reference_loss_and_grads(task, batch)
        _reference.update(
            initial=[v.numpy() for v in tf.nest.flatten(task.theta)], loss=ref_loss.numpy(),
            grads=[tf.convert_to_tensor(g).numpy() for g in tf.nest.flatten(ref_grads)])
    return _reference


@pytest.mark.parametrize('num_cells', [1, 2, 4])
@pytest.mark.parametrize('num_micro_batches', [1, 3])
def test_pipelined_loss_and_gradients_equal_unpartitioned(num_cells, num_micro_batches):
    task = lm_task(num_cells, num_micro_batches)
    assert len({cell.device for cell in task.pipe.cells}) == num_cells
    batch = generated_batch()
    ref = reference_for(task, batch)
    initial = tf.nest.flatten(task.theta)
    assert len(initial) == len(ref['initial'])
    for v, r in zip(initial, ref['initial']):  # the reference's weights: it applies
        np.testing.assert_array_equal(v.numpy(), r)
    with fprop_context.training(step=1):
        loss, grads = task.ForwardBackward(task.theta, batch)
    np.testing.assert_allclose(loss.numpy(), ref['loss'], rtol=1e-9)
    flat = tf.nest.flatten(grads)
    assert len(flat) == len(ref['grads'])
    for g, r in zip(flat, ref['grads']):
        np.testing.assert_allclose(tf.convert_to_tensor(g).numpy(), r, rtol=1e-7, atol=1e-12)


def token_losses(task, batch):
    with fprop_context.evaluation():
        logits = task.ComputePredictions(task.theta, batch)
    xent, weights = task.TokenLosses(logits, task.PipelineTargets(batch))
    return xent.numpy(), weights.numpy()


def test_other_documents_and_padding_leave_a_documents_losses_unchanged():
    task = lm_task(dtype=tf.float32)
    doc, other = 'def f(x):\n  return x', 'import os'
    alone = rows([doc], length=CONTEXT)  # the document, then padding
    after = rows([other, doc], length=CONTEXT)  # another document first, then this one
    xent_alone, w_alone = token_losses(task, alone)
    xent_after, w_after = token_losses(task, after)
    n, skip = len(doc) + 1, len(other) + 1
    assert w_alone[0].sum() == n and w_after[0].sum() == n + skip
    np.testing.assert_allclose(xent_after[0, skip:skip + n], xent_alone[0, :n], atol=1e-5)
    assert (xent_alone[0, n:] == 0).all()  # padding counts nothing
    # The test can fail: without segments the document would read the other one.
    leaky = dict(after, segment_ids=tf.ones_like(after['segment_ids']),
                 positions=tf.range(CONTEXT)[None, :])
    xent_leaky, _ = token_losses(task, leaky)
    assert np.abs(xent_leaky[0, skip:skip + n] - xent_alone[0, :n]).max() > 1e-3


def test_padding_changes_no_rows_training_loss():
    """The training loss (PerExampleLoss through the pipeline) of a document padded to the
    context equals that of the same document in a row of its own length: padding neither
    adds loss nor counts as tokens of the mean."""
    task = lm_task(num_micro_batches=1, dtype=tf.float32)
    doc = 'def f(x):\n  return x'
    exact, padded = rows([doc], length=len(doc) + 1), rows([doc], length=CONTEXT)
    assert (exact['segment_ids'].numpy() == 1).all()
    assert (padded['segment_ids'].numpy() == 0).sum() == CONTEXT - len(doc) - 1
    losses = []
    for batch in (exact, padded):
        with fprop_context.training(step=1):
            loss, _ = task.ForwardBackward(task.theta, batch)
        losses.append(float(loss))
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5)
    assert losses[0] > 1.0  # an untrained model: a mean counting padding would be far lower


def test_eval_metrics_are_per_token_over_real_examples():
    task = lm_task(dtype=tf.float32)
    batch = generated_batch()
    batch['weight'] = tf.constant([1, 1, 1, 0, 1, 0], tf.float32)
    with fprop_context.evaluation():
        metrics = task.ComputeLoss(task.theta, task.ComputePredictions(task.theta, batch), batch)
    xent, weights = token_losses(task, batch)
    weights *= batch['weight'].numpy()[:, None]
    assert metrics['log_pplx'][1].numpy() == weights.sum()
    np.testing.assert_allclose(metrics['log_pplx'][0].numpy(),
                               (xent * weights).sum() / weights.sum(), rtol=1e-5)
    scores = task.FinalizeMetrics({k: float(v[0]) for k, v in metrics.items()})
    np.testing.assert_allclose(scores['perplexity'], np.exp(scores['log_pplx']), rtol=1e-12)


def test_bfloat16_loss_is_close_to_float32():
    batch = generated_batch()
    losses = []
    for fprop_dtype in (None, tf.bfloat16):
        task = lm_task(dtype=tf.float32, fprop_dtype=fprop_dtype)
        with fprop_context.training(step=1):
            loss, grads = task.ForwardBackward(task.theta, batch)
        assert all(g.dtype == tf.float32 for g in tf.nest.flatten(grads))
        losses.append(float(loss))
    assert losses[0] != losses[1]
    np.testing.assert_allclose(losses[1], losses[0], rtol=2e-2)


@pytest.mark.parametrize('model', ['lm.pystdlib.TransformerLM', 'lm.pystdlib.TinyTransformerLM'])
def test_registered_models_build_and_take_their_inputs(model):
    import model_registry
    params = model_registry.get_params(model)
    task = params.task.Instantiate()
    for split in ('train', 'dev', 'test'):
        task.CheckInput(params.input.Get(split))
    assert task.pipe.ties and len(task.pipe.cells) == 2


@pytest.mark.parametrize('model, blocks, width, params_millions', [
    ('lm.pystdlib.GPT2SmallShapedLM', 12, 768, 85.45), ('lm.pystdlib.GPT2MediumShapedLM', 24,
                                                        1024, 302.84)])
def test_the_gpt2_shaped_models_have_gpt2s_shapes(model, blocks, width, params_millions):
    """From params alone (tracing the 85M model takes tens of seconds): the shape, the
    parameter count (the tied softmax once) and K=4 cells that cover the body."""
    import model_registry
    p = model_registry.get_params(model).task.pipeline
    block_params = [lp for lp in p.body if lp.cls is layers.PackedTransformerBlock]
    assert len(block_params) == blocks
    assert {(lp.model_dim, lp.hidden_dim, lp.num_heads) for lp in block_params} == {
        (width, 4 * width, width // 64)}
    tied = sum(lp.cls.NumParams(lp) for lp in p.body if lp.name == 'logits') - width  # - bias
    count = sum(lp.cls.NumParams(lp) for lp in p.body) - tied
    assert abs(count / 1e6 - params_millions) < 0.1, count
    assert len(p.balance) == 4 and sum(p.balance) == len(p.body)
    assert [sum(lp.cls is layers.PackedTransformerBlock for lp in p.body[start:stop])
            for start, stop in partition.cell_ranges(p.balance)] == [blocks // 4] * 4
