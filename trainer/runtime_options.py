"""The training loop's runtime knobs (gin `trainer.*`): what is not part of the model.

Set by flags (--max_steps, --pipeline_trace_step) and gin bindings. Those that stand for
a task.train value (TASK_TRAIN_OPTIONS) are written into the params before training
(`apply_to`), so train/params.txt records what the trainer ran; the others, except the
per-client ones (PER_CLIENT_OPTIONS), go into the trainer clients' start-up fingerprint
(`loop_settings`).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import gin

from tfpipe.hyperparams import Params


@gin.configurable('trainer')
@dataclasses.dataclass
class RuntimeOptions:
    """Knobs of the training loop that are not part of the model (gin: `trainer.*`).

    None means "take the model's task.train value".
    """
    max_steps: Optional[int] = None
    save_interval_steps: Optional[int] = None
    summary_interval_steps: Optional[int] = None
    save_max_to_keep: Optional[int] = None
    eval_poll_max_seconds: float = 30.0
    eval_idle_timeout_seconds: Optional[float] = None  # None: evalers wait for the last step
    pipeline_trace_step: Optional[int] = None  # record the timeline of this step (1 = first)
    # Across processes: how long a step (or a save) may go without finishing before the
    # trainer gives up on a worker that accepts connections but does not answer. None:
    # derived from the measured steps (Trainer.step_timeout).
    step_timeout_seconds: Optional[float] = None
    # FLOP/s of the devices one trainer process steps on, the denominator of MFU. None:
    # measured once per machine and cached (tfpipe/tuning/peak_flops.py).
    peak_flops: Optional[float] = None
    # True: saves run beside the next steps from a host copy of the state
    # (tfpipe/checkpoint_writer.py). Off by default: the copy adds the whole state to the
    # host's peak (GPT-2 small: 1,587 -> 2,565 MiB predicted), which inspect_model prints,
    # so users opt in where memory allows; False: training waits for each save.
    async_checkpoints: bool = False

    def __post_init__(self):
        for name in (*TASK_TRAIN_OPTIONS, 'pipeline_trace_step'):
            check_positive_int(f'trainer.{name}', getattr(self, name), allow_none=True)
        for name in ('eval_poll_max_seconds', 'eval_idle_timeout_seconds',
                     'step_timeout_seconds', 'peak_flops'):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or
                                      not isinstance(value, (int, float)) or value <= 0):
                unit = 'FLOP/s, e.g. 312e12' if name == 'peak_flops' else 'seconds'
                raise ValueError(f'trainer.{name}={value!r} must be a positive number of {unit}')

    def apply_to(self, params: Params) -> None:
        """Sets the task.train values these options stand for (e.g. max_steps) in `params`.

        What the trainer runs is what it records: train/params.txt, which an evaler or
        decoder on the logdir reads for the step to stop at, and the trainer clients'
        start-up fingerprint then hold these values, not the model's defaults.
        """
        for name in TASK_TRAIN_OPTIONS:
            if getattr(self, name) is not None:
                params.task.train.Set(**{name: getattr(self, name)})

    def loop_settings(self) -> dict[str, str]:
        """Every other option as 'trainer.<name>': its text, for the clients' fingerprint.

        All fields but the per-client ones, not a chosen few: a trace step or any option
        added later may decide which collectives a step runs, and clients that differ in
        one deadlock.
        """
        return {f'trainer.{field.name}': repr(getattr(self, field.name))
                for field in dataclasses.fields(self)
                if field.name not in TASK_TRAIN_OPTIONS + PER_CLIENT_OPTIONS}


# The options that stand for the task.train value of the same name (RuntimeOptions.apply_to).
TASK_TRAIN_OPTIONS = ('max_steps', 'save_interval_steps', 'summary_interval_steps',
                      'save_max_to_keep')


# Options each client may set for itself: they change what a client reports, never what a
# step computes (peak_flops is the MFU denominator of the client's own hardware).
PER_CLIENT_OPTIONS = ('peak_flops',)


def check_positive_int(name: str, value, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f'{name}={value!r} must be an int >= 1')
