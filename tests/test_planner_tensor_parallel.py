"""The planner's third axis: T devices per cell (tensor parallelism) beside K and M."""
import dataclasses
import json
import os

import pytest

from tests import trainer_helpers
from tfpipe import layers
from tfpipe.layers.tensor_parallel_dense import (ColumnParallelDense, ParallelMLP,
                                                 RowParallelDense)
from tfpipe.pipeline.schedule import BACKWARD, FORWARD
from tfpipe.tuning import planner, profile, simulator, tensor_split
from tfpipe.tuning.profile import Affine, LayerProfile


def _layers(n=4, split=1.0, param_bytes=1e6, activation=1e4):
    """`n` profiled layers whose `split` share is tensor-parallel, one all-reduce each."""
    return [LayerProfile(name=f'l{i}', forward=Affine(0.0, 1e-4), backward=Affine(0.0, 2e-4),
                         param_bytes=param_bytes, slot_bytes=2 * param_bytes,
                         input_bytes_per_example=activation,
                         output_bytes_per_example=activation, split_fraction=split,
                         all_reduces=1 if split else 0)
            for i in range(n)]


def _tp_body(hidden=32):
    return [layers.Conv2D.Params().Set(name='conv0', filter_shape=(3, 3, 3, 8),
                                       activation='relu'),
            layers.GlobalAvgPool.Params().Set(name='pool'),
            ParallelMLP.Params().Set(name='mlp', input_dim=8, hidden_dim=hidden),
            ColumnParallelDense.Params().Set(name='fc', input_dim=8, output_dim=16,
                                             activation='relu'),
            RowParallelDense.Params().Set(name='logits', input_dim=16, output_dim=4)]


def test_the_model_params_say_which_t_they_allow():
    from trainer import experiment
    params = experiment.load_params(trainer_helpers.FAST)
    pipe = params.task.pipeline
    assert tensor_split.tensor_parallel_degrees(pipe, 8) == [1]  # nothing to split
    pipe.body = _tp_body(hidden=32)  # widths 32, 16, 16: T divides 16
    assert tensor_split.split_widths(pipe.body) == [32, 16, 16]
    assert tensor_split.tensor_parallel_degrees(pipe, 8) == [1, 2, 4, 8]
    assert tensor_split.tensor_parallel_degrees(pipe, 3) == [1, 2]
    pipe.body = _tp_body(hidden=12)
    assert tensor_split.tensor_parallel_degrees(pipe, 8) == [1, 2, 4]
    pipe.Delete('tensor_parallel')  # a tfpipe without tensor parallelism
    assert tensor_split.tensor_parallel_degrees(pipe, 8) == [1]


def test_profiles_say_which_share_of_a_layer_splits_and_its_all_reduces():
    import tensorflow as tf
    sample = tf.random.stateless_normal([4, 8, 8, 3], [0, 1])
    profiles = profile.profile_body(_tp_body(), sample, '/CPU:0', [2, 4], repeats=1)
    assert [(p.split_fraction, p.all_reduces) for p in profiles] == [
        (0.0, 0), (0.0, 0), (1.0, 1), (1.0, 1), (1.0, 1)]
    assert profiles[2].per_device(4) == pytest.approx(0.25)
    assert profiles[0].per_device(4) == 1.0
    # inspect_model's profile (bytes alone) has the same bytes and splits, and no times.
    untimed = profile.profile_body(_tp_body(), sample, '/CPU:0', [2, 4], timed=False)
    assert all(p.forward is None and p.backward is None for p in untimed)
    assert ([dataclasses.replace(p, forward=None, backward=None) for p in profiles]
            == untimed)


