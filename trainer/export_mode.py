"""--mode=export: a checkpoint of --logdir as a SavedModel (tfpipe/export.py does the work).

Every check only reads, so bad input (no checkpoint yet, another model's logdir,
an unknown --checkpoint, a non-empty --export_dir, a task without signatures)
exits 2 before anything is written; the logdir's jobs are not disturbed (the
export takes no job lock: it only reads train/).
"""
from __future__ import annotations

import os
from typing import Optional

import tensorflow as tf

from tfpipe import checkpoints, export
from tfpipe.hyperparams import Params
from trainer import experiment, train_job

EXPORT_SUBDIR = 'export'


def run(params: Params, logdir: str, model: str, checkpoint: Optional[str],
        export_dir: Optional[str], placement: str, overwrite: bool) -> str:
    """Exports `checkpoint` (a name such as ckpt-300; None: the newest) and returns the
    SavedModel's directory (default <logdir>/export/<step>)."""
    experiment.check_logdir(logdir, model)
    train_dir = train_job.train_dir_of(logdir)
    path = _checkpoint_path(train_dir, checkpoint)
    checkpoints.check_readable(path)
    # The checkpoints were trained with train/params.txt: the same dtypes, body and ties
    # without repeating the overrides (a bfloat16 run exports as bfloat16).
    params = experiment.params_for_logdir(params, logdir, model)
    target = export_dir or os.path.join(logdir, EXPORT_SUBDIR, str(checkpoints.step_of(path)))
    features = export.feature_specs(params.input.train)
    return export.export(params.task, features, path, target, placement, overwrite)


def _checkpoint_path(train_dir: str, name: Optional[str]) -> str:
    """The checkpoint to export, from the ones train/checkpoint lists (as evalers read them)."""
    newest = checkpoints.latest(train_dir) if os.path.isdir(train_dir) else None
    if newest is None:
        raise ValueError(f'no checkpoint in {train_dir} yet: train the model first (or point '
                         '--logdir at a trained run)')
    if name is None:
        return newest
    state = tf.train.get_checkpoint_state(train_dir)
    listed = {os.path.basename(p): p for p in state.all_model_checkpoint_paths}
    if name not in listed or not tf.io.gfile.exists(
            os.path.join(train_dir, name) + '.index'):
        names = ', '.join(sorted(listed, key=checkpoints.step_of))
        raise ValueError(f'--checkpoint={name} is not a checkpoint of {train_dir}: give one of '
                         f'{names}, or leave --checkpoint out for the newest')
    return os.path.join(train_dir, name)
