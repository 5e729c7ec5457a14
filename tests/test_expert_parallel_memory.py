"""What inspect_model predicts per device with expert parallelism (expert_parallel_memory):
a member's weights and slots of an MoE layer are its E/P experts' (and the whole router),
every other layer's are whole; the all-to-all buffers follow the layer's capacity."""
import numpy as np
import pytest
import tensorflow as tf

from tests.test_expert_parallel_pipeline import pipeline
from tfpipe import optimizers
from tfpipe.tuning import expert_parallel_memory
from tfpipe.tuning.profile import Affine, LayerProfile, slot_bytes_of

ADAM = optimizers.Adam.Params()


def _bytes(variables):
    return float(sum(v.shape.num_elements() * v.dtype.size for v in variables))


def test_a_member_holds_its_experts_and_the_whole_router():
    whole = pipeline(1, 1, 1)
    member = pipeline(2, 2, 1)
    layers = whole.replica_cells[0][0].layers
    profiles = [LayerProfile(layer.params.name, Affine(0, 0), Affine(0, 0),
                             _bytes(layer.trainable_variables),
                             slot_bytes_of(ADAM, layer.trainable_variables), 1.0, 1.0)
                for layer in layers]
    got = expert_parallel_memory.member_profiles(member, profiles, ADAM)
    held = member.replica_cells[0][0].layers
    for profile, layer, original in zip(got, held, profiles):
        np.testing.assert_allclose(profile.param_bytes, _bytes(layer.trainable_variables))
        np.testing.assert_allclose(profile.slot_bytes, 2 * profile.param_bytes)  # Adam
        assert (profile.param_bytes < original.param_bytes) == (layer.params.name == 'moe')
    d, e, h = 8, 4, 6  # router [D, E] whole, experts' E x (D H + H + H D + D) halved
    assert got[1].param_bytes == 8 * (d * e + e // 2 * (2 * d * h + h + d))
    assert expert_parallel_memory.member_profiles(whole, profiles, ADAM) == profiles
    # Sharded slots (ZeRO 1/2): the member's expert slots shard over R/P replicas, the
    # others over R, so the slots stay P=1's for the model's division by R.
    sharded = expert_parallel_memory.member_profiles(member, profiles, ADAM, sharded_slots=True)
    assert [p.slot_bytes for p in sharded] == [p.slot_bytes for p in profiles]
    assert [p.param_bytes for p in sharded] == [p.param_bytes for p in got]


def test_stage_3_cuts_a_members_weights_as_p1s_over_r():
    """A member's cell weights scaled to P=1's (whole_weight_scales): what stage 3 cuts
    into R parts, since its E/P experts are cut over only the R/P replicas holding them."""
    whole, member = pipeline(1, 1, 1), pipeline(2, 2, 1)
    got = expert_parallel_memory.whole_weight_scales(
        member, [LayerProfile(layer.params.name, Affine(0, 0), Affine(0, 0),
                              _bytes(layer.trainable_variables), 0.0, 1.0, 1.0)
                 for layer in member.replica_cells[0][0].layers])
    def cell_bytes(pipe):
        return _bytes(v for layer in pipe.replica_cells[0][0].layers
                      for v in layer.trainable_variables)
    assert got == [pytest.approx(cell_bytes(whole) / cell_bytes(member))]
    assert got[0] > 1.0
    assert expert_parallel_memory.whole_weight_scales(whole, [
        LayerProfile('', Affine(0, 0), Affine(0, 0), 1.0, 0.0, 1.0, 1.0)] * 3) == [1.0]


def test_the_all_to_all_buffers_follow_the_capacity():
    pipe = pipeline(2, 2, 1).params
    # One micro-batch of 4 rows: the MoE layer routes 4 tokens, C = ceil(2 x 2 x 4 / 4) = 4.
    got = expert_parallel_memory.all_to_all_bytes(pipe, [3], tf.TensorShape([4, 6]))
    e, c, d = 4, 4, 8
    assert got == [expert_parallel_memory.EXCHANGE_BUFFERS * e * c * d * 8]  # float64
    p1 = pipeline(1, 2, 1).params
    assert expert_parallel_memory.all_to_all_bytes(p1, [3], tf.TensorShape([4, 6])) == [0.0]
