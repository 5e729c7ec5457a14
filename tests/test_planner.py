"""The planner: search, memory budget, device profiles, and the trainer's inspect_pipeline mode."""
import dataclasses
import json
import os
import shlex

import gin

import pytest

from tests import trainer_helpers
from tfpipe.tuning import planner, simulator
from tfpipe.tuning.calibration import Calibration, MeasuredRun, calibrate
from tfpipe.tuning.profile import Affine, LayerProfile
from tfpipe.tuning.timeline import Timeline


def _layers(n=8, param_bytes=1e6, activation=1e4):
    return [LayerProfile(name=f'l{i}', forward=Affine(1e-4, 1e-4), backward=Affine(2e-4, 2e-4),
                         param_bytes=param_bytes, slot_bytes=2 * param_bytes,
                         input_bytes_per_example=activation, output_bytes_per_example=activation)
            for i in range(n)]


def _independent(memory=None):
    return planner.DeviceProfile(simulator.DeviceModel(), memory)


def test_more_devices_and_micro_batches_win_on_independent_devices():
    configs = planner.search(_layers(), 64, 4, _independent())
    best = configs[0]
    assert best.num_cells == 4 and best.num_micro_batches > 1
    assert best.balance == [2, 2, 2, 2]
    assert configs == sorted(configs, key=lambda c: (not c.fits, round(c.step_time, 6),
                                                     c.num_cells, c.num_micro_batches,
                                                     max(c.peak_bytes)))


