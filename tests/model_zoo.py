"""Small models shared by the pipeline tests: the same body, pipelined or not."""
from __future__ import annotations

import numpy as np
import tensorflow as tf

import tfpipe
from tfpipe import fprop_context, layers
from tfpipe.pipeline import partition

BATCH = 10  # not divisible by 3 or 4: uneven micro-batches are part of every grid


def mlp_body(dtype=tf.float64, dropout=True):
    """6 layers: Dense/Dropout mix, so K=4 cuts through dropout layers too."""
    body = [
        layers.Dense.Params().Set(name='fc0', input_dim=12, output_dim=16, activation='relu'),
        layers.Dropout.Params().Set(name='drop0', keep_prob=0.7 if dropout else 1.0),
        layers.Dense.Params().Set(name='fc1', input_dim=16, output_dim=16, activation='tanh'),
        layers.Dense.Params().Set(name='fc2', input_dim=16, output_dim=16, activation='relu'),
        layers.Dropout.Params().Set(name='drop1', keep_prob=0.8 if dropout else 1.0),
        layers.Dense.Params().Set(name='fc3', input_dim=16, output_dim=5),
    ]
    for p in body:
        p.dtype = dtype
    return body


def conv_body(dtype=tf.float64, batch_norm=False):
    """A small conv net; with batch_norm, BN layers sit in several cells."""
    def bn(name, dim):
        return layers.BatchNorm.Params().Set(name=name, dim=dim, decay=0.9)

    body = [layers.Conv2D.Params().Set(name='conv0', filter_shape=(3, 3, 3, 4),
                                       activation='relu')]
    if batch_norm:
        body.append(bn('bn0', 4))
    body += [layers.Conv2D.Params().Set(name='conv1', filter_shape=(3, 3, 4, 6),
                                        filter_stride=(2, 2), activation='relu'),
             layers.Pooling2D.Params().Set(name='pool', pooling_type='AVG')]
    if batch_norm:
        body.append(bn('bn1', 6))
    body += [layers.Flatten.Params().Set(name='flat'),
             layers.Dense.Params().Set(name='logits', input_dim=2 * 2 * 6, output_dim=5)]
    for p in body:
        p.dtype = dtype
    return body


def inputs_for(body, dtype=tf.float64, batch=BATCH, seed=0):
    rng = np.random.default_rng(seed)
    shape = [batch, 12] if body[0].cls is layers.Dense else [batch, 8, 8, 3]
    x = tf.constant(rng.normal(size=shape), dtype)
    y = tf.constant(rng.integers(0, 5, size=[batch]), tf.int32)
    return x, y


def loss_fn(logits, labels):
    return tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)


def pipeline(body, num_cells, num_micro_batches, recompute='always', **kw):
    return tfpipe.PipeliningLayer.Params().Set(
        name='pipe', body=body, balance=partition.even_balance(len(body), num_cells),
        num_micro_batches=num_micro_batches, recompute=recompute, **kw).Instantiate()


def sequential(body):
    """The unpartitioned model: same layer paths ('pipe/...'), so the same weights."""
    return layers.Sequential.Params().Set(name='pipe', body=body).Instantiate()


def snapshot(variables):
    return [v.numpy() for v in variables]


def sgd_step_forward_backward(pipe, x, y, step, lr=0.1):
    """The trainer's step through ForwardBackward, traced once."""
    @tf.function(autograph=False)
    def run():
        with fprop_context.training(step=step):
            loss, grads = pipe.ForwardBackward(pipe.theta, x, loss_fn, y)
        for v, g in zip(tf.nest.flatten(pipe.theta), tf.nest.flatten(grads)):
            v.assign_sub(lr * g)
        return loss, grads
    loss, grads = run()
    return loss.numpy(), [g.numpy() for g in tf.nest.flatten(grads)]


def sgd_step_tape(model, x, y, step, lr=0.1):
    """A plain tape around FProp; returns outputs too."""
    @tf.function(autograph=False)
    def run():
        with fprop_context.training(step=step):
            with tf.GradientTape() as tape:
                out = model.FProp(model.theta, x)
                loss = tf.reduce_mean(loss_fn(out, y))
        variables = tf.nest.flatten(model.theta)
        grads = tape.gradient(loss, variables)
        for v, g in zip(variables, grads):
            v.assign_sub(lr * g)
        return out, loss, grads
    out, loss, grads = run()
    return out.numpy(), loss.numpy(), [g.numpy() for g in grads]
