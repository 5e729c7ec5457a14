"""Tied weights across cells: one variable read by two cells equals the unpartitioned model.

A small language-model body ties its output projection to its input embedding
(cell 0 and the last cell). The reference is the same body as a plain
`Sequential` under a plain tape, with the embedding variable passed by hand as
the projection's weight: TensorFlow sums the two uses' gradients itself, with
no pipeline or tie code involved. Float64, so 1e-5 tests the mathematics.
"""
import numpy as np
import pytest
import tensorflow as tf

import tfpipe
from tfpipe import checkpoints, fprop_context, layers
from tfpipe.pipeline import partition
from tests import model_zoo as mz

VOCAB, DIM, LENGTH, BATCH, STEP = 11, 8, 3, 10, 5
TIES = {'logits/w': 'embedding/emb'}


def lm_body(keep_prob=0.8):
    body = [
        layers.Embedding.Params().Set(name='embedding', vocab_size=VOCAB, embedding_dim=DIM,
                                      weight_init='glorot_uniform'),
        layers.Dense.Params().Set(name='fc0', input_dim=DIM, output_dim=DIM, activation='relu'),
        layers.Dropout.Params().Set(name='drop', keep_prob=keep_prob),
        layers.Dense.Params().Set(name='fc1', input_dim=DIM, output_dim=DIM, activation='tanh'),
        layers.Dense.Params().Set(name='logits', input_dim=DIM, output_dim=VOCAB,
                                  weight_layout='oi'),
    ]
    for p in body:
        p.dtype = tf.float64
    return body


def lm_inputs(seed=0):
    rng = np.random.default_rng(seed)
    ids = tf.constant(rng.integers(0, VOCAB, size=[BATCH, LENGTH]), tf.int32)
    targets = tf.constant(rng.integers(0, VOCAB, size=[BATCH, LENGTH]), tf.int32)
    return ids, targets


def loss_fn(logits, targets):
    per_token = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=targets, logits=logits)
    return tf.reduce_mean(per_token, axis=1)


def pipeline(num_cells, num_micro_batches, recompute='always', **kw):
    body = lm_body()
    kw.setdefault('balance', partition.even_balance(len(body), num_cells))
    return tfpipe.PipeliningLayer.Params().Set(
        name='pipe', body=body, num_micro_batches=num_micro_batches, recompute=recompute,
        tied_weights=dict(TIES), **kw).Instantiate()


_reference = {}


def reference():
    """Loss, gradients and updated weights of the unpartitioned, hand-tied model."""
    if not _reference:
        seq = layers.Sequential.Params().Set(name='pipe', body=lm_body()).Instantiate()
        ids, targets = lm_inputs()
        theta = seq.theta
        del theta['logits']['w']  # the projection's own weight is not part of the model
        variables = tf.nest.flatten(theta)

        @tf.function
        def step():
            with fprop_context.training(step=STEP):
                with tf.GradientTape() as tape:
                    used = {**theta, 'logits': {**theta['logits'],
                                                'w': theta['embedding']['emb']}}
                    loss = tf.reduce_mean(loss_fn(seq.FProp(used, ids), targets))
            grads = tape.gradient(loss, variables)
            for v, g in zip(variables, grads):
                v.assign_sub(0.1 * g)
            return loss, grads

        initial = mz.snapshot(variables)
        loss, grads = step()
        _reference.update(initial=initial, loss=loss.numpy(), grads=[g.numpy() for g in grads],
                          weights=mz.snapshot(variables))
    return _reference


def close(actual, expected, what):
    assert len(actual) == len(expected), what
    for i, (a, e) in enumerate(zip(actual, expected)):
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-12, err_msg=f'{what}[{i}]')


def forward_backward_step(pipe, theta=None):
    ids, targets = lm_inputs()
    theta = pipe.theta if theta is None else theta

    @tf.function
    def step():
        with fprop_context.training(step=STEP):
            loss, grads = pipe.ForwardBackward(theta, ids, loss_fn, targets)
        for v, g in zip(tf.nest.flatten(pipe.theta), tf.nest.flatten(grads)):
            v.assign_sub(0.1 * g)
        return loss, grads

    loss, grads = step()
    return loss.numpy(), [g.numpy() for g in tf.nest.flatten(grads)]