def test_the_recommendation_respects_the_memory_budget():
    layers = _layers(activation=1e5)
    free = planner.search(layers, 64, 4, _independent())
    peaks = sorted(max(c.peak_bytes) for c in free)
    budget = peaks[len(peaks) // 2]  # half of the configurations fit
    configs = planner.search(layers, 64, 4, _independent(budget))
    best = planner.best_fitting(configs, budget)
    assert max(best.peak_bytes) <= budget
    assert any(not c.fits for c in configs)
    assert all(c.fits == (max(c.peak_bytes) <= budget) for c in configs)
    assert best.step_time >= free[0].step_time


def test_a_budget_too_small_for_everything_is_a_clear_error():
    configs = planner.search(_layers(), 64, 2, _independent(1000.0))
    with pytest.raises(ValueError, match='no configuration fits --device_memory.*raise'):
        planner.best_fitting(configs, 1000.0)


def test_recompute_lowers_the_predicted_peak():
    layers = _layers(activation=1e6)
    costs = {policy: simulator.simulate(
        planner.SCHEDULES['fill_drain'](2, 8),
        planner.cell_costs(layers, [4, 4], 8, 64, policy)) for policy in ('always', 'never')}
    assert max(costs['always'].peak_bytes) < max(costs['never'].peak_bytes)
    assert costs['always'].step_time > costs['never'].step_time  # one extra forward


def test_device_profile_and_sizes_parse_or_name_the_fix():
    profile = planner.parse_device_profile('speed=8,memory=16GiB,bandwidth=10e9')
    assert profile.memory == 16 * 2**30
    assert profile.model == simulator.DeviceModel(8.0, None, 10e9)
    assert planner.parse_bytes('512MB') == 512e6
    with pytest.raises(ValueError, match='speed=8,memory=16GiB'):
        planner.parse_device_profile('sped=8')
    with pytest.raises(ValueError, match='512MiB'):
        planner.parse_bytes('lots')


def test_params_override_applies_to_the_model():
    from trainer import experiment
    config = planner.search(_layers(5), 16, 2, _independent())[0]
    params = experiment.load_params(trainer_helpers.FAST, config.params_override())
    pipe = params.task.pipeline
    assert (pipe.balance, pipe.num_micro_batches, pipe.recompute, pipe.schedule) == (
        config.balance, config.num_micro_batches, config.recompute, config.schedule)


def _inspect_pipeline(tmp_path, data_dir, *flags):
    """Runs --mode=inspect_pipeline on the fast model for 2 devices: (stdout, JSON report)."""
    logdir = str(tmp_path / 'plan')
    out = trainer_helpers.run(trainer_helpers.FAST, logdir, data_dir, '--mode=inspect_pipeline',
                              '--num_devices=2', *flags)
    assert out.returncode == 0, out.stderr[-3000:]
    with open(os.path.join(logdir, 'inspect_pipeline.json')) as f:
        return out.stdout, json.load(f)


def test_inspect_pipeline_prints_the_best_and_writes_json(tmp_path, data_dir):
    stdout, report = _inspect_pipeline(tmp_path, data_dir, '--device_memory=1GiB')
    # The recommendation pastes into a shell unchanged and reads back as the best config,
    # and the gin file written beside the report sets the same params.
    flag = next(line for line in stdout.splitlines() if '--params_override=' in line)
    [arg] = shlex.split(flag)
    from trainer import experiment
    pasted = experiment.load_params(trainer_helpers.FAST, arg.split('=', 1)[1])
    try:
        from_gin = experiment.load_params(
            trainer_helpers.FAST, gin_files=[str(tmp_path / 'plan' / 'inspect_pipeline.gin')])
    finally:
        gin.clear_config()
    # Before recommending, the best predicted configuration of K=1 and of K=2 was measured
    # and one whose two cells work at once (the same or another), and one of them picked.
    measured = [m['config'] for m in report['measured']]
    assert {c['num_cells'] for c in measured} == {1, 2}
    assert any(c['num_cells'] == 2 and c['num_micro_batches'] > 1 for c in measured)
    assert all(len(m['step_seconds']) == 12 for m in report['measured'])
    assert report['best'] in measured and report['measuring_seconds'] > 0
    assert stdout.count('measured median') == len(measured) and stdout.count('<- picked') == 1
    best = report['best']
    for params in (pasted, from_gin):
        pipe = params.task.pipeline
        assert (pipe.num_cells, pipe.balance, pipe.num_micro_batches, pipe.recompute,
                pipe.schedule) == tuple(best[k] for k in ('num_cells', 'balance',
                                                          'num_micro_batches', 'recompute',
                                                          'schedule'))
    assert len(report['layers']) == 5
    assert report['best']['num_cells'] <= 2 and report['best']['fits']
    assert report['params_override'] in stdout
    assert 'predicted memory per device' in stdout and 'all devices' in stdout
    # Planned for local CPUs: calibrated on measured steps of the configured [3, 2], M=2,
    # of the same with M=4, which tells the per-call part of compute apart, and of one cell,
    # which tells how many logical CPUs really run at once, under both recompute policies.
    runs = 'K=2 M=2 always, K=2 M=4 always, K=1 M=2 always, K=1 M=2 never'
    assert f'costs: measured on 5 steps each of {runs}' in stdout
    calibration = report['calibration']
    assert calibration['source'].startswith(f'5 steps each of {runs}')
    assert 1 <= calibration['parallelism'] <= os.cpu_count()
    assert calibration['forward_scale'] > 0 and calibration['backward_scale'] > 0
    assert calibration['forward_fixed_scale'] > 0 and calibration['backward_fixed_scale'] > 0
    assert calibration['step_overhead'] > 0  # the update and the norm are never free


def test_the_planner_drives_the_search_through_the_measuring_function_it_is_handed(
        data_dir, monkeypatch, caplog):
    """planning.plan calibrates, measures candidates and picks through the one function the
    trainer hands it (the model's real training step, counted here), in that order."""
    from tfpipe.tuning import planning
    from trainer import experiment, inspect_modes, plan_mode
    params = experiment.load_params(trainer_helpers.FAST)
    params.input.train.data_dir = data_dir
    task = params.task.Instantiate()
    batch = params.input.train.batch_size
    profiles = inspect_modes.profile_model(params, task, 4)
    device = planner.DeviceProfile(simulator.DeviceModel(parallelism=2))
    configured = plan_mode.configured_pipeline(task)
    calls = []
    with plan_mode.StepMeasurer(params) as measure:
        def counted(config, steps, record):
            run = measure(config, steps, record)
            calls.append((config, steps, record, run))
            return run
        result = planning.plan(profiles, batch, 2, device, configured, counted,
                               calibration_steps=2, candidates=2, rounds=2, steps=1,
                               micro_batches=(1, 2, 4))
        # Steps that take longer than the budget: one (recorded beside it), not the 3 asked.
        monkeypatch.setattr(plan_mode, 'STEP_BUDGET_SECONDS', 0.0)
        # On absl's logger: a trainer run earlier in this process may have set its verbosity.
        with caplog.at_level('INFO', logger='absl'):
            long = measure(configured, 3, True)
        assert len(long.step_seconds) == len(long.timelines) == 1
        # Each measurement logs a progress line (planning a large model takes minutes).
        assert any(f'planning: measured {configured.describe()}: 1 step(s) recorded'
                   in r.getMessage() for r in caplog.records), caplog.text
    # First the four calibration runs, recorded: the model's own [3, 2] at M=2, at M=4,
    # then on one cell under both recompute policies.
    assert [(c.balance, c.num_micro_batches, c.recompute, steps, record)
            for c, steps, record, _ in calls[:4]] == [
        ([3, 2], 2, 'always', 2, True), ([3, 2], 4, 'always', 2, True),
        ([5], 2, 'always', 2, True), ([5], 2, 'never', 2, True)]
    for config, steps, record, run in calls:  # each ran the configuration it was handed
        assert run.balance == config.balance and len(run.step_seconds) == steps
        assert len(run.timelines) == (steps if record else 0)
        assert run.num_micro_batches == config.num_micro_batches
    assert result.calibration.source.startswith(
        '2 steps each of K=2 M=2 always, K=2 M=4 always, K=1 M=2 always, K=1 M=2 never')
    # Then 2 interleaved rounds of the candidates, one step each, unrecorded, and the pick
    # is one of them.
    assert len(result.candidates) == 2 and result.best in result.candidates
    rounds = [[c for c, _, _, _ in calls[4 + 2 * r:6 + 2 * r]] for r in range(2)]
    assert rounds == [result.candidates, result.candidates[::-1]]
    assert len(calls) == 8 and not any(record for _, _, record, _ in calls[4:])
    assert all(len(s) == 2 for s in result.step_seconds)
    assert result.configs[0].step_time > 0 and 'measured median' in result.describe_measured()
    # Without a measuring function the profile alone decides.
    alone = planning.plan(profiles, batch, 2, device, configured, micro_batches=(1, 2, 4))
    assert alone.calibration.source == 'profiled only' and not alone.candidates


def test_a_lean_measurer_traces_and_times_the_recorded_step_alone(data_dir):
    """Under a planning budget (--plan_seconds) a calibration run traces only the recorded
    step, once, and times it: its walls (each at least its timeline's span) and timelines
    come in pairs. A candidate's unrecorded steps of the same configuration trace the plain
    step then."""
    from trainer import experiment, plan_mode
    params = experiment.load_params(trainer_helpers.FAST)
    params.input.train.data_dir = data_dir
    configured = plan_mode.configured_pipeline(params.task.Instantiate())
    with plan_mode.StepMeasurer(params, lean=True) as measure:
        run = measure(configured, 2, True)
        trainer = measure._runs[configured.params_override()].trainer  # noqa: SLF001
        assert trainer._step.experimental_get_tracing_count() == 0  # noqa: SLF001
        assert trainer._recorded_step.experimental_get_tracing_count() == 1  # noqa: SLF001
        assert len(run.step_seconds) == len(run.timelines) == 2
        assert all(wall >= line.span for wall, line in zip(run.step_seconds, run.timelines))
        later = measure(configured, 1, False)
        assert trainer._step.experimental_get_tracing_count() == 1  # noqa: SLF001
        assert len(later.step_seconds) == 1 and later.timelines == []


def _config(k, m, recompute='always', schedule='fill_drain', step_time=1.0, fits=True):
    return planner.Config(k, [1] * k, m, recompute, schedule, step_time, 0.0, [0.0], fits)


def test_the_baseline_the_best_and_the_best_overlapping_pipelines_are_measured():
    configs = [_config(6, 1, step_time=1.0), _config(3, 2, step_time=1.01, fits=False),
               _config(7, 1, step_time=1.02), _config(4, 4, step_time=1.03),
               _config(2, 8, step_time=1.04), _config(1, 1, step_time=1.045),
               _config(1, 1, 'never', step_time=1.05), _config(2, 2, step_time=1.06)]
    # K=1 without recompute, the best, the best with cells at once and that on the fewest
    # cells (K=3 M=2 does not fit the budget), then the best of another K.
    assert planner.measurement_candidates(configs, 5) == [configs[6], configs[0], configs[3],
                                                          configs[4], configs[2]]
    assert planner.measurement_candidates(configs, 2) == [configs[6], configs[0]]
    # Fewer kinds than asked for: each measured once; on one cell, recompute if it must.
    assert planner.measurement_candidates(configs[5:6], 4) == [configs[5]]
    # On one cell 'except_last' runs as 'never' does, and one micro-batch as any schedule.
    alike = [_config(1, 1, 'except_last', '1f1b'), _config(1, 1, 'never'), _config(2, 4)]
    assert planner.measurement_candidates(alike, 4) == [alike[1], alike[2]]


def test_the_fastest_measured_is_picked_and_near_ties_go_to_fewer_cells():
    candidates = [_config(2, 4), _config(1, 1), _config(4, 4)]
    clear = [[0.10, 0.11, 0.30], [0.13, 0.14, 0.12], [0.20, 0.21, 0.19]]
    assert planner.pick_measured(candidates, clear) == 0
    # K=2 measures 3% faster than K=1: within noise, so K=1 wins, whatever the order.
    close = [[0.097, 0.1, 0.2], [0.103, 0.104, 0.09], [0.2, 0.2, 0.2]]
    assert planner.pick_measured(candidates, close) == 1
    assert planner.pick_measured(candidates, close, tolerance=0.01) == 0


def test_inspect_pipeline_for_other_devices_uses_the_profile_alone(tmp_path, data_dir):
    stdout, report = _inspect_pipeline(tmp_path, data_dir,
                                       '--device_profile=speed=4,bandwidth=1e9')
    assert 'costs: per-layer compute profiled' in stdout
    assert report['calibration']['source'] == 'profiled only'


@pytest.mark.parametrize('flag,error', [
    ('--device_memory=1KiB', 'no configuration fits --device_memory'),
    ('--plan_seconds=-5', '--plan_seconds=-5: give a budget of at least 0')],
    ids=['no_fitting_config', 'negative_plan_seconds'])
def test_inspect_pipeline_with_bad_input_exits_2_and_writes_nothing(tmp_path, data_dir, flag,
                                                                    error):
    logdir = str(tmp_path / 'plan')
    out = trainer_helpers.run(trainer_helpers.FAST, logdir, data_dir, '--mode=inspect_pipeline',
                              '--num_devices=2', flag)
    assert out.returncode == 2
    assert error in trainer_helpers.error_line(out)
    assert not os.path.exists(logdir)


def test_partition_by_memory_evens_out_bytes_per_cell():
    import tensorflow as tf
    import tfpipe
    from tfpipe import layers
    from tfpipe.pipeline import costs, partition
    widths = [4, 256, 8, 8, 8, 8]
    body = [layers.Dense.Params().Set(name=f'fc{i}', input_dim=a, output_dim=b)
            for i, (a, b) in enumerate(zip(widths, widths[1:]))]
    per_layer = costs.by_memory(body, tf.TensorShape([32, 4]))
    assert per_layer[0] == 4 * (2 * (4 * 256 + 256) + 32 * 256)  # weights + grads + output
    pipe = tfpipe.PipeliningLayer.Params().Set(
        name='pipe', body=body, num_cells=2, partition_by='memory',
        input_shape=[32, 4]).Instantiate()
    assert list(pipe.balance) == partition.solve_balance(per_layer, 2) == [1, 4]


def test_inspect_model_reports_bytes_per_cell(data_dir, capsys):
    from trainer import experiment, inspect_modes
    params = experiment.load_params(trainer_helpers.FAST)
    params.input.train.data_dir = data_dir
    inspect_modes.inspect_model(params)
    out = capsys.readouterr().out
    cells = [line for line in out.splitlines() if line.strip().startswith('parameters')]
    assert len(cells) == 2  # SmallConvPipe: balance [3, 2]
    # Adam keeps two slots per weight: slot bytes are twice the parameter bytes.
    for line in cells:
        params_mib = float(line.split('parameters ')[1].split(' MiB')[0])
        slots_mib = float(line.split('optimizer slots ')[1].split(' MiB')[0])
        assert params_mib > 0 and slots_mib == pytest.approx(2 * params_mib, rel=1e-3)
        assert 'activations per micro-batch' in line


def _measured_timeline(layers, balance, m, batch, calibration, parallelism=None,
                       recompute='never'):
    """A timeline as the recorder would measure the simulated step: each task's per-task
    overhead shows as the device's idle time before its event."""
    from tfpipe.pipeline.recorder import Label
    from tfpipe.tuning.timeline import Event, Timeline
    costs = planner.cell_costs(layers, balance, m, batch, recompute, calibration)
    result = simulator.simulate(planner.SCHEDULES['fill_drain'](len(balance), m), costs,
                                calibration.device(simulator.DeviceModel(
                                    parallelism=parallelism)))
    events = [Event(Label(f'CPU:{t.cell}', t.cell, t.micro_batch, t.phase),
                    float(result.start[t]) + calibration.task_overhead, float(result.end[t]))
              for t in result.start]
    return Timeline(events, [f'CPU:{k}' for k in range(len(balance))], m), result


def test_calibration_recovers_the_costs_of_a_measured_step():
    layers = _layers()
    truth = Calibration(forward_scale=0.5, backward_scale=2.0, task_overhead=1e-4,
                                latency=3e-4, step_overhead=2e-3)
    line, result = _measured_timeline(layers, [4, 4], 4, 64, truth)
    wall = float(result.step_time) + truth.step_overhead
    fitted = calibrate(layers, [MeasuredRun([4, 4], 4, [line, line], [wall, 2 * wall],
                                            recompute='never')],
                       64, None, source='a test step')
    for field in ('forward_scale', 'backward_scale', 'task_overhead', 'latency',
                  'step_overhead'):
        assert getattr(fitted, field) == pytest.approx(getattr(truth, field), rel=1e-6), field
    assert 'measured on a test step' in fitted.describe()
    assert 'profiled' in Calibration().describe()
    # The calibrated planner predicts the measured configuration's step, and more.
    again = planner.simulate(layers, [4, 4], 4, 64, 'never', 'fill_drain',
                             simulator.DeviceModel(), fitted)
    assert float(again.step_time) + fitted.step_overhead == pytest.approx(wall)
    plain = planner.simulate(layers, [4, 4], 4, 64, 'never', 'fill_drain',
                             simulator.DeviceModel())
    assert float(plain.step_time) != pytest.approx(wall)


def test_two_micro_batch_sizes_tell_per_call_costs_from_per_example_costs():
    layers = _layers()
    # The pipeline pays a tenth of the profiled per-call cost in its forward and four
    # times it in its backward: one micro-batch size cannot see that.
    truth = Calibration(forward_scale=0.5, backward_scale=2.0, forward_fixed_scale=0.1,
                                backward_fixed_scale=4.0, task_overhead=1e-4)
    runs = []
    for m in (2, 8):
        line, result = _measured_timeline(layers, [4, 4], m, 64, truth)
        runs.append(MeasuredRun([4, 4], m, [line], [float(result.step_time) + 1e-3],
                                recompute='never'))
    fitted = calibrate(layers, runs, 64, None, source='x')
    for field in ('forward_scale', 'backward_scale', 'forward_fixed_scale',
                  'backward_fixed_scale', 'task_overhead'):
        assert getattr(fitted, field) == pytest.approx(getattr(truth, field), rel=1e-6), field
    assert fitted.step_overhead == pytest.approx(1e-3, rel=1e-6)
    # The fit carries to a micro-batch size it never saw; one size alone does not.
    one = calibrate(layers, runs[:1], 64, None, source='x')
    device = simulator.DeviceModel()
    expected = float(planner.simulate(layers, [2, 6], 32, 64, 'never', 'fill_drain', device,
                                      truth).step_time)
    assert float(planner.simulate(layers, [2, 6], 32, 64, 'never', 'fill_drain', device,
                                  fitted).step_time) == pytest.approx(expected, rel=1e-6)
    assert float(planner.simulate(layers, [2, 6], 32, 64, 'never', 'fill_drain', device,
                                  one).step_time) != pytest.approx(expected, rel=0.05)


def test_a_one_device_run_measures_how_many_logical_cpus_run_at_once():
    layers = _layers()
    # Two cores, but tasks of different devices together only get 1.4 cores' worth.
    truth = Calibration(forward_scale=0.5, backward_scale=2.0, parallelism=1.4)
    runs = []
    for balance in ([2, 2, 2, 2], [8]):
        line, result = _measured_timeline(layers, balance, 4, 64, truth, parallelism=2)
        runs.append(MeasuredRun(balance, 4, [line], [float(result.step_time)],
                                recompute='never'))
    fitted = calibrate(layers, runs, 64, 2, source='x')
    assert fitted.parallelism == pytest.approx(1.4, rel=1e-3)
    device = simulator.DeviceModel(parallelism=2)
    for balance in ([4, 4], [2, 2, 2, 2]):  # K=2 was never measured
        expected = planner.simulate(layers, balance, 8, 64, 'never', 'fill_drain', device, truth)
        got = planner.simulate(layers, balance, 8, 64, 'never', 'fill_drain', device, fitted)
        assert float(got.step_time) == pytest.approx(float(expected.step_time), rel=1e-3)
    # Without the one-device run the parallelism stays the device model's.
    alone = calibrate(layers, runs[:1], 64, 2, source='x')
    assert alone.parallelism == 2


def test_one_configuration_under_both_policies_measures_what_keeping_activations_costs():
    layers = _layers()
    # A cell that keeps its activations runs 30% slower than the profile says.
    truth = Calibration(forward_scale=0.5, backward_scale=2.0, keep_scale=1.3)
    runs = []
    for balance, policy in (([4, 4], 'always'), ([8], 'always'), ([8], 'never')):
        line, result = _measured_timeline(layers, balance, 4, 64, truth, recompute=policy)
        runs.append(MeasuredRun(balance, 4, [line], [float(result.step_time)],
                                recompute=policy))
    fitted = calibrate(layers, runs, 64, None, source='x')
    assert fitted.keep_scale == pytest.approx(1.3, rel=1e-3)
    device = simulator.DeviceModel()
    for policy in ('never', 'except_last'):  # neither was measured on two cells
        expected = planner.simulate(layers, [2, 6], 8, 64, policy, 'fill_drain', device, truth)
        got = planner.simulate(layers, [2, 6], 8, 64, policy, 'fill_drain', device, fitted)
        assert float(got.step_time) == pytest.approx(float(expected.step_time), rel=1e-3)
    assert calibrate(layers, runs[:2], 64, None, source='x').keep_scale == 1.0


def test_measured_span_scales_compute_the_tasks_alone_miss():
    layers = _layers()
    truth = Calibration(forward_scale=0.5, backward_scale=2.0)
    line, result = _measured_timeline(layers, [4, 4], 4, 64, truth)
    # Every task of the step took its time, but the devices also stalled between them in
    # ways no single task shows (the step lasted 30% longer than its tasks allow): the
    # fastest step's span is the truth the calibration keeps.
    stretched = Timeline([dataclasses.replace(e, start=1.3 * e.start, end=1.3 * e.start
                                              + (e.end - e.start)) for e in line.events],
                         line.devices, line.num_micro_batches)
    run = MeasuredRun([4, 4], 4, [stretched], [1.3 * float(result.step_time)],
                      recompute='never')
    fitted = calibrate(layers, [run], 64, None, source='x')
    again = planner.simulate(layers, [4, 4], 4, 64, 'never', 'fill_drain',
                             simulator.DeviceModel(), fitted)
    assert float(again.step_time) == pytest.approx(stretched.span + fitted.task_overhead,
                                                   rel=1e-4)
    assert fitted.forward_scale / fitted.backward_scale == pytest.approx(0.25, rel=1e-6)


def test_calibration_under_shared_cores_reads_work_not_wall_time():
    layers = _layers()
    truth = Calibration(forward_scale=3.0, backward_scale=3.0)
    line, _ = _measured_timeline(layers, [2, 2, 2, 2], 8, 64, truth, parallelism=2)
    run = MeasuredRun([2, 2, 2, 2], 8, [line], [1.0], recompute='never')
    shared = calibrate(layers, [run], 64, 2, source='x')
    naive = calibrate(layers, [run], 64, None, source='x')
    assert shared.forward_scale == pytest.approx(3.0, rel=1e-6)
    assert naive.forward_scale > 3.0  # tasks stretched by sharing look like slower compute


def test_search_adds_the_calibrated_step_overhead_and_task_costs():
    layers = _layers()
    plain = planner.search(layers, 64, 2, _independent(), cells=[2], micro_batches=[4],
                           recompute=['never'], schedules=['fill_drain'])[0]
    cal = Calibration(task_overhead=1e-3, step_overhead=5e-3)
    calibrated = planner.search(layers, 64, 2, _independent(), cells=[2], micro_batches=[4],
                                recompute=['never'], schedules=['fill_drain'],
                                calibration=cal)[0]
    # 2 * (M + K - 1) tasks on the critical path, each 1 ms longer, plus the step's 5 ms.
    assert calibrated.step_time == pytest.approx(plain.step_time + 2 * 5 * 1e-3 + 5e-3)


def test_calibration_ignores_a_task_another_process_delayed():
    layers = _layers()
    truth = Calibration(forward_scale=0.5, backward_scale=2.0)
    line, result = _measured_timeline(layers, [4, 4], 4, 64, truth)
    # In a second step the step's last task, cell 0's backward of micro-batch 0, lost the
    # core for 50 ms: its stamps bracket the wait.
    slow = Timeline([dataclasses.replace(e, end=e.end + 0.05)
                     if (e.label.cell, e.label.micro_batch, e.label.phase) == (0, 0, 'backward')
                     else e for e in line.events], line.devices, line.num_micro_batches)
    assert slow.span > line.span + 0.04
    wall = float(result.step_time)
    fitted = calibrate(layers, [MeasuredRun([4, 4], 4, [slow, line], [wall + 0.05, wall],
                                            recompute='never')],
                       64, None, source='x')
    assert fitted.forward_scale == pytest.approx(0.5, rel=1e-6)
    assert fitted.backward_scale == pytest.approx(2.0, rel=1e-6)


def test_what_a_layers_forward_keeps_is_held_per_micro_batch_or_rebuilt_in_the_backward():
    """A cell that does not recompute holds its layers' saved tensors (profiled) for every
    micro-batch in flight; a recomputing one rebuilds them inside its backward task. The
    layers' inputs and outputs stand in only where nothing was measured."""
    from tfpipe.tuning.calibration import cell_costs
    measured = [dataclasses.replace(p, saved_bytes_per_example=7e4) for p in _layers(4)]
    b = 16 / 4
    (never,) = cell_costs(measured, [4], 4, 16, 'never')
    (always,) = cell_costs(measured, [4], 4, 16, 'always')
    assert never.stash_bytes == b * 4 * 7e4
    assert always.stash_bytes == b * 1e4  # the cell's input
    assert always.working_bytes == b * 4 * 7e4 + 4 * 1e6
    (unmeasured,) = cell_costs(_layers(4), [4], 4, 16, 'never')
    assert unmeasured.stash_bytes == b * 4 * 2e4
    peak = {name: max(planner.search(layers, 16, 1, _independent(), micro_batches=[4],
                                     recompute=['never'], schedules=['fill_drain'])[0].peak_bytes)
            for name, layers in (('measured', measured), ('unmeasured', _layers(4)))}
    # Fill-drain on one cell: all 4 micro-batches in flight.
    assert peak['measured'] - peak['unmeasured'] == pytest.approx(4 * b * 4 * (7e4 - 2e4))