def test_a_cell_of_t_devices_holds_and_computes_a_tth_and_all_reduces_activations():
    half = _layers(split=0.5)
    one, two = (planner.cell_costs(half, [4], 4, 64, 'never', tensor_parallel=t)
                for t in (1, 2))
    # Half of each layer splits: 3/4 of the weights, slots and compute per device at T=2.
    assert two[0].static_bytes == pytest.approx(0.75 * one[0].static_bytes)
    assert two[0].time[FORWARD] == pytest.approx(0.75 * one[0].time[FORWARD])
    assert two[0].time[BACKWARD] == pytest.approx(0.75 * one[0].time[BACKWARD])
    assert two[0].stash_bytes == one[0].stash_bytes  # activations stay on the home device
    # One all-reduce per split layer per micro-batch forward, of its output (16 examples).
    assert (two[0].devices, two[0].collectives, two[0].collective_bytes) == (2, 4, 4 * 16 * 1e4)
    assert one[0].devices == 1
    # On average the cell keeps 1 / 0.75 cores busy: T=2 on the split half, 1 on the rest.
    assert (one[0].width, two[0].width) == (1.0, pytest.approx(4 / 3))
    # A ring all-reduce moves 2(T-1)/T of the bytes over each link, plus a latency each.
    device = simulator.DeviceModel(bandwidth=1e9, latency=1e-5)
    assert simulator.collective_time(two[0], device) == pytest.approx(
        4 * 1e-5 + 2 * 0.5 * 4 * 16 * 1e4 / 1e9)
    assert simulator.collective_time(one[0], device) == 0.0
    # The step pays them in every forward and backward task: 2 x 4 micro-batches.
    times = [float(simulator.simulate(planner.SCHEDULES['fill_drain'](1, 4), cells,
                                      device).step_time) for cells in (one, two)]
    compute = 4 * (one[0].time[FORWARD] + one[0].time[BACKWARD])
    assert times[0] == pytest.approx(compute)
    assert times[1] == pytest.approx(0.75 * compute
                                     + 8 * simulator.collective_time(two[0], device))


def test_on_shared_cores_a_split_cell_gains_only_the_cores_it_has():
    whole = _layers(split=1.0)
    one_core = simulator.DeviceModel(parallelism=1)
    free = simulator.DeviceModel()
    times = {(t, d.parallelism): float(simulator.simulate(
        planner.SCHEDULES['fill_drain'](1, 4),
        planner.cell_costs(whole, [4], 4, 64, 'never', tensor_parallel=t), d).step_time)
        for t in (1, 4) for d in (one_core, free)}
    assert times[(4, None)] == pytest.approx(times[(1, None)] / 4)  # four devices of its own
    assert times[(4, 1)] == pytest.approx(times[(1, 1)])  # four shards on one core


def test_search_tries_t_within_the_devices_and_the_budget_picks_it():
    layers_ = _layers(param_bytes=4e6)
    device = planner.DeviceProfile(simulator.DeviceModel())
    configs = planner.search(layers_, 64, 4, device, tensor_parallel=(1, 2, 4))
    shapes = {(c.num_cells, c.tensor_parallel) for c in configs}
    assert shapes == {(1, 1), (2, 1), (3, 1), (4, 1), (1, 2), (2, 2), (1, 4)}
    # On free links and independent devices splitting every layer beats a pipeline's bubble.
    assert configs[0].tensor_parallel > 1
    # A budget between one cell's peak at T=2 and at T=4: only T=4 fits on one cell.
    one_cell = planner.search(layers_, 64, 4, device, tensor_parallel=(1, 2, 4), cells=[1])
    peak = {t: min(max(c.peak_bytes) for c in one_cell if c.tensor_parallel == t)
            for t in (1, 2, 4)}
    assert peak[4] < peak[2] < peak[1]
    budget = (peak[4] + peak[2]) / 2
    fitting = planner.search(layers_, 64, 4, planner.DeviceProfile(device.model, budget),
                             tensor_parallel=(1, 2, 4), cells=[1])
    best = planner.best_fitting(fitting, budget)
    assert (best.num_cells, best.tensor_parallel) == (1, 4)
    assert not any(c.fits for c in fitting if c.tensor_parallel < 4)
    # The recommendation sets T, and says so; a plan without T > 1 does not name it.
    assert best.overrides()['task.pipeline.tensor_parallel'] == 4 and 'T=4' in best.describe()
    assert 'tensor_parallel' not in planner.search(layers_, 64, 4, device)[0].params_override()
    # For a model that has T, a T=1 plan sets it too (the model's own T may be 2).
    plain = planner.search(layers_, 64, 4, device, set_tensor_parallel=True)[0]
    assert plain.overrides()['task.pipeline.tensor_parallel'] == 1
    assert ' T ' in planner.format_table(configs).splitlines()[0]


