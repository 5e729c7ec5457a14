"""Steps/s and ETA of a training run, as the trainer's progress reports give them."""
from __future__ import annotations

from typing import Optional


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
