"""Evaler and decoder jobs: they poll the train dir and never talk to the trainer.

Each job waits (with backoff) for a new complete checkpoint, restores the
model's variables from it, runs on its split, writes its results and records
the checkpoint as processed, so a restarted job does not redo work. It stops
after the checkpoint of the final step. Like Lingvo, a job that falls behind
processes the newest checkpoint and skips older ones.
"""
from __future__ import annotations

import json
import os
import time
from typing import Callable, Optional

import numpy as np
import tensorflow as tf
from absl import logging

from tfpipe import checkpoints, export, fprop_context
from tfpipe.hyperparams import Params
from trainer import logdir_access

PROCESSED_FILE = 'processed.txt'
NUM_EXAMPLES = 'num_examples'  # the line of score-<step>.txt saying how many examples were seen


class _PollingJob:
    """Shared loop: find the newest unprocessed checkpoint, process it, record it."""

    kind = ''  # names the output dir: <kind>_<split>
    job_prefix = ''  # names the job: <job_prefix>_<split>

    def __init__(self, params: Params, split: str, logdir: str, max_steps: int,
                 poll_max_seconds: float = 30.0, idle_timeout_seconds: Optional[float] = None,
                 should_stop: Callable[[], bool] = lambda: False):
        defined = [s for s, v in params.input.IterParams() if v is not None]
        if split not in defined:
            raise ValueError(f'the model defines no input for split {split!r}: use one of '
                             f'{defined} (e.g. --job={self.job_prefix}_{defined[0]})')
        self.split = split
        self.train_dir = os.path.join(logdir, 'train')
        self.job_dir = os.path.join(logdir, f'{self.kind}_{split}')
        self.max_steps = max_steps
        self.poll_max_seconds = poll_max_seconds
        self.idle_timeout_seconds = idle_timeout_seconds
        self.should_stop = should_stop
        self.input_params = params.input.Get(split)
        self.input_params.Instantiate()  # fails now, not at the first checkpoint, on bad data
        self.task = params.task.Instantiate()
        self.task.CheckInput(self.input_params)
        self.checkpoint = checkpoints.make(self.task.VariablesByPath())
        path = checkpoints.latest(self.train_dir) if os.path.isdir(self.train_dir) else None
        if path is not None:  # fails now, before anything is written, on a bad checkpoint
            checkpoints.check_readable(path)
            checkpoints.check_matches(self.checkpoint, path, partial=True)

    def _processed(self) -> set[int]:
        path = os.path.join(self.job_dir, PROCESSED_FILE)
        if not os.path.exists(path):
            return set()
        with open(path) as f:
            return {int(line) for line in f if line.strip()}

    def _mark_processed(self, step: int) -> None:
        with open(os.path.join(self.job_dir, PROCESSED_FILE), 'a') as f:
            f.write(f'{step}\n')

    def run(self) -> None:
        """Processes new checkpoints until the one of max_steps (or idle timeout / stop)."""
        os.makedirs(self.job_dir, exist_ok=True)
        writer = tf.summary.create_file_writer(self.job_dir)
        wait, idle_since = 1.0, time.time()
        waiting_logged = False
        while True:
            path = checkpoints.latest(self.train_dir) if os.path.isdir(self.train_dir) else None
            step = checkpoints.step_of(path) if path is not None else -1
            if path is not None and step not in self._processed():
                try:
                    checkpoints.restore(self.checkpoint, path, partial=True)
                except tf.errors.NotFoundError:
                    continue  # rotated out by the trainer meanwhile: look again
                self.process(step, writer)
                self._mark_processed(step)
                wait, idle_since, waiting_logged = 1.0, time.time(), False
                if step >= self.max_steps:
                    return
                continue
            if step >= self.max_steps or self.should_stop():
                return
            if self.idle_timeout_seconds and time.time() - idle_since > self.idle_timeout_seconds:
                logging.info('%s_%s: no new checkpoint for %.0fs, stopping', self.kind,
                             self.split, self.idle_timeout_seconds)
                return
            if not waiting_logged:  # a job that sits silent looks hung
                logging.info('%s_%s: waiting for %s in %s (looking every %.0fs at most; it '
                             'stops after the checkpoint of step %d)', self.kind, self.split,
                             'a checkpoint' if path is None else f'a checkpoint newer than '
                             f'step {step}', self.train_dir, self.poll_max_seconds,
                             self.max_steps)
                waiting_logged = True
            deadline = time.time() + wait
            while time.time() < deadline and not self.should_stop():
                time.sleep(0.1)
            wait = min(2 * wait, self.poll_max_seconds)

    def _batches(self, num_examples: int):
        """Each of the first num_examples examples once; padding has weight 0."""
        return self.input_params.Instantiate().EvalDataset(num_examples)

    def process(self, step: int, writer) -> None:
        raise NotImplementedError


