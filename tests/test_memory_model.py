"""memory_model.py: the predicted bytes per device, from layer profiles."""
import dataclasses

import re

import pytest

from tfpipe.tuning import memory_model
from tfpipe.tuning.profile import Affine, LayerProfile


def layer(name, params=100.0, slots=200.0, inputs=10.0, outputs=10.0):
    zero = Affine(0.0, 0.0)
    return LayerProfile(name, zero, zero, params, slots, inputs, outputs)


PROFILES = [layer('a', inputs=3.0, outputs=7.0), layer('b', outputs=5.0),
            layer('c', inputs=5.0, outputs=2.0)]


def cells(recompute=True, devices=('d0', 'd1')):
    return [memory_model.CellLayout(devices[0], 0, 2, recompute),
            memory_model.CellLayout(devices[1], 2, 3, recompute)]


def test_weights_one_gradient_set_and_slots_per_device():
    d0, d1 = memory_model.predict(PROFILES, cells(), micro_batch_size=4, num_micro_batches=2,
                                  schedule='fill_drain')
    assert (d0.device, d0.weights, d0.gradient_sums, d0.slots) == ('d0', 200, 200, 400)
    assert (d1.weights, d1.gradient_sums, d1.slots) == (100, 100, 200)
    assert d0.total == d0.weights + d0.gradient_sums + d0.slots + d0.activations


def test_slots_sharded_over_r_replicas_are_one_rth():
    unsharded = memory_model.predict(PROFILES, cells(), 4, 2, 'fill_drain')
    sharded = memory_model.predict(PROFILES, cells(), 4, 2, 'fill_drain', slot_shards=4)
    for full, shard in zip(unsharded, sharded):
        assert shard.slots == pytest.approx(full.slots / 4)
        assert shard.weights == full.weights and shard.activations == full.activations


def test_recompute_keeps_each_micro_batchs_input_and_one_micro_batchs_outputs():
    (d0, _) = memory_model.predict(PROFILES, cells(recompute=True), 4, 3, 'fill_drain')
    assert d0.activations == 3 * 4 * 3.0 + 4 * (7.0 + 5.0)
    (d0, _) = memory_model.predict(PROFILES, cells(recompute=False), 4, 3, 'fill_drain')
    assert d0.activations == 3 * 4 * (7.0 + 5.0)


def test_1f1b_holds_at_most_k_minus_k_micro_batches_fill_drain_all():
    assert memory_model.in_flight('fill_drain', 4, 3, 8) == 8
    assert [memory_model.in_flight('1f1b', 4, k, 8) for k in range(4)] == [4, 3, 2, 1]
    assert memory_model.in_flight('1f1b', 4, 0, 2) == 2


def test_cells_on_one_device_add_up():
    (both,) = memory_model.predict(PROFILES, cells(devices=('d', 'd')), 4, 2, 'fill_drain')
    apart = memory_model.predict(PROFILES, cells(), 4, 2, 'fill_drain')
    assert both.total == pytest.approx(sum(d.total for d in apart))


def test_a_measured_working_set_replaces_the_layer_output_estimate():
    # Recompute: each held micro-batch's input, plus the cell's measured working set.
    (d0, _) = memory_model.predict(PROFILES, cells(recompute=True), 4, 3, 'fill_drain',
                                   working_bytes=[500.0, 90.0])
    assert (d0.held, d0.working) == (3 * 4 * 3.0, 500.0)
    # No recompute: the held outputs are already part of what was measured, counted once.
    (d0, d1) = memory_model.predict(PROFILES, cells(recompute=False), 4, 3, 'fill_drain',
                                    working_bytes=[500.0, 5.0])
    assert (d0.held, d0.working) == (3 * 4 * (7.0 + 5.0), 500.0 - 4 * (7.0 + 5.0))
    assert d1.working == 0.0  # a measurement below the outputs adds nothing


