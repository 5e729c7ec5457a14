"""Generation: the key/value cache changes nothing but the cost, sampling repeats by seed."""
import numpy as np
import pytest
import tensorflow as tf

from tfpipe import generation
from tests.test_lm import generated_batch, lm_task

NEW = 8


@pytest.fixture(scope='module')
def task():
    return lm_task(num_cells=2, num_micro_batches=2, dtype=tf.float32)


@pytest.fixture(scope='module')
def prompt():
    return generated_batch()['inputs'][:3, :6]


@pytest.mark.parametrize('sampling', [generation.Sampling(),
                                      generation.Sampling(temperature=1.0, top_k=20, seed=5)],
                         ids=['greedy', 'sampled'])
def test_cached_equals_uncached(task, prompt, sampling):
    cached = task.generator.generate(task.theta['pipe'], prompt, NEW, sampling)
    uncached = task.generator.generate(task.theta['pipe'], prompt, NEW, sampling, cached=False)
    np.testing.assert_array_equal(cached[0].numpy(), uncached[0].numpy())
    np.testing.assert_allclose(cached[1].numpy(), uncached[1].numpy(), atol=1e-5)
    assert (cached[1].numpy() <= 0).all()


def test_in_graph_generation_equals_the_cached_steps(task, prompt):
    """generate_in_graph (the exported `generate`: dynamic shapes, a tf.while_loop) gives
    generate's greedy tokens and log-probs; the log-probs see any misplaced cache write
    (a token at the wrong position) even where the argmax does not move."""
    expected = task.generator.generate(task.theta['pipe'], prompt, NEW)

    @tf.function(input_signature=[tf.TensorSpec([None, None], tf.int32),
                                  tf.TensorSpec([], tf.int32)])
    def in_graph(ids, num_new):
        return task.generator.generate_in_graph(task.theta['pipe'], ids, num_new)
    ids, log_probs = in_graph(tf.cast(prompt, tf.int32), tf.constant(NEW))
    np.testing.assert_array_equal(ids.numpy(), expected[0].numpy())
    np.testing.assert_allclose(log_probs.numpy(), expected[1].numpy(), atol=1e-5)


@pytest.mark.parametrize('temperature, top_k', [
    (float('nan'), 0), (float('inf'), 0), (-float('inf'), 0), (-1.0, 0), (1e-40, 0),
    (1.0, -1)])
def test_non_finite_or_out_of_range_sampling_is_refused(temperature, top_k):
    with pytest.raises(ValueError, match=f'temperature={temperature}'):
        generation.Sampling(temperature, top_k)


def test_extreme_temperatures_draw_valid_tokens(task, prompt):
    """The smallest normal temperature is greedy; a huge one stays within top_k."""
    theta = task.theta['pipe']
    greedy = task.generator.generate(theta, prompt, NEW)[0].numpy()
    coldest = task.generator.generate(theta, prompt, NEW,
                                      generation.Sampling(temperature=1.2e-38, seed=1))[0]
    np.testing.assert_array_equal(coldest.numpy(), greedy)
    logits = tf.random.stateless_normal([64, 50], [1, 2])
    top = tf.math.top_k(logits, 3).indices.numpy()
    for seed in range(4):
        token, _ = generation._choose(logits, generation.Sampling(3e38, 3, seed), tf.constant(0))
        assert all(t in row for t, row in zip(token.numpy(), top))


@pytest.mark.parametrize('temperature, top_k', [(0.7, 0), (1.3, 0), (0.7, 5)])
def test_sampling_draws_from_the_logits_over_the_temperature(temperature, top_k):
    """Token i is the draw of stateless_categorical(logits / T) with seed (seed, i), those
    logits cut to the top_k: the same uniform numbers, so the same tokens in every row. A
    temperature applied twice (logits / T**2) changes thousands of the 20000 rows."""
    logits = tf.random.stateless_normal([20000, 50], [3, 4]) * 3
    scaled = logits / temperature
    if top_k:
        scaled = tf.where(logits < tf.math.top_k(logits, top_k).values[:, -1:], -np.inf, scaled)
    expected = tf.random.stateless_categorical(scaled, 1, seed=[7, 5])[:, 0]
    token, _ = generation._choose(logits, generation.Sampling(temperature, top_k, 7),
                                  tf.constant(5))
    np.testing.assert_array_equal(token.numpy(), expected.numpy())


def test_sampled_frequencies_follow_the_softmax_over_the_temperature():
    """The draw's own statistics, whatever the sampler: 20000 rows of the same logits give
    each token about softmax(logits / 0.7) of the time (total variation 0.003-0.009 over
    seeds 0-2 here; with logits / 0.49, a temperature applied twice, 0.10-0.11)."""
    logits = np.array([0, 1, 2, 3, -1], np.float32)
    expected = np.exp(logits / 0.7) / np.exp(logits / 0.7).sum()
    for seed in range(3):
        token, _ = generation._choose(tf.constant(np.tile(logits, [20000, 1])),
                                      generation.Sampling(0.7, 0, seed), tf.constant(0))
        frequencies = np.bincount(token.numpy(), minlength=len(logits)) / 20000
        assert 0.5 * np.abs(frequencies - expected).sum() < 0.03, (seed, frequencies)


def test_same_seed_same_tokens_other_seed_other_tokens(task, prompt):
    def sample(seed):
        return task.generator.generate(task.theta['pipe'], prompt, NEW, generation.Sampling(
            temperature=1.0, seed=seed))[0].numpy()
    np.testing.assert_array_equal(sample(1), sample(1))
    assert (sample(1) != sample(2)).any()


def test_top_1_sampling_is_greedy(task, prompt):
    greedy = task.generator.generate(task.theta['pipe'], prompt, NEW)[0].numpy()
    top1 = task.generator.generate(task.theta['pipe'], prompt, NEW, generation.Sampling(
        temperature=2.0, top_k=1, seed=3))[0].numpy()
    np.testing.assert_array_equal(top1, greedy)


def test_each_layers_cache_lives_on_its_cells_device(task):
    caches = task.generator.init_caches(2)
    assert len(caches) == len(task.pipe.cells)
    for cell, cache in zip(task.pipe.cells, caches):
        blocks = [l.params.name for l in cell.layers if l.params.name.startswith('block')]
        assert sorted(cache) == blocks
        for kv in cache.values():
            assert tf.DeviceSpec.from_string(kv['key'].device) == \
                tf.DeviceSpec.from_string(cell.device)
    assert sum(len(c) for c in caches) == 2  # both blocks, wherever they are


def test_prompt_longer_than_the_context_is_refused(task):
    context = task.generator.context
    with pytest.raises(ValueError, match='exceeds the context'):
        task.generator.generate(task.theta['pipe'], tf.ones([1, context], tf.int32), 1)


def test_bfloat16_body_caches_in_bfloat16_and_agrees_greedily(prompt):
    task = lm_task(num_cells=2, num_micro_batches=2, dtype=tf.float32,
                   fprop_dtype=tf.bfloat16)
    assert {kv['key'].dtype for c in task.generator.init_caches(1) for kv in c.values()} == \
        {tf.bfloat16}
    cached = task.generator.generate(task.theta['pipe'], prompt, NEW)
    uncached = task.generator.generate(task.theta['pipe'], prompt, NEW, cached=False)
    np.testing.assert_array_equal(cached[0].numpy(), uncached[0].numpy())
    np.testing.assert_allclose(cached[1].numpy(), uncached[1].numpy(), atol=2e-2)
