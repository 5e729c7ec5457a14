"""The measured timeline of a step: complete, ordered by the data dependencies,
one track per device, valid Chrome trace JSON and PNG, and harmless to the step,
on both executors (cell functions, the default, and the unrolled tasks)."""
import json
import os

import numpy as np
import pytest
import tensorflow as tf
from PIL import Image

from tests import model_zoo as mz
from tests import trainer_helpers as th
from tfpipe import fprop_context
from tfpipe.pipeline import recorder as recorder_lib
from tfpipe.pipeline import schedule
from tfpipe.tuning import gantt, timeline

M = 3
LR = 0.1


def sgd_step(pipe, x, y, record):
    """One ForwardBackward + SGD step; with record, also the stamps and their recorder."""
    recorders = []

    @tf.function
    def step():
        with fprop_context.training(step=3):
            if record:
                with pipe.RecordTimeline() as recorder:
                    loss, grads = pipe.ForwardBackward(pipe.theta, x, mz.loss_fn, y)
                recorders.append(recorder)
            else:
                loss, grads = pipe.ForwardBackward(pipe.theta, x, mz.loss_fn, y)
        for v, g in zip(tf.nest.flatten(pipe.theta), tf.nest.flatten(grads)):
            v.assign_sub(LR * g)
        return (loss, recorders[0].stamps()) if record else (loss,)

    out = step()
    return out, (recorders[0] if record else None)


@pytest.fixture(scope='module', params=[(2, True), (4, True), (2, False), (4, False)],
                ids=['K2-functions', 'K4-functions', 'K2-unrolled', 'K4-unrolled'])
def recorded(request):
    k, cell_functions = request.param
    body = mz.mlp_body(dropout=True)
    x, y = mz.inputs_for(body)
    plain = mz.pipeline(body, k, M, 'always', cell_functions=cell_functions)
    traced = mz.pipeline(body, k, M, 'always', cell_functions=cell_functions)
    (plain_loss,), _ = sgd_step(plain, x, y, record=False)
    (loss, stamps), recorder = sgd_step(traced, x, y, record=True)
    line = timeline.Timeline.from_stamps(recorder, stamps.numpy())
    return dict(k=k, line=line, pipe=traced, loss=loss, plain=plain, plain_loss=plain_loss)


def by_task(line):
    return {(e.label.cell, e.label.micro_batch, e.label.phase): e for e in line.events}


def test_every_task_of_every_phase_is_recorded_once(recorded):
    k, line = recorded['k'], recorded['line']
    assert len(line.events) == 3 * k * M
    tasks = by_task(line)
    assert len(tasks) == len(line.events)
    for phase in timeline.PHASES:
        assert {(c, m) for c, m, p in tasks if p == phase} == \
            {(c, m) for c in range(k) for m in range(M)}, phase
    assert line.num_cells == k and line.num_micro_batches == M
    for e in line.events:
        assert e.label.device == recorded['pipe'].devices[e.label.cell]
        assert e.end >= e.start >= 0


def test_events_follow_the_data_dependencies(recorded):
    k, tasks = recorded['k'], by_task(recorded['line'])
    for m in range(M):
        for c in range(k - 1):
            assert tasks[(c, m, 'forward')].end <= tasks[(c + 1, m, 'forward')].start
            assert tasks[(c + 1, m, 'backward')].end <= tasks[(c, m, 'recompute')].start
        for c in range(k):
            assert tasks[(c, m, 'forward')].end <= tasks[(c, m, 'recompute')].start
            assert tasks[(c, m, 'recompute')].end <= tasks[(c, m, 'backward')].start


def test_a_device_runs_one_task_at_a_time(recorded):
    line = recorded['line']
    for device in line.devices:
        mine = sorted((e for e in line.events if e.label.device == device),
                      key=lambda e: e.start)
        for before, after in zip(mine, mine[1:]):
            assert before.end <= after.start, (before, after)


def test_bubble_per_device_and_overall(recorded):
    line, k = recorded['line'], recorded['k']
    bubble = line.bubble()
    assert set(bubble) == set(line.devices) | {'overall'}
    for device in line.devices:
        busy = sum(e.duration for e in line.events if e.label.device == device)
        assert bubble[device] == pytest.approx(1 - busy / line.span)
        assert 0 <= bubble[device] < 1
    assert bubble['overall'] == pytest.approx(np.mean([bubble[d] for d in line.devices]))
    assert line.theoretical_bubble() == pytest.approx((k - 1) / (M + k - 1))
    assert f'{bubble["overall"]:.3f}' in line.summary()


