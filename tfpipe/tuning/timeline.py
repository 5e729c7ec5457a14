"""Measured timeline of a pipelined step: what each device did, and when.

The schedule says in which order each device *should* run its tasks; only a
measurement says how long they took and how much each device idled (the
bubble). The executor stamps each task's start and end into the step itself
(`tfpipe.pipeline.recorder`); everything here is plain Python on the stamps
the step returns.

    with pipe.RecordTimeline() as recorder:           # inside the tf.function
        loss, grads = pipe.ForwardBackward(...)
    return loss, recorder.stamps()
    ...
    tl = timeline.Timeline.from_stamps(recorder, stamps.numpy())
    tl.write('/tmp/logdir/train', step=S)  # pipeline_trace-S.json and .png
"""
from __future__ import annotations

import dataclasses
import json
import os
from fractions import Fraction
from typing import Optional, Sequence

import numpy as np
import tensorflow as tf

from tfpipe.pipeline import schedule
from tfpipe.pipeline.recorder import Label, Recorder
from tfpipe.pipeline.schedule import RECOMPUTE
from tfpipe.tuning import simulator

PHASES = (schedule.FORWARD, RECOMPUTE, schedule.BACKWARD)


@dataclasses.dataclass(frozen=True)
class Event:
    label: Label
    start: float  # seconds, relative to the timeline's origin
    end: float
    replica: int = 0  # data-parallel replica: its pipeline's tasks depend on each other only
    # Position in the recorder's labels: the order the tasks were built in, which is each
    # device's execution order (the executor chains a device's tasks in build order).
    # Start stamps can tie or swap by a microsecond; the build order cannot.
    built: int = 0

    @property
    def duration(self) -> float:
        return self.end - self.start


