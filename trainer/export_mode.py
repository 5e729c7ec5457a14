"""--mode=export: a checkpoint of --logdir as a SavedModel (tfpipe/export.py does the work).

Every check only reads, so bad input (no checkpoint yet, another model's logdir,
an unknown --checkpoint, a non-empty or unwritable --export_dir, a task without
signatures) exits 2 before anything is written; the logdir's jobs are not
disturbed (the export takes no job lock: it only reads train/). A live trainer
may rotate the newest checkpoint out before the export pins it: the export then
takes the newest again, up to NEWEST_ATTEMPTS times in all.
"""
from __future__ import annotations

import os
import time
from typing import Optional

import tensorflow as tf

from tfpipe import checkpoints, export
from tfpipe.hyperparams import Params
from trainer import experiment, logdir_access, train_job

EXPORT_SUBDIR = 'export'
RESOLVE_RETRY_SECONDS = 1.0
# Exports of the newest checkpoint tried before its rotation is the error: a trainer saving
# every step can rotate out the newest between two reads more than once (1 export in 7
# failed with one retry); each attempt after the first costs only the pin.
NEWEST_ATTEMPTS = 5


def run(params: Params, logdir: str, model: str, checkpoint: Optional[str],
        export_dir: Optional[str], placement: str, overwrite: bool) -> str:
    """Exports `checkpoint` (a name such as ckpt-300 or its path; None: the newest) and
    returns the SavedModel's directory (default <logdir>/export/<step>)."""
    if export_dir is not None:
        logdir_access.check_directory(export_dir, '--export_dir')
        export.check_target(os.path.abspath(export_dir), overwrite)
    experiment.check_logdir(logdir, model)
    train_dir = train_job.train_dir_of(logdir)
    path = _resolve(train_dir, checkpoint)
    # The checkpoints were trained with train/params.txt: the same dtypes, body and ties
    # without repeating the overrides (a bfloat16 run exports as bfloat16).
    params = experiment.params_for_logdir(params, logdir, model)
    task_params = params.task
    features = export.feature_specs(params.input.train)
    attempt = 1
    while True:
        try:
            return export.export(task_params, features, path, export_dir or
                                 _default_target(logdir, path), placement, overwrite)
        except export.CheckpointGoneError:
            if checkpoint is not None or attempt == NEWEST_ATTEMPTS:
                raise
        attempt += 1
        path = _resolve(train_dir, None)  # rotated out before the pin: the newest again


def _resolve(train_dir: str, name: Optional[str]) -> str:
    """`_checkpoint_path`, checked readable; looked up once more a moment later if that
    fails: a live trainer deletes the rotated checkpoint just before it rewrites
    train/checkpoint, which then names files that are gone for an instant. A state file
    or checkpoint that stays broken is the error."""
    try:
        path = _checkpoint_path(train_dir, name)
        checkpoints.check_readable(path)
        return path
    except checkpoints.CheckpointError:
        time.sleep(RESOLVE_RETRY_SECONDS)
    path = _checkpoint_path(train_dir, name)
    checkpoints.check_readable(path)
    return path


def _default_target(logdir: str, path: str) -> str:
    """<logdir>/export/<step>, checked writable (the flag at fault is then --logdir)."""
    target = os.path.join(logdir, EXPORT_SUBDIR, str(checkpoints.step_of(path)))
    logdir_access.check_directory(target, '--logdir')
    return target


def _checkpoint_path(train_dir: str, name: Optional[str]) -> str:
    """The checkpoint to export, from the ones train/checkpoint lists (as evalers read them).

    `name` is a name (ckpt-300) or a path to one of them (train_dir/ckpt-300).
    """
    newest = checkpoints.latest(train_dir) if os.path.isdir(train_dir) else None
    if newest is None:
        raise ValueError(f'no checkpoint in {train_dir} yet: train the model first (or point '
                         '--logdir at a trained run)')
    if name is None:
        return newest
    state = tf.train.get_checkpoint_state(train_dir)
    listed = {os.path.basename(p): p for p in state.all_model_checkpoint_paths}
    base = name
    if os.sep in name and os.path.realpath(os.path.dirname(os.path.abspath(name))) == \
            os.path.realpath(train_dir):
        base = os.path.basename(name)
    if base not in listed or not tf.io.gfile.exists(
            os.path.join(train_dir, base) + '.index'):
        names = ', '.join(sorted(listed, key=checkpoints.step_of))
        raise ValueError(f'--checkpoint={name} is not a checkpoint of {train_dir}: give one of '
                         f'{names} (a name or its path), or leave --checkpoint out for the '
                         'newest')
    return os.path.join(train_dir, base)