def test_a_cell_without_recompute_holds_its_measured_saved_bytes_per_micro_batch():
    # What a micro-batch's forward keeps for its backward (attention's probabilities, a
    # feed-forward's hidden activations) replaces the layer outputs; never below them.
    (d0, d1) = memory_model.predict(PROFILES, cells(recompute=False), 4, 3, 'fill_drain',
                                    working_bytes=[500.0, 90.0], saved_bytes=[300.0, 1.0])
    assert (d0.held, d0.working) == (3 * 300.0, 500.0 - 300.0)
    assert (d1.held, d1.working) == (3 * 4 * 2.0, 90.0 - 4 * 2.0)
    # Not measured (None: one micro-batch, or a recomputing cell): the outputs, as before.
    (d0, _) = memory_model.predict(PROFILES, cells(recompute=False), 4, 3, 'fill_drain',
                                   working_bytes=[500.0, 90.0], saved_bytes=[None, None])
    assert d0.held == 3 * 4 * (7.0 + 5.0)


def test_the_last_cells_loss_gradient_is_held_per_micro_batch_in_flight():
    # Taken at each micro-batch's forward; one of them is the measured working set's own
    # output gradient, so it moves from the working set into the stash.
    (d0, d1) = memory_model.predict(PROFILES, cells(recompute=True), 4, 3, 'fill_drain',
                                    working_bytes=[500.0, 90.0], loss_gradient_bytes=[0.0, 8.0])
    assert (d0.held, d0.working) == (3 * 4 * 3.0, 500.0)
    assert (d1.held, d1.working) == (3 * (4 * 5.0 + 8.0), 90.0 - 8.0)


def test_host_peak_counts_every_state_and_held_batch_but_only_parallel_working_sets():
    memory = [memory_model.CellMemory('d0', static=100.0, stash=10.0, working=50.0),
              memory_model.CellMemory('d1', static=200.0, stash=20.0, working=70.0),
              memory_model.CellMemory('d2', static=300.0, stash=30.0, working=60.0)]
    held = [40.0, 60.0, 30.0]
    state = 600.0 + 130.0 + 1000.0  # static, held, input pipeline
    assert memory_model.host_peak(memory, held, 1, input_bytes=1000.0).peak == state + 70.0
    assert memory_model.host_peak(memory, held, 2, input_bytes=1000.0).peak == state + 130.0
    assert memory_model.host_peak(memory, held, 8, input_bytes=1000.0).peak == state + 180.0


def test_host_peak_is_the_input_filling_its_buffers_when_that_holds_more_than_a_step():
    memory = [memory_model.CellMemory('d0', static=100.0, stash=10.0, working=50.0)]
    # A step: state 100 + input 20 + held 10 + working 50 = 180; filling: 100 + 500.
    host = memory_model.host_peak(memory, [10.0], 1, input_bytes=20.0, input_peak=500.0)
    assert (host.training, host.filling, host.peak) == (180.0, 600.0, 600.0)
    assert host.refill_bound == 100.0 + 500.0 + 60.0  # the refill during a step
    # A fill below the step's bytes leaves the step's peak.
    host = memory_model.host_peak(memory, [10.0], 1, input_bytes=20.0, input_peak=30.0)
    assert host.peak == host.training == 180.0
    assert host.refill_bound == 190.0


def test_an_update_above_the_steps_activations_sets_the_peak_and_the_refill_bound():
    memory = [memory_model.CellMemory('d0', static=100.0, stash=10.0, working=50.0)]
    host = dataclasses.replace(
        memory_model.host_peak(memory, [10.0], 1, input_bytes=20.0, input_peak=30.0),
        update=300.0)
    # A step: 100 + 20 + 60 = 180; the update: state 100 + input 20 + its 300.
    assert (host.training, host.updating, host.peak) == (180.0, 420.0, 420.0)
    # The input refilling during the update: never a bound below the peak.
    assert host.refill_bound == 100.0 + 30.0 + 300.0


def test_cell_memory_divides_sharded_slots_and_keeps_two_copies_of_the_weights():
    (c0, c1) = memory_model.cell_memory(PROFILES, cells(), 4, slot_shards=2)
    assert (c0.static, c1.static) == (2 * 200 + 400 / 2, 2 * 100 + 200 / 2)
    assert (c0.stash, c1.stash) == (4 * 3.0, 4 * 5.0)


