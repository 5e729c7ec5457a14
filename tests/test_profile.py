"""The planner's per-layer profile (tfpipe/tuning/profile.py): identical layers timed once."""
import tensorflow as tf

from tfpipe import layers
from tfpipe.tuning import profile


WIDTH = 512  # a millisecond's matmul: well above the call overhead subtracted


def _body():
    dense = layers.Dense.Params().Set(input_dim=WIDTH, output_dim=WIDTH)
    return [dense.Copy().Set(name='d0'), dense.Copy().Set(name='d1'),
            dense.Copy().Set(name='relu', activation='relu'), dense.Copy().Set(name='d3')]


def _times(p: profile.LayerProfile) -> tuple:
    return p.forward.fixed, p.forward.per_example, p.backward.fixed, p.backward.per_example


def test_layers_defined_alike_are_timed_once_and_share_the_times():
    """d0, d1 and d3 differ only in their names: one timing, copied (timed apart, the
    fastest of a few calls would never come out equal to the last bit); the relu layer
    is another definition, timed on its own."""
    sample = tf.random.stateless_normal([256, WIDTH], [0, 1])
    shared = profile.profile_body(_body(), sample, '/CPU:0', [128, 256], repeats=2)
    assert _times(shared[0]) == _times(shared[1]) == _times(shared[3])
    assert _times(shared[2]) != _times(shared[0])
    apart = profile.profile_body(_body(), sample, '/CPU:0', [128, 256], repeats=2,
                                 share_identical=False)
    assert len({_times(p) for p in apart}) == 4
    # Bytes are each layer's own either way.
    assert [p.param_bytes for p in shared] == [p.param_bytes for p in apart] == [(WIDTH + 1) * WIDTH * 4.0] * 4


def test_the_same_definition_fed_other_shapes_is_another_cost():
    layer = _body()[0].Instantiate()
    renamed = _body()[1].Instantiate()
    x = tf.zeros([4, WIDTH])
    key = profile._same_cost_key(layer, x)  # noqa: SLF001
    assert profile._same_cost_key(renamed, x) == key  # noqa: SLF001
    assert profile._same_cost_key(layer, tf.zeros([4, 3, WIDTH])) != key  # noqa: SLF001
    assert profile._same_cost_key(layer, tf.zeros([4, WIDTH], tf.float64)) != key  # noqa: SLF001


def test_a_matmul_keeps_its_input_and_a_relu_its_output_too():
    """What the backward needs, read from the graph: x @ w keeps x (w is a weight, there
    all step); with a relu, the activation too. Shared with identical layers."""
    batch = 8
    sample = tf.random.stateless_normal([batch, WIDTH], [0, 1])
    prof = profile.profile_body(_body(), sample, '/CPU:0', [batch], timed=False)
    row = WIDTH * 4.0
    assert [p.saved_bytes_per_example for p in prof] == [row, row, 2 * row, row]
    assert [p.kept_per_example() for p in prof] == [row, row, 2 * row, row]


def test_a_transformer_block_keeps_its_attention_probabilities_beyond_its_output():
    """The planner counted only layer inputs and outputs for what a cell keeps; a block
    keeps its heads' [length, length] probabilities and its feed-forward's hidden
    activations, many times its output. Without a measurement the old estimate remains."""
    length, width, heads, hidden = 32, 16, 4, 64
    block = layers.TransformerBlock.Params().Set(
        name='block', model_dim=width, hidden_dim=hidden, num_heads=heads, causal=True)
    sample = tf.random.stateless_normal([2, length, width], [0, 1])
    (prof,) = profile.profile_body([block], sample, '/CPU:0', [2], timed=False)
    probabilities = heads * length * length * 4.0
    assert prof.saved_bytes_per_example >= probabilities + length * hidden * 4.0
    assert prof.saved_bytes_per_example > 5 * prof.output_bytes_per_example
    unmeasured = profile.LayerProfile('x', None, None, 0.0, 0.0, 3.0, 5.0)
    assert unmeasured.kept_per_example() == 8.0
