"""tfpipe.keras.pipeline: a Keras model in, a pipelined keras.Model out.

Training the pipelined model with fit() must equal training the original Keras
model (same optimizer, same data, shuffle=False): per-epoch losses and final
weights within 1e-5, for K in {1, 2, 4} x M in {1, 2, 4} (recompute policies
and schedules rotate over the grid). The batch of 8 with 42 examples leaves a
last partial batch of 2, so uneven micro-batches and a second batch shape are
part of every run.
"""
import numpy as np
import pytest

import keras
import tensorflow as tf

import tfpipe.keras as tk
from tfpipe.tuning import trace

EPOCHS = 2
GRID = [(k, m) for k in (1, 2, 4) for m in (1, 2, 4)]
POLICIES = ['always', 'except_last', 'never']


def make_model(dropout: float = 0.0) -> keras.Sequential:
    keras.utils.set_random_seed(7)
    layers = [keras.Input((6,)), keras.layers.Dense(16, activation='relu'),
              keras.layers.Dense(16, activation='tanh')]
    if dropout:
        layers.append(keras.layers.Dropout(dropout))
    layers += [keras.layers.Dense(8, activation='relu'), keras.layers.Dense(3)]
    return keras.Sequential(layers)


def data():
    rng = np.random.RandomState(0)
    return rng.randn(42, 6).astype(np.float32), rng.randint(0, 3, 42)


