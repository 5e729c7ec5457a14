"""Evaler and decoder jobs: they poll the train dir and never talk to the trainer.

Each job waits (with backoff) for a new complete checkpoint, restores the
model's variables from it, runs on its split, writes its results and records
the checkpoint as processed, so a restarted job does not redo work. It stops
after the checkpoint of the final step. Like Lingvo, a job that falls behind
processes the newest checkpoint and skips older ones.
"""
from __future__ import annotations

import json
import math
import os
import time
from typing import Callable

import numpy as np
import tensorflow as tf
from absl import logging

from tfpipe import checkpoints, fprop_context
from tfpipe.hyperparams import Params

PROCESSED_FILE = 'processed.txt'


class _PollingJob:
    """Shared loop: find the newest unprocessed checkpoint, process it, record it."""

    kind = ''

    def __init__(self, params: Params, split: str, logdir: str, max_steps: int,
                 poll_max_seconds: float = 30.0, should_stop: Callable[[], bool] = lambda: False):
        input_params = getattr(params.input, split, None) if split in params.input else None
        if input_params is None:
            raise ValueError(f'the model defines no input for split {split!r}: use one of '
                             f'{[s for s, v in params.input.IterParams() if v is not None]} '
                             f'(e.g. --job={self.kind}_dev)')
        self.split = split
        self.train_dir = os.path.join(logdir, 'train')
        self.job_dir = os.path.join(logdir, f'{self.kind}_{split}')
        self.max_steps = max_steps
        self.poll_max_seconds = poll_max_seconds
        self.should_stop = should_stop
        self.task = params.task.Instantiate()
        self.input_params = input_params
        self.checkpoint = checkpoints.make(self.task.VariablesByPath())

    def _Processed(self) -> set[int]:
        path = os.path.join(self.job_dir, PROCESSED_FILE)
        if not os.path.exists(path):
            return set()
        with open(path) as f:
            return {int(line) for line in f if line.strip()}

    def _MarkProcessed(self, step: int) -> None:
        with open(os.path.join(self.job_dir, PROCESSED_FILE), 'a') as f:
            f.write(f'{step}\n')

    def Run(self) -> None:
        os.makedirs(self.job_dir, exist_ok=True)
        writer = tf.summary.create_file_writer(self.job_dir)
        wait = 1.0
        while True:
            path = checkpoints.latest(self.train_dir)
            done = self._Processed()
            if path is not None and checkpoints.step_of(path) not in done:
                step = checkpoints.step_of(path)
                checkpoints.restore(self.checkpoint, path, partial=True)
                self.Process(step, writer)
                self._MarkProcessed(step)
                wait = 1.0
                if step >= self.max_steps:
                    return
                continue
            if path is not None and checkpoints.step_of(path) >= self.max_steps:
                return
            if self.should_stop():
                return
            time.sleep(wait)
            wait = min(2 * wait, self.poll_max_seconds)

    def _Batches(self, num_examples: int):
        dataset = self.input_params.Instantiate().Dataset()
        batches = math.ceil(num_examples / self.input_params.batch_size)
        return dataset.take(batches)

    def Process(self, step: int, writer) -> None:
        raise NotImplementedError


class Evaler(_PollingJob):
    """Weighted-mean metrics over eval.samples_per_summary examples -> score-<step>.txt."""

    kind = 'eval'

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        task = self.task

        @tf.function
        def metrics(batch):
            with fprop_context.evaluation():
                return task.ComputeLoss(task.theta, task.ComputePredictions(task.theta, batch),
                                        batch)
        self._metrics = metrics

    def Process(self, step, writer):
        sums, weights = {}, {}
        for batch in self._Batches(self.task.params.eval.samples_per_summary):
            for name, (value, weight) in self._metrics(batch).items():
                sums[name] = sums.get(name, 0.0) + float(value) * float(weight)
                weights[name] = weights.get(name, 0.0) + float(weight)
        scores = {n: sums[n] / max(weights[n], 1e-12) for n in sums}
        _write_scores(self.job_dir, step, scores, writer)
        logging.info('eval_%s step %d: %s', self.split, step, _format(scores))


class Decoder(_PollingJob):
    """Decodes eval.decoder_samples_per_summary examples -> decoder_out-<step>.jsonl."""

    kind = 'decoder'

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        task = self.task

        @tf.function
        def decode(batch):
            with fprop_context.evaluation():
                return task.Decode(task.theta, batch)
        self._decode = decode

    def Process(self, step, writer):
        records = []
        for batch in self._Batches(self.task.params.eval.decoder_samples_per_summary):
            out = {k: v.numpy() for k, v in self._decode(batch).items()}
            records += self.task.PostProcessDecodeOut(out)
        out_path = os.path.join(self.job_dir, f'decoder_out-{step}.jsonl')
        with open(out_path + '.tmp', 'w') as f:
            for record in records:
                f.write(json.dumps(record) + '\n')
        os.replace(out_path + '.tmp', out_path)
        scores = self.task.DecodeMetrics(records)
        _write_scores(self.job_dir, step, scores, writer)
        logging.info('decoder_%s step %d: %s', self.split, step, _format(scores))


def _format(scores: dict) -> str:
    return '  '.join(f'{k} {v:.4f}' for k, v in sorted(scores.items()))


def _write_scores(job_dir: str, step: int, scores: dict, writer) -> None:
    path = os.path.join(job_dir, f'score-{step}.txt')
    with open(path + '.tmp', 'w') as f:
        for name, value in sorted(scores.items()):
            f.write(f'{name}: {float(np.asarray(value)):.6f}\n')
    os.replace(path + '.tmp', path)
    with writer.as_default(step=step):
        for name, value in scores.items():
            tf.summary.scalar(name, float(value))
    writer.flush()