class Timeline:
    """The measured events of one step, with its bubble and its two file forms.

    `devices` lists each device once, replica by replica in cell order; with
    virtual stages a device runs several cells, so `num_cells` can exceed the
    number of devices.
    """

    def __init__(self, events: Sequence[Event], devices: Sequence[str], num_micro_batches: int,
                 origin: float = 0.0):
        self.events = sorted(events, key=lambda e: (e.start, e.label.cell))
        self.devices = list(dict.fromkeys(devices))
        self.num_cells = 1 + max(e.label.cell for e in self.events)
        self.num_micro_batches = num_micro_batches
        self.origin = origin  # seconds since the epoch of time 0

    @classmethod
    def from_stamps(cls, recorder: Recorder, stamps: np.ndarray) -> 'Timeline':
        """The timeline of one run of a step built under `recorder`, from the value of
        its `recorder.stamps()`."""
        stamps = np.asarray(stamps, dtype=np.float64)
        if stamps.shape != (len(recorder.labels), 2):
            raise ValueError(f'stamps have shape {stamps.shape} but the recorder labelled '
                             f'{len(recorder.labels)} events: pass the recorder.stamps() '
                             'value of the same step')
        origin = float(stamps[:, 0].min())
        # Replicas are built one after another, so the n-th event of a (cell, micro-batch,
        # phase) belongs to replica n.
        seen: dict[tuple[int, int, str], int] = {}
        events = []
        for built, (label, (s, e)) in enumerate(zip(recorder.labels, stamps)):
            key = (label.cell, label.micro_batch, label.phase)
            seen[key] = seen.get(key, -1) + 1
            events.append(Event(label, float(s - origin), float(e - origin), seen[key], built))
        devices = sorted({(e.replica, e.label.cell, e.label.device) for e in events})
        num_micro_batches = 1 + max(label.micro_batch for label in recorder.labels)
        return cls(events, [d for _, _, d in devices], num_micro_batches, origin)

    @property
    def span(self) -> float:
        """Seconds from the first start to the last end: the pipeline's part of the step."""
        return max(e.end for e in self.events) - min(e.start for e in self.events)

    def busy(self, device: str) -> float:
        return sum(e.duration for e in self.events if e.label.device == device)

    def bubble(self) -> dict[str, float]:
        """Idle fraction of each device over the span, and 'overall' (their mean)."""
        span = self.span
        fractions = {d: 1.0 - self.busy(d) / span if span > 0 else 0.0 for d in self.devices}
        fractions['overall'] = float(np.mean(list(fractions.values())))
        return fractions

    # -- What the bubble should be -------------------------------------------------------

    def theoretical_bubble(self) -> float:
        """The bubble of the schedule that ran, on unit costs (every F, B and W one tick,
        recompute free, no time between tasks): (K-1)/(M+K-1) for fill-drain and 1F1B,
        (K-1)/(vM+K-1) interleaved, K being devices, not cells. The schedule is read
        back from the order each device ran its tasks in."""
        unit = {phase: Fraction(1) for phase in (schedule.FORWARD, schedule.BACKWARD,
                                                 schedule.BACKWARD_INPUT,
                                                 schedule.BACKWARD_WEIGHT)}
        return self._replay([simulator.CellCosts(time=dict(unit))
                             for _ in range(self.num_cells)])

    def phase_costs(self) -> dict[tuple[int, str], float]:
        """Median seconds of each (cell, phase) over micro-batches and replicas."""
        durations: dict[tuple[int, str], list[float]] = {}
        for e in self.events:
            durations.setdefault((e.label.cell, e.label.phase), []).append(e.duration)
        return {key: float(np.median(v)) for key, v in sorted(durations.items())}

    def modelled_bubble(self) -> float:
        """The bubble the same schedule would have if every task took its (cell, phase)'s
        median measured time and nothing took time between tasks (devices independent,
        transfers free): the theory for unequal forward, recompute and backward costs
        and unbalanced cells. The measured bubble exceeds it by the time devices spend
        between tasks (see `latency`) and by tasks that run slower than their median."""
        return self._replay(simulator.costs_from_measurements(self.phase_costs(),
                                                              self.num_cells))

    def latency(self) -> dict[str, float]:
        """Per device, the fraction of the span spent after a task could start (its
        device free, every task it depends on ended) and before it did: per-task fixed
        costs such as dispatch, the copy of its input onto the device and the stamps
        themselves, which no schedule theory counts. 'overall' is the mean. The rest of
        a device's idle time is spent waiting for other devices."""
        span = self.span
        device_of = {(e.replica, e.label.cell): e.label.device for e in self.events}
        waits = {d: 0.0 for d in self.devices}
        for replica, orders in self._orders().items():
            ends = {task: end for order in orders for task, _, end in order}
            for order in orders:
                free = 0.0
                for task, start, end in order:
                    deps = [ends[dep] for dep in schedule.dependencies(task, self.num_cells)]
                    waits[device_of[(replica, task.cell)]] += max(0.0, start - max([free] + deps))
                    free = end
        fractions = {d: w / span if span > 0 else 0.0 for d, w in waits.items()}
        fractions['overall'] = float(np.mean(list(fractions.values())))
        return fractions

    def _orders(self) -> dict[int, list[list[tuple[schedule.Task, float, float]]]]:
        """Per replica, per device (indexed by the device's first cell): the schedule's
        tasks in the order they ran, as (task, start, end). A recompute event is part of
        the backward task that follows it on its device."""
        by_device: dict[tuple[int, str], list[Event]] = {}
        for e in sorted(self.events, key=lambda e: (e.built, e.start)):
            by_device.setdefault((e.replica, e.label.device), []).append(e)
        orders: dict[int, dict[int, list]] = {}
        for (replica, _), events in by_device.items():
            order, pending = [], None
            for e in events:
                if e.label.phase == RECOMPUTE:
                    pending = e
                    continue
                start = pending.start if pending is not None else e.start
                pending = None
                order.append((schedule.Task(e.label.cell, e.label.micro_batch, e.label.phase),
                              start, e.end))
            orders.setdefault(replica, {})[min(t.cell for t, _, _ in order)] = order
        result = {}
        for replica, by_first_cell in orders.items():
            num_devices = len(by_first_cell)
            if sorted(by_first_cell) != list(range(num_devices)) or any(
                    t.cell % num_devices != d for d, o in by_first_cell.items() for t, _, _ in o):
                raise ValueError(f'replica {replica}: cells are not on devices cell mod '
                                 f'{num_devices}, the executor\'s layout; cannot replay')
            result[replica] = [by_first_cell[d] for d in range(num_devices)]
        return result

    def _replay(self, costs: list) -> float:
        """Bubble of replica 0's device orders played by the simulator with `costs`."""
        orders = self._orders()[0]
        ticks = schedule.simulate([[t for t, _, _ in o] for o in orders], self.num_cells)
        return float(simulator.simulate(ticks, costs, num_devices=len(orders)).bubble)

    def chrome_trace(self, step: Optional[int] = None) -> dict:
        """Chrome trace event format: one thread (track) per device, named by it;
        complete events ('ph': 'X') with ts/dur in microseconds."""
        track = {d: i for i, d in enumerate(self.devices)}
        name = 'tfpipe pipeline' + ('' if step is None else f' step {step}')
        meta = [{'name': 'process_name', 'ph': 'M', 'pid': 0, 'tid': 0, 'args': {'name': name}}]
        for device, tid in track.items():
            meta.append({'name': 'thread_name', 'ph': 'M', 'pid': 0, 'tid': tid,
                         'args': {'name': device}})
            meta.append({'name': 'thread_sort_index', 'ph': 'M', 'pid': 0, 'tid': tid,
                         'args': {'sort_index': tid}})
        events = [{'name': f'{e.label.phase[0].upper()}{e.label.micro_batch}',
                   'cat': e.label.phase, 'ph': 'X', 'pid': 0, 'tid': track[e.label.device],
                   'ts': round(e.start * 1e6, 3), 'dur': round(e.duration * 1e6, 3),
                   'args': {'cell': e.label.cell, 'micro_batch': e.label.micro_batch,
                            'phase': e.label.phase}}
                  for e in self.events]
        bubble = self.bubble()
        return {'traceEvents': meta + events, 'displayTimeUnit': 'ms',
                'otherData': {'step': step, 'origin_unix_seconds': self.origin,
                              'num_cells': self.num_cells,
                              'num_micro_batches': self.num_micro_batches,
                              'bubble_measured': bubble,
                              'bubble_theoretical': self.theoretical_bubble(),
                              'bubble_modelled': self.modelled_bubble(),
                              'latency': self.latency()}}

    def summary(self) -> str:
        """One line: measured bubble per device and overall, beside the theory."""
        bubble = self.bubble()
        per_device = '  '.join(f'{_short(d)} {bubble[d]:.3f}' for d in self.devices)
        cells = (f', {self.num_cells} cells' if self.num_cells > self.num_devices else '')
        return (f'pipeline bubble measured {bubble["overall"]:.3f} vs '
                f'{self.theoretical_bubble():.3f} on unit costs and '
                f'{self.modelled_bubble():.3f} on the measured per-phase costs; latency '
                f'{self.latency()["overall"]:.3f} (K={self.num_devices}{cells}, '
                f'M={self.num_micro_batches}, span {self.span * 1e3:.1f} ms; per device: '
                f'{per_device})')

    @property
    def num_devices(self) -> int:
        """Devices of one replica (K of the bubble formulas)."""
        return len({e.label.device for e in self.events if e.replica == 0})

    def write(self, directory: str, step: int) -> tuple[str, str]:
        """Writes pipeline_trace-<step>.json and .png into `directory`; returns both paths."""
        from tfpipe.tuning import gantt  # Pillow is only needed for the picture
        base = os.path.join(directory, f'pipeline_trace-{step}')
        with tf.io.gfile.GFile(base + '.json', 'w') as f:
            json.dump(self.chrome_trace(step), f)
        gantt.write_png(self, base + '.png', title=self.summary().split(' (K=')[0] +
                        f' at step {step}')
        return base + '.json', base + '.png'

    def write_summaries(self, step: int) -> None:
        """The bubble figures as TensorBoard scalars (under the default writer)."""
        bubble = self.bubble()
        tf.summary.scalar('pipeline/bubble_measured', bubble['overall'], step=step)
        tf.summary.scalar('pipeline/bubble_theoretical', self.theoretical_bubble(), step=step)
        tf.summary.scalar('pipeline/bubble_modelled', self.modelled_bubble(), step=step)
        tf.summary.scalar('pipeline/latency', self.latency()['overall'], step=step)
        tf.summary.scalar('pipeline/span_ms', self.span * 1e3, step=step)
        for device in self.devices:
            tf.summary.scalar(f'pipeline/bubble/{_short(device).replace(":", "_")}',
                              bubble[device], step=step)


def _short(device: str) -> str:
    """'/job:localhost/replica:0/task:0/device:CPU:3' -> 'CPU:3' (task kept if not 0)."""
    spec = tf.DeviceSpec.from_string(device)
    name = f'{spec.device_type}:{spec.device_index}'
    return name if not spec.task else f'task:{spec.task}/{name}'