def compile_and_fit(model):
    model.compile(optimizer=keras.optimizers.Adam(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=['accuracy'])
    x, y = data()
    history = model.fit(x, y, batch_size=8, epochs=EPOCHS, shuffle=False, verbose=0).history
    return history


def assert_close(a, b, tol=1e-5):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape
    np.testing.assert_allclose(a, b, rtol=tol, atol=tol)


@pytest.fixture(scope='module')
def reference():
    model = make_model()
    initial = model.get_weights()
    history = compile_and_fit(model)
    return initial, history, model


@pytest.fixture(scope='module')
def reference_predict_and_evaluate(reference):
    """The trained original's predict and evaluate outputs, traced once per module."""
    trained = reference[2]
    x, y = data()
    return (trained.predict(x, batch_size=16, verbose=0),
            trained.evaluate(x, y, batch_size=16, verbose=0))


@pytest.mark.parametrize('k,m', GRID, ids=[f'K{k}-M{m}' for k, m in GRID])
def test_fit_equals_the_original_model(reference, reference_predict_and_evaluate, k, m):
    initial, history, trained = reference
    original = make_model()
    pipe = tk.pipeline(original, num_cells=k, num_micro_batches=m,
                       recompute=POLICIES[(k + m) % 3],
                       schedule='1f1b' if m == 4 else 'fill_drain')
    assert len(pipe.cells) == k
    for a, b in zip(pipe.get_weights(), initial):  # the original's order and values
        assert_close(a, b, 0)
    got = compile_and_fit(pipe)
    assert_close(got['loss'], history['loss'])
    assert_close(got['accuracy'], history['accuracy'])
    for a, b in zip(pipe.get_weights(), trained.get_weights()):
        assert_close(a, b)
    if k == m:  # predict and evaluate on a diagonal of the grid (tracing is the cost)
        x, y = data()
        predicted, evaluated = reference_predict_and_evaluate
        assert_close(pipe.predict(x, batch_size=16, verbose=0), predicted)
        assert_close(pipe.evaluate(x, y, batch_size=16, verbose=0), evaluated)
    for a, b in zip(original.get_weights(), initial):  # the original is left as it was
        assert_close(a, b, 0)


def test_each_cell_runs_on_its_device():
    pipe = tk.pipeline(make_model(), balance=[1, 2, 1], num_micro_batches=2,
                       devices=['/cpu:1', '/cpu:2', '/cpu:3'])
    pipe.compile(optimizer='sgd', loss=keras.losses.SparseCategoricalCrossentropy(True))
    for cell in pipe.cells:
        for adapter in cell.layers:
            for v in adapter.layer.weights:
                assert trace.device_index(v.value.device) == f'CPU:{cell.index + 1}'
    x, y = data()
    step = tf.function(pipe.train_step).get_concrete_function((x[:8], y[:8]))
    seen = set()
    for node in trace.nodes(step):
        k = trace.cell_of_node(node.name)
        if k is not None and node.op not in trace.PLUMBING_OPS and (
                '/forward_' in node.name or '/backward_' in node.name):
            assert trace.device_index(node.device) == f'CPU:{k + 1}', node
            seen.add((k, 'backward' if '/backward_' in node.name else 'forward'))
    assert seen == {(k, phase) for k in range(3) for phase in ('forward', 'backward')}


def test_save_and_load_weights_across_partitions(tmp_path):
    pipe = tk.pipeline(make_model(), num_cells=4, num_micro_batches=2)
    pipe.compile(optimizer=keras.optimizers.Adam(0.01),
                 loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = data()
    pipe.fit(x[:40], y[:40], batch_size=8, epochs=1, shuffle=False, verbose=0)  # one shape
    path = str(tmp_path / 'pipe.weights.h5')
    pipe.save_weights(path)
    other = tk.pipeline(make_model(), num_cells=2, num_micro_batches=3)
    assert not np.allclose(other.get_weights()[0], pipe.get_weights()[0])
    other.load_weights(path)
    for a, b in zip(other.get_weights(), pipe.get_weights()):
        assert_close(a, b, 0)
    plain = make_model()  # the file also loads into the plain Keras model
    plain.load_weights(path)
    assert_close(plain.predict(x, batch_size=len(x), verbose=0),
                 other.predict(x, batch_size=len(x), verbose=0))


def test_dropout_mask_is_reproduced_by_recompute_and_independent_of_k_and_m():
    runs = []
    for k, m, policy in [(1, 1, 'never'), (2, 3, 'always')]:
        pipe = tk.pipeline(make_model(dropout=0.5), num_cells=k, num_micro_batches=m,
                           recompute=policy)
        runs.append((compile_and_fit(pipe)['loss'], pipe.get_weights()))
    assert_close(runs[1][0], runs[0][0])
    for a, b in zip(runs[1][1], runs[0][1]):
        assert_close(a, b)
    x, _ = data()
    dropped, kept = pipe(x[:8], training=True), pipe(x[:8], training=False)
    assert not np.allclose(dropped, kept)  # it does drop in training


def _branchy() -> keras.Model:
    inputs = keras.Input((4,))
    a = keras.layers.Dense(4, name='left')(inputs)
    b = keras.layers.Dense(4, name='right')(inputs)
    return keras.Model(inputs, keras.layers.Add(name='join')([a, b]))


def _shared() -> list:
    dense = keras.layers.Dense(4, name='twice')
    return [dense, keras.layers.Dense(4), dense]


REFUSED = [
    ('batch norm', lambda: keras.Sequential([keras.Input((4,)), keras.layers.Dense(4),
                                             keras.layers.BatchNormalization(name='bn')]),
     r"layer 'bn' is a BatchNormalization.*tfpipe.layers.BatchNorm"),
    ('branches', _branchy, r"layer 'join' of functional model .* takes 2 inputs.*only a chain"),
    ('shared layer', _shared, r"layer 'twice' appears twice"),
    ('stateful rnn', lambda: [keras.layers.LSTM(4, stateful=True, name='rnn')],
     r"layer 'rnn' is stateful"),
    ('rnn dropout', lambda: [keras.layers.LSTM(4, recurrent_dropout=0.2, name='rnn')],
     r"layer 'lstm_cell' \(inside 'rnn'\) draws dropout masks \(dropout=0.0, "
     r"recurrent_dropout=0.2\).*set both to 0"),
    ('random layer', lambda: [keras.layers.GaussianNoise(0.1, name='noise')],
     r"layer 'noise' draws random numbers"),
    ('nested dropout', lambda: [keras.Sequential([keras.layers.Dropout(0.1, name='inner')],
                                                 name='block')],
     r"layer 'inner' \(inside 'block'\) draws random numbers"),
]


@pytest.mark.parametrize('what,build,message', REFUSED, ids=[c[0] for c in REFUSED])
def test_unpipelinable_layers_are_refused_by_name(what, build, message):
    with pytest.raises(ValueError, match=message):
        tk.pipeline(build(), num_cells=1)


def test_an_lstm_without_dropout_trains_as_the_original():
    # Its cell owns a seed generator for dropout it does not use: nothing to refuse.
    def make():
        keras.utils.set_random_seed(7)
        return keras.Sequential([keras.Input((5, 6)), keras.layers.LSTM(8, name='rnn'),
                                 keras.layers.Dense(3)])
    x, y = data()
    # [40, 5, 6]: 5 full batches, one traced shape (uneven batches: the grid above)
    x, y = np.stack([np.roll(x, i, axis=1) for i in range(5)], axis=1)[:40], y[:40]
    trained = make()
    for model in (trained, tk.pipeline(make(), num_cells=2, num_micro_batches=2)):
        model.compile(optimizer=keras.optimizers.Adam(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert len(model.get_weights()) == len(trained.get_weights())
    for a, b in zip(model.get_weights(), trained.get_weights()):
        assert_close(a, b)


def test_bad_partition_arguments():
    with pytest.raises(ValueError, match=r'num_cells=9 must be in \[1, 4\]'):
        tk.pipeline(make_model(), num_cells=9)
    with pytest.raises(ValueError, match=r'give balance=\[layers per cell\] or num_cells=K'):
        tk.pipeline(make_model())
    with pytest.raises(ValueError, match=r"unknown schedule 'gpipe'"):
        tk.pipeline(make_model(), num_cells=2, schedule='gpipe')