GRID = [(k, m, policy) for k in (2, 4) for m in (1, 3)
        for policy in ('always', 'except_last', 'never')]


@pytest.mark.parametrize('num_cells,num_micro_batches,recompute', GRID)
def test_forward_backward_equals_unpartitioned(num_cells, num_micro_batches, recompute):
    ref = reference()
    pipe = pipeline(num_cells, num_micro_batches, recompute)
    emb = pipe.embedding.theta['emb']
    assert emb.device == pipe.cells[0].device and pipe.cells[-1].device != emb.device
    assert 'w' not in pipe.logits.theta and pipe.logits.tied_variables['w'] is emb
    close(mz.snapshot(tf.nest.flatten(pipe.theta)), ref['initial'], 'initial weights')
    loss, grads = forward_backward_step(pipe)
    np.testing.assert_allclose(loss, ref['loss'], rtol=1e-5)
    close(grads, ref['grads'], 'grads')
    close(mz.snapshot(tf.nest.flatten(pipe.theta)), ref['weights'], 'updated weights')


@pytest.mark.parametrize('num_cells,num_micro_batches,recompute', GRID)
def test_fprop_under_tape_equals_unpartitioned(num_cells, num_micro_batches, recompute):
    ref = reference()
    pipe = pipeline(num_cells, num_micro_batches, recompute)
    ids, targets = lm_inputs()
    variables = tf.nest.flatten(pipe.theta)

    @tf.function
    def step():
        with fprop_context.training(step=STEP):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(loss_fn(pipe.FProp(pipe.theta, ids), targets))
        grads = tape.gradient(loss, variables)
        for v, g in zip(variables, grads):
            v.assign_sub(0.1 * g)
        return loss, grads

    loss, grads = step()
    np.testing.assert_allclose(loss.numpy(), ref['loss'], rtol=1e-5)
    close([g.numpy() for g in grads], ref['grads'], 'grads')
    close(mz.snapshot(variables), ref['weights'], 'updated weights')


@pytest.mark.parametrize('schedule', ['1f1b', 'zb_h1'])
def test_other_schedules_equal_unpartitioned(schedule):
    """zb_h1 differentiates each layer's weights in its own task: the tied use too."""
    ref = reference()
    pipe = pipeline(2, 3, 'always', schedule=schedule)
    loss, grads = forward_backward_step(pipe)
    np.testing.assert_allclose(loss, ref['loss'], rtol=1e-5)
    close(grads, ref['grads'], 'grads')


def test_tie_inside_one_cell_counts_both_uses():
    """K=1: both uses in the same cell; the reads stay apart, so neither use is doubled."""
    ref = reference()
    loss, grads = forward_backward_step(pipeline(1, 3, 'always'))
    np.testing.assert_allclose(loss, ref['loss'], rtol=1e-5)
    close(grads, ref['grads'], 'grads')


def test_replicas_with_tied_weights_equal_unpartitioned():
    """R=2 x K=2, per-replica thetas: each replica folds its all-reduced gradients."""
    ref = reference()
    pipe = pipeline(2, 2, 'always', num_replicas=2)
    assert 'pipe/logits/w' not in pipe.ReplicaVariablesByPath()[1]
    ids, targets = lm_inputs()

    @tf.function
    def step():
        with fprop_context.training(step=STEP):
            loss, grads = pipe.ForwardBackward(pipe.ReplicaThetas(), ids, loss_fn, targets)
        for theta, replica_grads in zip(pipe.ReplicaThetas(), grads):
            for v, g in zip(tf.nest.flatten(theta), tf.nest.flatten(replica_grads)):
                v.assign_sub(0.1 * g)
        return loss, grads[0]

    loss, grads = step()
    np.testing.assert_allclose(loss.numpy(), ref['loss'], rtol=1e-5)
    close([g.numpy() for g in tf.nest.flatten(grads)], ref['grads'], 'grads')
    close(mz.snapshot(tf.nest.flatten(pipe.ReplicaThetas()[1])), ref['weights'],
          'replica 1 weights')