def test_slow_links_make_splitting_a_loss():
    layers_ = _layers(activation=1e6)
    slow = planner.DeviceProfile(simulator.DeviceModel(bandwidth=1e6))
    best = planner.search(layers_, 64, 2, slow, tensor_parallel=(1, 2))[0]
    assert best.tensor_parallel == 1


def test_a_configuration_of_t_devices_per_cell_is_measured_by_the_trainer(data_dir):
    """The trainer's measuring function runs a T=2 configuration's real step."""
    from trainer import experiment, plan_mode
    params = experiment.load_params(trainer_helpers.FAST)
    params.input.train.data_dir = data_dir
    params.task.pipeline.body = _tp_body()
    config = planner.Config(2, [2, 3], 2, 'always', 'fill_drain', tensor_parallel=2)
    with plan_mode.StepMeasurer(params) as measure:
        run = measure(config, 1, True)
    assert run.balance == [2, 3] and len(run.timelines) == 1 and run.step_seconds[0] > 0
    # Both cells' tasks ran on their home devices (shard 0 of each T=2 group).
    assert len({e.label.device for e in run.timelines[0].events}) == 2


def test_inspect_pipeline_of_a_t2_model_keeps_every_candidate_within_the_devices(
        tmp_path, data_dir):
    """TensorParallelMLP at T=2 on 4 logical CPUs: every configuration measured (T=1 ones
    too, which must not run on the model's T=2) and the recommendation fit K x T <= 4."""
    from trainer import experiment
    logdir = str(tmp_path / 'plan')
    out = trainer_helpers.run('image.shapes.TensorParallelMLP', logdir, data_dir,
                              '--mode=inspect_pipeline', '--num_devices=4',
                              trainer_helpers.overrides(**{'task.pipeline.tensor_parallel': 2}))
    assert out.returncode == 0, trainer_helpers.failure(out)
    with open(os.path.join(logdir, 'inspect_pipeline.json')) as f:
        report = json.load(f)
    measured = [m['config'] for m in report['measured']]
    assert any(c['tensor_parallel'] == 1 and c['num_cells'] > 2 for c in report['configs'])
    assert all(c['num_cells'] * c['tensor_parallel'] <= 4 for c in measured)
    # The recommendation applied to the T=2 model runs its own T, whatever that is.
    pasted = experiment.load_params('image.shapes.TensorParallelMLP',
                                    'task.pipeline.tensor_parallel=2,'
                                    + report['params_override'])
    assert pasted.task.pipeline.tensor_parallel == report['best']['tensor_parallel']


def test_the_best_split_configuration_is_among_those_measured():
    def config(k, m, t, step_time):
        return planner.Config(k, [1] * k, m, 'never', 'fill_drain', step_time, 0.0, [0.0],
                              True, t)
    configs = [config(2, 4, 1, 1.0), config(3, 4, 1, 1.01), config(4, 4, 1, 1.02),
               config(1, 1, 1, 1.03), config(2, 4, 2, 1.04)]
    # The baseline on one cell, the best, the best with T > 1, the best overlapping (the
    # best already), then the best of further (K, T).
    assert planner.measurement_candidates(configs, 4) == [configs[3], configs[0], configs[4],
                                                          configs[1]]
    # Measured medians within 5% are a tie won by fewer devices: K=3,T=1 over K=2,T=2.
    assert planner.pick_measured([configs[4], configs[1]], [[1.0], [1.02]]) == 1


def test_the_language_model_allows_the_t_its_heads_divide_and_its_blocks_all_reduce_twice():
    """The LM's split layers (tfpipe/layers/attention.py, embedding, VocabLogits) say which T
    they allow: TransformerLM's 4 heads allow T in {1, 2, 4}, TinyTransformerLM's 2 heads
    {1, 2}; a Transformer block runs two all-reduces per micro-batch forward."""
    from trainer import experiment
    assert tensor_split.tensor_parallel_degrees(
        experiment.load_params('lm.pystdlib.TransformerLM').task.pipeline, 8) == [1, 2, 4]
    assert tensor_split.tensor_parallel_degrees(
        experiment.load_params('lm.pystdlib.TinyTransformerLM').task.pipeline, 8) == [1, 2]
    block = layers.TransformerBlock.Params().Set(name='block', model_dim=8, hidden_dim=16,
                                                 num_heads=2).Instantiate()
    assert tensor_split.layer_split(block) == (1.0, 2)