def test_recording_does_not_change_the_step(recorded):
    np.testing.assert_array_equal(recorded['loss'].numpy(), recorded['plain_loss'].numpy())
    traced = {v.name: v.numpy() for v in recorded['pipe'].trainable_variables}
    plain = {v.name: v.numpy() for v in recorded['plain'].trainable_variables}
    assert traced.keys() == plain.keys()
    for name in traced:
        np.testing.assert_array_equal(traced[name], plain[name], err_msg=name)


def test_chrome_trace_and_png_files(recorded, tmp_path):
    line, k = recorded['line'], recorded['k']
    json_path, png_path = line.write(str(tmp_path), step=7)
    assert os.path.basename(json_path) == 'pipeline_trace-7.json'
    with open(json_path) as f:
        trace = json.load(f)
    events = trace['traceEvents']
    names = {e['tid']: e['args']['name'] for e in events
             if e['ph'] == 'M' and e['name'] == 'thread_name'}
    assert sorted(names.values()) == sorted(line.devices)  # one track per device, by name
    complete = [e for e in events if e['ph'] == 'X']
    assert len(complete) == 3 * k * M
    for e in complete:
        assert set(e['args']) == {'cell', 'micro_batch', 'phase'}
        assert names[e['tid']] == line.devices[e['args']['cell']]
        assert e['ts'] >= 0 and e['dur'] >= 0
    last_end = max(e['ts'] + e['dur'] for e in complete)
    assert last_end == pytest.approx(line.span * 1e6, abs=1.0)  # microseconds

    image = Image.open(png_path)
    assert image.format == 'PNG' and image.size[0] == gantt.WIDTH
    pixels = np.asarray(image.convert('RGB'))
    for row in range(k):  # every device row shows forward and backward colour
        top = gantt.TOP + row * (gantt.ROW_HEIGHT + gantt.ROW_GAP) + gantt.ROW_HEIGHT // 2
        colors = {tuple(p) for p in pixels[top, gantt.LEFT:]}
        for phase in ('forward', 'backward'):
            assert colors & set(gantt.COLORS[phase]), (row, phase)


def _recorded_line(pipe, x, y):
    (_, stamps), recorder = sgd_step(pipe, x, y, record=True)
    return timeline.Timeline.from_stamps(recorder, stamps.numpy())


def test_theory_of_virtual_stages_counts_devices_not_cells():
    """Interleaved 1F1B, K=2 devices x v=2: (K-1)/(vM+K-1), not the formula with 4 cells."""
    body = mz.mlp_body(dropout=False)
    x, y = mz.inputs_for(body)
    pipe = mz.pipeline(body, 4, 4, schedule='interleaved_1f1b', virtual_stages=2)
    line = _recorded_line(pipe, x, y)
    assert line.num_cells == 4 and line.num_devices == 2 and len(line.devices) == 2
    assert line.theoretical_bubble() == pytest.approx(1 / (2 * 4 + 1))
    assert 0 <= line.latency()['overall'] <= line.bubble()['overall']
    assert 'K=2, 4 cells' in line.summary()


def test_every_replica_is_a_device_of_the_timeline():
    body = mz.mlp_body(dropout=False)
    x, y = mz.inputs_for(body)
    pipe = mz.pipeline(body, 2, M, num_replicas=2)
    line = _recorded_line(pipe, x, y)
    assert line.devices == [pipe.replica_devices[r][k] for r in range(2) for k in range(2)]
    assert line.num_devices == 2
    assert sorted(e.replica for e in line.events) == [0] * (3 * 2 * M) + [1] * (3 * 2 * M)
    assert line.theoretical_bubble() == pytest.approx(1 / (M + 1))
    assert set(line.latency()) == set(line.devices) | {'overall'}
    tracks = [e['args']['name'] for e in line.chrome_trace()['traceEvents']
              if e['ph'] == 'M' and e['name'] == 'thread_name']
    assert tracks == line.devices


CPU = '/job:localhost/replica:0/task:0/device:CPU:'


def _event(cell, micro_batch, phase, start, end, devices=2):
    label = recorder_lib.Label(CPU + str(cell % devices), cell, micro_batch, phase)
    return timeline.Event(label, start, end)


