"""tfpipe.keras: losses a Keras layer adds in call() (add_loss, activity_regularizer) are
trained and reported as the original model does, for any K and M (they were silently
dropped before)."""
import numpy as np
import pytest

import keras
from keras import ops

import tfpipe.keras as tk


class Penalized(keras.layers.Dense):
    """A Dense that adds a penalty on its mean squared output (an MoE's balancing loss
    or a user's regulariser has this form: a mean over the batch's examples)."""

    def call(self, x):
        y = super().call(x)
        self.add_loss(0.05 * ops.mean(ops.square(y)))
        return y


def make_model() -> keras.Sequential:
    keras.utils.set_random_seed(11)
    return keras.Sequential([
        keras.Input((6,)),
        keras.layers.Dense(16, activation='relu',
                           activity_regularizer=keras.regularizers.L2(0.01)),
        Penalized(16, activation='tanh'), keras.layers.Dense(3)])


def data():
    rng = np.random.RandomState(1)
    return rng.randn(42, 6).astype(np.float32), rng.randint(0, 3, 42)


def fit_and_evaluate(model):
    model.compile(optimizer=keras.optimizers.Adam(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = data()  # batches of 8 and a last one of 2: uneven micro-batches too
    history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history
    return history['loss'], model.evaluate(x, y, batch_size=16, verbose=0)


@pytest.fixture(scope='module')
def reference():
    model = make_model()
    return fit_and_evaluate(model), model.get_weights()


@pytest.mark.parametrize('k,m,recompute,schedule', [(2, 2, 'always', 'fill_drain'),
                                                    (3, 4, 'never', '1f1b')])
def test_added_losses_train_and_report_as_the_original_model(reference, k, m, recompute,
                                                             schedule):
    (losses, evaluated), weights = reference
    pipe = tk.pipeline(make_model(), num_cells=k, num_micro_batches=m, recompute=recompute,
                       schedule=schedule)
    got_losses, got_evaluated = fit_and_evaluate(pipe)
    np.testing.assert_allclose(got_losses, losses, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_evaluated, evaluated, rtol=1e-5, atol=1e-6)
    for a, b in zip(pipe.get_weights(), weights):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_the_penalty_is_in_the_loss():
    """The reference itself carries the added losses: without them the losses differ."""
    plain = make_model()
    plain.layers[0].activity_regularizer = None
    penalized = make_model()
    x, y = data()
    plain.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    penalized.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    assert penalized.evaluate(x, y, verbose=0) > plain.evaluate(x, y, verbose=0) + 1e-4


def test_a_weight_regularizer_is_refused_with_the_fix():
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(
        3, kernel_regularizer=keras.regularizers.L2(0.01))])
    with pytest.raises(ValueError, match='kernel_regularizer.*add_loss'):
        tk.pipeline(model, num_cells=1)
