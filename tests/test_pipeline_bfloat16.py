"""fprop_dtype=bfloat16: compute and inter-cell activations in bfloat16, variables,
gradient sums and the outputs in float32; training stays within 2% of float32."""
import numpy as np
import pytest
import tensorflow as tf

from tests import model_zoo as zoo
from tfpipe import fprop_context

STEPS = 5


def _train(body, fprop_dtype, tape):
    """STEPS SGD steps through ForwardBackward or FProp under a tape, traced once."""
    pipe = zoo.pipeline(body, num_cells=2, num_micro_batches=3, fprop_dtype=fprop_dtype)
    x, y = zoo.inputs_for(body, tf.float32, batch=12)
    step = tf.Variable(0, dtype=tf.int64)

    @tf.function
    def train_step():
        with fprop_context.training(step=step):
            if tape:
                with tf.GradientTape() as t:
                    out = pipe.FProp(pipe.theta, x)
                    loss = tf.reduce_mean(zoo.loss_fn(out, y))
                assert out.dtype == tf.float32
                grads = t.gradient(loss, pipe.theta)
            else:
                loss, grads = pipe.ForwardBackward(pipe.theta, x, zoo.loss_fn, y)
        for v, g in zip(tf.nest.flatten(pipe.theta), tf.nest.flatten(grads)):
            assert g.dtype == tf.float32  # gradient sums in float32
            v.assign_sub(0.05 * g)
        step.assign_add(1)
        return loss

    losses = [float(train_step()) for _ in range(STEPS)]
    assert all(v.dtype == tf.float32 for v in pipe.variables)
    return pipe, losses


@pytest.mark.parametrize('name,body,tape', [
    ('mlp-dropout', zoo.mlp_body(tf.float32), False),
    ('conv-batchnorm', zoo.conv_body(tf.float32, batch_norm=True), False),
    ('conv-batchnorm-tape', zoo.conv_body(tf.float32, batch_norm=True), True),
])
def test_bfloat16_trains_like_float32(name, body, tape):
    _, reference = _train(body, None, tape)
    pipe, got = _train(body, tf.bfloat16, tape)
    assert reference[-1] < reference[0]  # the float32 run learns at all
    np.testing.assert_allclose(got, reference, rtol=0.02)
    assert got != reference  # bfloat16 did round: the two runs are not the same computation
    x, _ = zoo.inputs_for(body, tf.float32, batch=12)
    with fprop_context.evaluation():  # eval reads float32 moving statistics into bf16
        assert pipe(x).dtype == tf.float32


def test_activations_between_cells_are_bfloat16():
    pipe = zoo.pipeline(zoo.mlp_body(tf.float32), num_cells=2, num_micro_batches=1,
                        fprop_dtype=tf.bfloat16)
    x, _ = zoo.inputs_for(zoo.mlp_body(tf.float32), tf.float32)
    first, last = pipe.cells
    with fprop_context.evaluation():
        sent = first.forward(first.read_theta(pipe.theta), x)
        out = last.forward(last.read_theta(pipe.theta), sent)
    assert sent.dtype == tf.bfloat16 and out.dtype == tf.float32


def _layer_outputs(pipe, x):
    """Every layer's output, cell by cell, in evaluation mode."""
    outs = []
    with fprop_context.evaluation():
        for cell in pipe.cells:
            layer_outs = cell.forward_layers(cell.read_theta(pipe.theta), x)
            outs += layer_outs
            x = layer_outs[-1]
    return outs


def test_a_layers_own_fprop_dtype_wins_over_the_pipelines():
    """A bfloat16 pipeline keeps its softmax layer in float32 (fc3's own fprop_dtype)."""
    body = zoo.mlp_body(tf.float32)
    body[-1].fprop_dtype = tf.float32
    pipe = zoo.pipeline(body, num_cells=2, num_micro_batches=1, fprop_dtype=tf.bfloat16)
    x, _ = zoo.inputs_for(body, tf.float32)
    dtypes = [o.dtype for o in _layer_outputs(pipe, x)]
    assert dtypes == [tf.bfloat16] * 5 + [tf.float32]


def test_one_bfloat16_layer_in_a_float32_pipeline():
    """Only fc1 computes in bfloat16; the next layer gets float32 inputs back, gradients
    stay float32, and training follows the float32 run within 2%."""
    body = zoo.mlp_body(tf.float32)
    body[2].fprop_dtype = tf.bfloat16
    x, _ = zoo.inputs_for(body, tf.float32)
    pipe = zoo.pipeline(body, num_cells=2, num_micro_batches=3)
    dtypes = [o.dtype for o in _layer_outputs(pipe, x)]
    assert dtypes == [tf.float32, tf.float32, tf.bfloat16] + [tf.float32] * 3
    _, reference = _train(zoo.mlp_body(tf.float32), None, tape=False)
    _, got = _train(body, None, tape=False)
    np.testing.assert_allclose(got, reference, rtol=0.02)
    assert got != reference  # fc1 did round


def test_fprop_dtype_is_honoured_in_a_sequential_and_refused_where_it_would_be_ignored():
    from tfpipe import layers
    from tfpipe.base_layer import BaseLayer

    fc = layers.Dense.Params().Set(name='fc', input_dim=4, output_dim=4, fprop_dtype=tf.bfloat16)
    seq = layers.Sequential.Params().Set(name='seq', body=[fc]).Instantiate()
    assert seq(tf.ones([2, 4])).dtype == tf.bfloat16

    class Wrapper(BaseLayer):  # calls its child's FProp itself, as composite layers do
        def __init__(self, params, parent=None):
            super().__init__(params, parent)
            self.CreateChild('inner', fc)

        def FProp(self, theta, x):
            return self.inner.FProp(theta['inner'], x)

    with pytest.raises(ValueError, match=r"^w/inner: fprop_dtype=tf.bfloat16 would be ignored: "
                                         r"Wrapper calls its children itself; set fprop_dtype "
                                         r"on w or on a layer of a pipeline body or Sequential"):
        Wrapper.Params().Set(name='w').Instantiate()
