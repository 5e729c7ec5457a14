"""How fast a run goes, in the units people compare: steps/s, examples or tokens/s, MFU.

'0.9 examples/s' tells nobody whether a step is good. Model FLOPs utilisation
(tfpipe/tuning/flops.py: PaLM's definition, recompute not counted) over the
machine's peak (tfpipe/tuning/peak_flops.py: measured once per machine and
cached, or trainer.peak_flops) does, and hardware FLOPs utilisation (recompute
counted) beside it says how much of the gap recompute takes.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

from absl import logging

from tfpipe.tuning import flops, peak_flops


class Progress:
    """Steps/s and ETA of one run, measured without the run's first step.

    The first step traces and compiles the step function: seconds here, minutes
    on big models. Counting it would make the first reports' rate too low and
    their ETA too long by that much, so rates start at the end of the first step.
    """

    def __init__(self, max_steps: int, start_time: float):
        self.max_steps = max_steps
        self.first_step_seconds: Optional[float] = None
        self._start = start_time
        self._mark: Optional[tuple[int, float]] = None  # rates are measured from here

    def step_done(self, step: int, now: float) -> None:
        if self._mark is None:
            self._mark = (step, now)
            self.first_step_seconds = now - self._start

    def rate_and_eta(self, step: int, now: float) -> tuple[Optional[float], Optional[float]]:
        """Steps/s since the last report (or the first step) and the seconds left at that rate.

        (None, None) when only the first step has run.
        """
        mark_step, mark_time = self._mark
        if step == mark_step:
            return None, None
        rate = (step - mark_step) / max(now - mark_time, 1e-9)
        self._mark = (step, now)
        return rate, (self.max_steps - step) / rate


@dataclasses.dataclass
class Throughput:
    """What one step processes and costs, to turn steps/s into the figures people compare.

    unit: 'examples', or 'tokens' for a language model; per_step: that many per
    step of this process; step_flops: None where a layer cannot say its FLOPs;
    peak: the FLOP/s of the devices this process steps on, None if unknown;
    record: called with a higher peak this run proved (`scalars`), to cache it.
    """

    unit: str
    per_step: int
    step_flops: Optional[flops.StepFlops]
    peak: Optional[float]
    record: Optional[Callable[[float], None]] = None

    def scalars(self, steps_per_sec: float) -> dict[str, float]:
        """The summaries of one report: <unit>_per_sec, and mfu and hfu when known.

        A run whose hardware FLOPs come faster than the peak proves the peak low (a probe
        on a busy host reads low, and is probed again only on a much quieter one): it
        showed MFU 114% and HFU 152% here. The run's rate then becomes the peak, with one
        warning, so HFU never passes 100%, and `record` caches it for the next runs.
        """
        out = {f'{self.unit}_per_sec': steps_per_sec * self.per_step}
        if self.step_flops is not None and self.peak:
            achieved = self.step_flops.hardware * steps_per_sec
            if achieved > self.peak:
                logging.warning('this run computes %.4g FLOP/s (hardware FLOPs, recompute '
                                'counted), above the peak of %.4g FLOP/s its MFU was over: '
                                'the peak is taken as %.4g from now on (give '
                                'trainer.peak_flops=F for a known figure)', achieved,
                                self.peak, achieved)
                self.peak = achieved
                if self.record is not None:
                    self.record(achieved)
            out['mfu'] = flops.utilisation(self.step_flops.model, steps_per_sec, self.peak)
            out['hfu'] = flops.utilisation(self.step_flops.hardware, steps_per_sec, self.peak)
        return out

    def line(self, steps_per_sec: float) -> str:
        """'3.1 examples/s' or '512 tokens/s  MFU 41.2%  HFU 54.9%' for a progress line."""
        values = self.scalars(steps_per_sec)
        rate = values[f'{self.unit}_per_sec']
        text = f'{rate:.1f} {self.unit}/s' if rate < 100 else f'{rate:.0f} {self.unit}/s'
        if 'mfu' in values:
            text += f'  MFU {100 * values["mfu"]:.1f}%  HFU {100 * values["hfu"]:.1f}%'
        return text


def measure_for(pipe: Any, pipeline_inputs: Any, unit: str, per_step: int,
                peak: Optional[float], device_type: str, devices_used: int) -> Throughput:
    """The Throughput of a run whose step feeds `pipeline_inputs` to `pipe`.

    `peak` (FLOP/s, trainer.peak_flops) wins; else one device's cached or measured peak
    times the devices this process steps on (a CPU host counts once, however many
    logical CPUs it is split into). Logs once where the peak came from, so a
    reader of the MFU knows its denominator.
    """
    try:
        step = flops.step_flops(pipe.params.body, pipe.balance, pipe.params.recompute,
                                flops.input_shapes(pipeline_inputs))
    except NotImplementedError as e:
        logging.info('no MFU in the progress lines: %s', e)
        return Throughput(unit, per_step, None, None)
    record = None
    if peak:
        logging.info('MFU over trainer.peak_flops=%.4g FLOP/s', peak)
    else:
        probed = peak_flops.cached_peak(device_type)
        per_device = 1 if device_type == 'CPU' else devices_used
        peak = probed.flops * per_device

        def record(flops_per_sec: float) -> None:
            peak_flops.raise_cached(flops_per_sec / per_device, device_type)
        logging.info('MFU over a peak of %.4g FLOP/s: %s matmul probe of %s, %s at a load of '
                     '%.2f per core (cache: %s; trainer.peak_flops=F gives a known figure)',
                     peak, device_type, 'the host' if device_type == 'CPU'
                     else f'one device times {devices_used}',
                     'measured now' if probed.measured_now else 'cached', probed.load,
                     peak_flops.cache_path())
    logging.info('one step: %.4g model FLOPs, %.4g hardware FLOPs (recompute %r)',
                 step.model, step.hardware, pipe.params.recompute)
    return Throughput(unit, per_step, step, peak, record)