def test_measured_costs_and_latency_explain_the_bubble():
    """K=2, M=2 fill-drain by hand: cell 0 F=1 B=2, cell 1 F=2 B=1+2 (recompute, backward);
    device 1 starts F0 0.5 after its input is ready and device 0 starts B0 0.25 late."""
    events = [_event(0, 0, 'forward', 0, 1), _event(0, 1, 'forward', 1, 2),
              _event(1, 0, 'forward', 1.5, 3.5), _event(1, 1, 'forward', 3.5, 5.5),
              _event(1, 1, 'recompute', 5.5, 6.5), _event(1, 1, 'backward', 6.5, 8.5),
              _event(1, 0, 'recompute', 8.5, 9.5), _event(1, 0, 'backward', 9.5, 11.5),
              _event(0, 1, 'backward', 8.5, 10.5), _event(0, 0, 'backward', 11.75, 13.75)]
    line = timeline.Timeline(events, [CPU + '0', CPU + '1'], 2)
    assert line.span == 13.75
    assert line.bubble()['overall'] == pytest.approx(1 - 16 / 27.5)
    assert line.theoretical_bubble() == pytest.approx(1 / 3)
    assert line.phase_costs() == {(0, 'backward'): 2, (0, 'forward'): 1, (1, 'backward'): 2,
                                  (1, 'forward'): 2, (1, 'recompute'): 1}
    # Without the late starts: d1 F0 1-3, F1 3-5, B1 5-8, B0 8-11; d0 B1 8-10, B0 11-13.
    assert line.modelled_bubble() == pytest.approx(1 - 16 / 26)
    latency = line.latency()
    assert latency[CPU + '0'] == pytest.approx(0.25 / 13.75)
    assert latency[CPU + '1'] == pytest.approx(0.5 / 13.75)
    assert latency['overall'] == pytest.approx(0.375 / 13.75)


@pytest.mark.parametrize('name, devices, m, v', [
    ('fill_drain', 3, 4, 1), ('1f1b', 3, 4, 1), ('interleaved_1f1b', 2, 4, 2),
    ('zb_h1', 2, 4, 1), ('zb_h2', 3, 6, 1)])
def test_unit_theory_is_the_schedules_idle_fraction(name, devices, m, v):
    """A timeline whose tasks take one tick each, at the schedule's own ticks: theory,
    measurement and the measured-cost model agree, with no latency."""
    ticks = SCHEDULE_BUILDERS[name](devices, m, v)
    events = [_event(task.cell, task.micro_batch, task.phase, t, t + 1, devices)
              for t, tick in enumerate(ticks) for task in tick]
    line = timeline.Timeline(events, [CPU + str(d) for d in range(devices)], m)
    idle = schedule.idle_slots(ticks, devices) / (len(ticks) * devices)
    assert line.num_devices == devices and line.num_cells == devices * v
    assert line.theoretical_bubble() == pytest.approx(idle)
    assert line.bubble()['overall'] == pytest.approx(idle)
    assert line.modelled_bubble() == pytest.approx(idle)
    assert line.latency()['overall'] == 0


SCHEDULE_BUILDERS = {
    'fill_drain': lambda k, m, v: schedule.fill_drain(k, m),
    '1f1b': lambda k, m, v: schedule.one_f_one_b(k, m),
    'interleaved_1f1b': schedule.interleaved_one_f_one_b,
    'zb_h1': lambda k, m, v: schedule.zb_h1(k, m),
    'zb_h2': lambda k, m, v: schedule.zb_h2(k, m),
}


def test_stamps_of_another_step_are_rejected(recorded):
    recorder = recorder_lib.Recorder()
    with pytest.raises(ValueError, match='recorder.stamps'):
        timeline.Timeline.from_stamps(recorder, np.zeros([4, 2]))


def test_trainer_writes_the_timeline_of_the_requested_step(tmp_path, data_dir):
    logdir = str(tmp_path / 'run')
    result = th.run(th.FAST, logdir, data_dir, *th.fast_flags(2, 2),
                    '--pipeline_trace_step=2')
    assert result.returncode == 0, result.stderr[-3000:]
    assert 'step 2: pipeline bubble measured' in result.stderr
    train_dir = os.path.join(logdir, 'train')
    assert sorted(f for f in os.listdir(train_dir) if f.startswith('pipeline_trace')) == \
        ['pipeline_trace-2.json', 'pipeline_trace-2.png']
    with open(os.path.join(train_dir, 'pipeline_trace-2.json')) as f:
        trace = json.load(f)
    assert trace['otherData']['step'] == 2
    tags = set()
    for name in os.listdir(train_dir):
        if name.startswith('events.out'):
            for event in tf.compat.v1.train.summary_iterator(os.path.join(train_dir, name)):
                tags |= {v.tag for v in event.summary.value if event.step == 2}
    assert {'pipeline/bubble_measured', 'pipeline/bubble_theoretical',
            'pipeline/bubble_modelled', 'pipeline/latency'} <= tags


@pytest.mark.parametrize('step', ['0', '3'])
def test_trainer_rejects_a_trace_step_outside_the_run(tmp_path, data_dir, step):
    logdir = str(tmp_path / 'run')
    result = th.run(th.FAST, logdir, data_dir, '--job=trainer', '--max_steps=2',
                    f'--pipeline_trace_step={step}')
    assert result.returncode == 2, result.stderr[-3000:]
    assert '--pipeline_trace_step' in th.error_line(result)
    assert not os.path.exists(logdir)