def test_checkpoint_holds_one_copy_and_restores_under_another_k(tmp_path):
    two = pipeline(2, 3)
    forward_backward_step(two)
    saved = two.VariablesByPath()
    assert 'pipe/embedding/emb' in saved and not any('logits/w' in k for k in saved)
    path = checkpoints.make(saved).save(str(tmp_path / 'ckpt'))
    four = pipeline(4, 1)
    assert sorted(four.VariablesByPath()) == sorted(saved)
    checkpoints.make(four.VariablesByPath()).restore(path).assert_consumed()
    close(mz.snapshot(tf.nest.flatten(four.theta)), mz.snapshot(tf.nest.flatten(two.theta)),
          'restored weights')
    ids, _ = lm_inputs()
    with fprop_context.evaluation():
        np.testing.assert_allclose(four.FProp(four.theta, ids).numpy(),
                                   two.FProp(two.theta, ids).numpy(), rtol=1e-10)


def test_untied_projection_differs_so_the_tie_is_used():
    """Guards the reference: without the tie the same step gives another loss."""
    body = lm_body()
    untied = tfpipe.PipeliningLayer.Params().Set(
        name='pipe', body=body, balance=partition.even_balance(len(body), 2),
        num_micro_batches=1).Instantiate()
    loss, _ = forward_backward_step(untied)
    assert abs(loss - reference()['loss']) > 1e-3


@pytest.mark.parametrize('ties,message', [
    ({'logits/ww': 'embedding/emb'}, "no variable 'logits/ww' in the body; did you mean "
                                     "'logits/w'?"),
    ({'logits/w': 'embedding/emb', 'fc0/w': 'logits/w'}, 'the owner must be another variable'),
    ({'logits/w': 'logits/w'}, 'the owner must be another variable'),
    ({'fc0/w': 'embedding/emb'}, "needs weight_layout='oi'"),
    ([('logits/w', 'embedding/emb')], 'must be a dict'),
])
def test_bad_ties_are_refused_with_the_fix(ties, message):
    body = lm_body()
    with pytest.raises(ValueError, match='^pipe: ') as err:
        tfpipe.PipeliningLayer.Params().Set(name='pipe', body=body, balance=[3, 2],
                                            tied_weights=ties).Instantiate()
    assert message in str(err.value)


def test_shape_mismatch_names_both_shapes():
    body = lm_body()
    body[-1].weight_layout = 'io'
    with pytest.raises(ValueError, match=r"'logits/w' is float64 \[8, 11\] but "
                                         r"'embedding/emb' is float64 \[11, 8\]"):
        tfpipe.PipeliningLayer.Params().Set(name='pipe', body=body, balance=[3, 2],
                                            tied_weights=dict(TIES)).Instantiate()


def test_tied_transformer_trains_in_bfloat16_like_float32():
    """The mt.* models' form (transformer_body with a tied softmax) in bfloat16: the loss of
    5 Adam-free SGD steps within 2% of float32's, and the tied gradient stays float32."""
    from tfpipe.bodies import TRANSFORMER_TIES, transformer_body
    rng = np.random.default_rng(1)
    ids = tf.constant(rng.integers(0, VOCAB, size=[8, 6]), tf.int32)
    targets = tf.constant(rng.integers(0, VOCAB, size=[8, 6]), tf.int32)

    def train(fprop_dtype):
        pipe = tfpipe.PipeliningLayer.Params().Set(
            name='pipe', body=transformer_body(VOCAB, 6, 16, 32, 2, 1, tied_softmax=True),
            balance=[2, 3], num_micro_batches=2, tied_weights=dict(TRANSFORMER_TIES),
            fprop_dtype=fprop_dtype).Instantiate()
        step = tf.Variable(0, dtype=tf.int64)

        @tf.function
        def train_step():
            with fprop_context.training(step=step):
                loss, grads = pipe.ForwardBackward(pipe.theta, ids, loss_fn, targets)
            assert grads['embedding']['emb'].dtype == tf.float32
            for v, g in zip(tf.nest.flatten(pipe.theta), tf.nest.flatten(grads)):
                v.assign_sub(0.2 * g)
            step.assign_add(1)
            return loss

        return [float(train_step()) for _ in range(5)]

    reference, got = train(None), train(tf.bfloat16)
    assert reference[-1] < reference[0] - 0.02
    np.testing.assert_allclose(got, reference, rtol=0.02)
    assert got != reference
