"""Checkpoints keyed by layer path, restored strictly, with errors that name the fix.

Variables are saved under their layer path ('task/pipe/fc3/w'), never under a
cell index or device, so a run can resume with another `balance`, K or device
list: the values land in whichever cell now owns each layer. Every restore
asserts that each variable of the model found its value in the checkpoint;
otherwise a changed model would silently start from its initial weights.
"""
from __future__ import annotations

import os
import re
from typing import Optional

import tensorflow as tf

from tfpipe import devices, variable_shards

STATE_FILE = 'checkpoint'  # written by tf.train.CheckpointManager after the data files


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: corrupt, partial, or of another model."""


def make(variables: dict[str, tf.Variable], **extras: Optional[tf.Module]) -> tf.train.Checkpoint:
    """A checkpoint of the model's variables by path plus extras (step, optimizer, iterator).

    A weight split over devices (tensor parallelism) is saved whole under its own path,
    so the checkpoint restores into any tensor_parallel (`variable_shards.whole_view`).
    """
    return tf.train.Checkpoint(model=variable_shards.whole_view(variables),
                               **{k: v for k, v in extras.items() if v is not None})


def io_options() -> tf.train.CheckpointOptions:
    """Reads and writes checkpoint files in this process, whatever device holds a variable.

    By default TensorFlow saves each device's variables with an op on that device,
    so a cell on a remote worker would write its shard to the worker host's disk;
    the logdir is the trainer's, so all file I/O goes through the trainer's CPU.
    """
    return tf.train.CheckpointOptions(experimental_io_device=devices.local_cpu())


def latest(directory: str) -> Optional[str]:
    """The newest complete checkpoint in `directory` (None when there is none).

    Only checkpoints listed in the state file count: CheckpointManager writes
    that file (atomically) after the data, so a half-written checkpoint is never
    returned. A listed checkpoint whose files are gone (moved away by a user, or
    rotated out by a trainer while an evaler looks) is skipped for the next
    older one. A state file that cannot be parsed, or that lists no checkpoint
    with files, is an error naming the newest readable `ckpt-N` when the
    directory holds any: starting from step 0 there would overwrite them, and
    guessing which one the user meant would hide whatever garbled the file.
    """
    directory = os.path.abspath(directory)  # TF prefixes a relative dir; joining twice fails
    state_path = os.path.join(directory, STATE_FILE)
    if not tf.io.gfile.exists(state_path):
        return None
    try:
        state = tf.train.get_checkpoint_state(directory)  # None when it does not parse
    except ValueError:  # parses, but names no checkpoint
        state = None
    listed = [] if state is None else (list(state.all_model_checkpoint_paths) or
                                       [state.model_checkpoint_path])
    for path in reversed(listed):
        if not os.path.isabs(path):
            path = os.path.join(directory, path)
        if tf.io.gfile.exists(path + '.index'):
            return path
    on_disk = _checkpoints_on_disk(directory)
    if state is None and not on_disk:
        return None  # nothing to lose: the trainer rewrites the state file
    problem = (f'{state_path} is unreadable' if state is None else
               f'{state_path} lists checkpoints {[os.path.basename(p) for p in listed]} but '
               'none of their files exist')
    if not on_disk:
        raise CheckpointError(f'{problem}: restore them, or delete the state file to start '
                              'over')
    newest = _newest_readable(on_disk)
    if newest is None:
        raise CheckpointError(
            f'{problem} and none of {[os.path.basename(p) for p in on_disk]} is readable: '
            'restore the checkpoints from a copy, or use a new --logdir to start over')
    name = os.path.basename(newest)
    raise CheckpointError(
        f'{problem}; the newest readable checkpoint there is {name}: to resume from it, '
        f"write the line 'model_checkpoint_path: \"{name}\"' into {state_path}; to start "
        'over, use a new --logdir')


def _checkpoints_on_disk(directory: str) -> list[str]:
    """Prefixes of the ckpt-N checkpoints with an index file, newest first."""
    found = []
    for index in tf.io.gfile.glob(os.path.join(directory, 'ckpt-*.index')):
        prefix = index[:-len('.index')]
        if prefix.rsplit('-', 1)[1].isdigit():
            found.append(prefix)
    return sorted(found, key=step_of, reverse=True)


def _newest_readable(prefixes: list[str]) -> Optional[str]:
    for prefix in prefixes:
        try:
            check_readable(prefix)
            return prefix
        except CheckpointError:
            continue
    return None


def step_of(path: str) -> int:
    """The global step encoded in a checkpoint prefix such as '.../ckpt-300'."""
    return int(path.rsplit('-', 1)[1])


def restore(checkpoint: tf.train.Checkpoint, path: str, partial: bool = False) -> None:
    """Restores `path`; every model variable must be found in it.

    `partial=True` lets the checkpoint hold objects this job does not build
    (an evaler has no optimizer); the model's own variables are still required.
    """
    check_matches(checkpoint, path, partial)
    try:
        status = checkpoint.restore(path, options=io_options())
        status.assert_existing_objects_matched()
        if partial:
            status.expect_partial()
    except tf.errors.NotFoundError:
        raise  # the files went away (rotated out): the caller may look again
    except (tf.errors.OpError, ValueError, AssertionError, IndexError) as e:
        # IndexError: a truncated data file ('Read less bytes than requested').
        # check_matches passed: its variables are this model's, so the files are damaged.
        raise CheckpointError(
            f'checkpoint {path} cannot be restored into this model although its variables '
            f'match ({one_line(str(e))[:300] or type(e).__name__}): it is corrupt or partial; '
            'move it out of the train dir to fall back to an older one') from None


_VALUE_SUFFIX = '/.ATTRIBUTES/VARIABLE_VALUE'


def _escape(name: str) -> str:
    """A checkpoint key's part for an object name (TensorFlow's escaping of '.' and '/')."""
    return name.replace('.', '..').replace('/', '.S')


def _readable(key: str) -> str:
    """'model/pipe.Sfc3.Sw/.ATTRIBUTES/VARIABLE_VALUE' -> 'model/pipe/fc3/w'."""
    return re.sub(r'\.(S|\.)', lambda m: '/' if m.group(1) == 'S' else '.',
                  key[:-len(_VALUE_SUFFIX)])


def _expected(checkpoint: tf.train.Checkpoint) -> dict[str, tf.Variable]:
    """{checkpoint key: variable (or a sharded optimizer's slot)} of every value the
    object would save: the keys tf.train.Checkpoint writes for it."""
    view, out = tf.train.TrackableView(checkpoint), {}

    def walk(obj, key: str) -> None:
        children = view.children(obj)
        if not children and hasattr(obj, 'shape'):  # a variable, or a sharded slot
            out[key + _VALUE_SUFFIX] = obj
        for name, child in children.items():
            walk(child, f'{key}/{_escape(name)}' if key else _escape(name))
    walk(checkpoint, '')
    return out


def check_matches(checkpoint: tf.train.Checkpoint, path: str, partial: bool = False) -> None:
    """Refuses a checkpoint of another model or optimizer before restoring it.

    TensorFlow restores by name and only complains about what is missing, so a model
    or optimizer whose values have the same names loads the wrong ones silently (Adam's
    `m`/`v` read as Adafactor's, Adam's slots dropped by SGD). Every value the object
    saves must be in the checkpoint with its shape and dtype, and (unless `partial`: an
    evaler has no optimizer) every value the checkpoint holds under one of the object's
    parts must be the object's. The error says what changed; the checkpoint is healthy.
    """
    try:
        reader = tf.train.load_checkpoint(path)
    except (tf.errors.OpError, ValueError):
        return  # unreadable: check_readable and restore name that
    shapes, dtypes = reader.get_variable_to_shape_map(), reader.get_variable_to_dtype_map()
    expected = _expected(checkpoint)
    problems = []
    for key, value in expected.items():
        name, shape, dtype = _readable(key), list(value.shape), getattr(value, 'dtype', None)
        if key not in shapes:
            problems.append(f'{name} {shape} is not in it')
        elif shapes[key] != shape or dtype not in (None, dtypes[key]):
            problems.append(f'{name} is {dtypes[key].name}{shapes[key]} there and '
                            f'{getattr(dtype, "name", "")}{shape} here')
    parts = {key.split('/', 1)[0] for key in expected}
    owners = tf.train.TrackableView(checkpoint).children(checkpoint)
    for key in sorted(shapes):
        part = key.split('/', 1)[0]
        if key.endswith(_VALUE_SUFFIX) and key not in expected and part in parts and not (
                partial and part != 'model'):
            kind = type(owners[part]).__name__
            owner = part if kind.startswith('_') else f'{part} ({kind})'
            problems.append(f'it holds {_readable(key)}, which this {owner} does not have')
    if problems:
        more = f' (and {len(problems) - 2} more)' if len(problems) > 2 else ''
        raise CheckpointError(
            f'checkpoint {path} was written by another model or optimizer: '
            f'{"; ".join(problems[:2])}{more}: use a new --logdir for the changed model, or '
            f'a --params_override that matches the params.txt beside it')


def check_readable(path: str) -> None:
    """Reads the checkpoint's index so a corrupt file fails before anything is written."""
    try:
        tf.train.list_variables(path)
    except (tf.errors.OpError, ValueError) as e:
        raise CheckpointError(f'checkpoint {path} is unreadable ({one_line(str(e))[:300]}): '
                              'move it out of the train dir to fall back to an older one'
                              ) from None


def one_line(message: str) -> str:
    """The informative line of a possibly multi-line error message.

    TensorFlow prefixes errors raised while tracing with 'in user code:' and a
    traceback; the cause is then on the last line.
    """
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    if not lines:
        return ''
    return lines[-1] if lines[0].startswith('in user code') else lines[0]