def test_measured_cell_inputs_replace_the_profiled_float32_ones_when_recomputing():
    # bfloat16 halves what a recomputing cell holds per micro-batch; the profile is float32.
    (d0, _) = memory_model.predict(PROFILES, cells(recompute=True), 4, 3, 'fill_drain',
                                   working_bytes=[500.0, 90.0], input_bytes=[6.0, 10.0])
    assert d0.held == 3 * 6.0
    (d0, _) = memory_model.predict(PROFILES, cells(recompute=False), 4, 3, 'fill_drain',
                                   working_bytes=[500.0, 90.0], input_bytes=[6.0, 10.0])
    assert d0.held == 3 * 4 * (7.0 + 5.0)  # outputs kept, not inputs


def _inspected(data_dir, capsys, sharded: bool, stage: str = 'none') -> str:
    """What inspect_model prints for SmallConvPipe at R=2."""
    from tests import trainer_helpers
    from trainer import experiment, inspect_modes
    params = experiment.load_params(
        trainer_helpers.FAST, 'task.pipeline.num_replicas=2,'
        f'task.train.shard_optimizer_states={sharded},task.train.sharding={stage}')
    params.input.train.data_dir = data_dir
    inspect_modes.inspect_model(params)
    return capsys.readouterr().out


def _inspected_slot_mib(data_dir, capsys, sharded: bool, stage: str = 'none') -> list[float]:
    """Every 'optimizer slots X MiB' inspect_model prints for SmallConvPipe at R=2: the
    four cells' lines, then the four devices' predicted lines."""
    return [float(v) for v in re.findall(r'optimizer slots ([\d.e+-]+) MiB',
                                         _inspected(data_dir, capsys, sharded, stage))]


def _between_steps(out: str) -> list[tuple[float, float, float, float]]:
    """(weights, gradient sums, slots, the step's peak) MiB of each device's
    between-steps line."""
    number = r'([\d.e+-]+) MiB'
    return [tuple(map(float, m)) for m in re.findall(
        rf': weights {number}  gradient sums {number}  slots {number}  total [^(]*'
        rf"\(the step's peak above: {number}\)", out)]


def test_inspect_model_shows_stage_3s_weights_at_1_over_r_between_steps(data_dir, capsys):
    none = _between_steps(_inspected(data_dir, capsys, False))
    gradients = _between_steps(_inspected(data_dir, capsys, False, 'gradients'))
    weights = _between_steps(_inspected(data_dir, capsys, False, 'weights'))
    assert len(none) == len(weights) == 4  # 2 replicas x 2 cells' devices
    for (w0, g0, s0, peak0), (_, _, _, peak2), (w3, g3, s3, peak3) in zip(
            none, gradients, weights):
        assert w0 > 0 and (g0, g3) == (0, 0)
        assert w3 == pytest.approx(w0 / 2, rel=1e-3)
        assert s3 == pytest.approx(s0 / 2, rel=1e-3)
        # The step's peak holds the gathered weights whole beside their parts: stage 2's
        # peak and the parts.
        assert peak3 == pytest.approx(peak2 + w3, rel=1e-3)


def test_inspect_model_divides_sharded_slot_bytes_by_r(data_dir, capsys):
    whole = _inspected_slot_mib(data_dir, capsys, sharded=False)
    sharded = _inspected_slot_mib(data_dir, capsys, sharded=True)
    assert len(whole) == len(sharded) == 8  # 2 replicas x 2 cells, cells then devices
    assert min(whole) > 0
    assert sharded == pytest.approx([w / 2 for w in whole], rel=1e-3)
    # ZeRO stages 2 and 3 shard the slots as stage 1 does (stage 2's gradient sums and
    # stage 3's weights, whole during a step, are predicted whole).
    assert _inspected_slot_mib(data_dir, capsys, False, 'gradients') == sharded
    assert _inspected_slot_mib(data_dir, capsys, False, 'weights') == sharded