class Evaler(_PollingJob):
    """Weighted-mean metrics over eval.samples_per_summary examples -> score-<step>.txt.

    Exactly that many examples (or the whole split if smaller): the last batch is
    padded to the static batch size and its padding has weight 0 in every metric.
    """

    kind = 'eval'
    job_prefix = 'evaler'

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        task = self.task

        @tf.function(autograph=False)  # as the training step: see docs/own_models_and_data.md
        def metrics(batch):
            aux = fprop_context.AuxLossSink()  # reported apart, never added to 'loss'
            with fprop_context.evaluation(), fprop_context.scope(aux_losses=aux):
                out = task.ComputeLoss(task.theta, task.ComputePredictions(task.theta, batch),
                                       batch)
            weight = tf.reduce_sum(task.ExampleWeights(batch))
            return {**out, **{name: (v, weight) for name, v in aux.metrics().items()}}
        self._metrics = metrics

    def process(self, step, writer):
        sums, weights, num_examples = {}, {}, 0
        for batch in self._batches(self.task.params.eval.samples_per_summary):
            for name, (value, weight) in self._metrics(batch).items():
                sums[name] = sums.get(name, 0.0) + float(value) * float(weight)
                weights[name] = weights.get(name, 0.0) + float(weight)
            num_examples += int(np.count_nonzero(batch['weight'].numpy()))
        scores = self.task.FinalizeMetrics({n: sums[n] / max(weights[n], 1e-12) for n in sums})
        _write_scores(self.job_dir, step, scores, num_examples, writer)
        logging.info('eval_%s step %d: %s (%d examples)', self.split, step, _format(scores),
                     num_examples)


class Decoder(_PollingJob):
    """Decodes eval.decoder_samples_per_summary examples -> decoder_out-<step>.jsonl."""

    kind = 'decoder'
    job_prefix = 'decoder'

    def __init__(self, params: Params, *args, **kwargs):
        params = params.Copy()
        params.task = export.decoding_task_params(params.task)
        super().__init__(params, *args, **kwargs)
        task = self.task

        @tf.function(autograph=False)
        def decode(batch):
            with fprop_context.evaluation():
                return task.Decode(task.theta, batch)
        self._decode = decode

    def process(self, step, writer):
        records = []
        for batch in self._batches(self.task.params.eval.decoder_samples_per_summary):
            real = batch['weight'].numpy() > 0  # Decode's outputs have one row per example
            out = {k: v.numpy()[real] for k, v in self._decode(batch).items()}
            records += self.task.PostProcessDecodeOut(out)
        out_path = os.path.join(self.job_dir, f'decoder_out-{step}.jsonl')
        logdir_access.write_file(out_path, ''.join(json.dumps(r) + '\n' for r in records))
        scores = self.task.DecodeMetrics(records)
        _write_scores(self.job_dir, step, scores, len(records), writer)
        logging.info('decoder_%s step %d: %s (%d examples)', self.split, step, _format(scores),
                     len(records))


def _format(scores: dict) -> str:
    return '  '.join(f'{k} {v:.4f}' for k, v in sorted(scores.items()))


def _write_scores(job_dir: str, step: int, scores: dict, num_examples: int, writer) -> None:
    """score-<step>.txt: one 'name: value' line per metric, then 'num_examples: N'."""
    path = os.path.join(job_dir, f'score-{step}.txt')
    logdir_access.write_file(path, ''.join(
        f'{name}: {float(np.asarray(value)):.6f}\n' for name, value in sorted(scores.items()))
        + f'{NUM_EXAMPLES}: {num_examples}\n')
    with writer.as_default(step=step):
        for name, value in scores.items():
            tf.summary.scalar(name, float(value))
        tf.summary.scalar(NUM_EXAMPLES, num_examples)
    writer.flush()
