"""The trainer's progress line and the TensorBoard scalars written with it.

One line per summary step: the step, the loss and, apart from it, the auxiliary
losses the body's layers add to the training loss (`aux_loss`, their weighted sum,
and each loss by name; tfpipe/pipeline/aux_losses.py) with the layers' scalar
statistics (an MoE's `dropped_fraction`), averaged over layers, then the learning
rate, the gradient norm, each device's peak memory, the rate, throughput and ETA.
The same values go to TensorBoard under the same names, and beside them each
layer's own ('<name>/<layer path>': a scalar, or a histogram for a vector such as
an MoE's `expert_load`, its share of the choices per expert).
"""
from __future__ import annotations

import time
from typing import Any

import numpy as np
import tensorflow as tf
from absl import logging

from tfpipe import memory_stats
from trainer.throughput import Progress, Throughput


def report(writer, progress: Progress, throughput: Throughput, step: int, max_steps: int,
           batch_size: int, losses: dict[str, Any], norm: float, lr: float) -> None:
    """losses: 'loss' (the main loss) first, then the auxiliary losses' metrics and
    per-layer records (AuxLossSink.metrics and .statistics: none for a body without
    such a layer); the names with a '/' (per layer) go to TensorBoard only."""
    steps_per_sec, eta = progress.rate_and_eta(step, time.time())
    line = {name: float(value) for name, value in losses.items() if '/' not in name}
    with writer.as_default(step=step):
        for name, value in losses.items():
            if np.ndim(value):
                tf.summary.histogram(name, value)
            else:
                tf.summary.scalar(name, float(value))
        tf.summary.scalar('learning_rate', lr)
        tf.summary.scalar('grad_norm', norm)
        if steps_per_sec is not None:
            tf.summary.scalar('steps_per_sec', steps_per_sec)
            tf.summary.scalar('examples_per_sec', steps_per_sec * batch_size)
            for name, value in throughput.scalars(steps_per_sec).items():
                if name != 'examples_per_sec':
                    tf.summary.scalar(name, value)
        peaks = memory_stats.peak_bytes(d.name for d in tf.config.list_logical_devices())
        for device, peak in peaks.items():
            tf.summary.scalar(f'peak_bytes/{device}', peak)
    head = '  '.join(part for part in (
        f'step {step}/{max_steps}', '  '.join(f'{n} {v:.4f}' for n, v in line.items()),
        f'lr {lr:.3g}  grad_norm {norm:.3g}', memory_stats.format_peaks(peaks)) if part)
    if steps_per_sec is None:
        logging.info('%s  first step %.1fs (includes tracing; rate and ETA from the next '
                     'steps)', head, progress.first_step_seconds)
    else:
        logging.info('%s  %.2f steps/s  %s  ETA %dm%02ds', head, steps_per_sec,
                     throughput.line(steps_per_sec), eta // 60, eta % 60)
