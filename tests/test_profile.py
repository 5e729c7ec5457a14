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
