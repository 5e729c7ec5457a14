"""From a model name and overrides to the Params tree every job builds from.

Order matters for rule 5 (bad input leaves the logdir untouched): everything
here only reads; the jobs write to the logdir after the model, the inputs and
the checkpoints have been validated.
"""
from __future__ import annotations

import os
import re
from typing import Optional, Sequence

import gin

import model_registry
from tfpipe import params_text
from trainer import logdir_access
from tfpipe.hyperparams import Params, ParamsError

MODEL_FILE = 'model.txt'
# In train/: params.txt holds the params of the checkpoints (the trainer rewrites it once
# the first checkpoint of a run is saved), params-attempt.txt those of the latest start,
# which may have died before saving anything (a NaN, a bad override).
PARAMS_FILE = 'params.txt'
_BARE_WORD = re.compile(r'[\w-]+')  # e.g. never, except_last, 1f1b
_LITERAL_WORDS = {'True', 'False', 'None'}  # read as the values they name, as numbers are
ATTEMPT_PARAMS_FILE = 'params-attempt.txt'
# Keys that steer a job without changing the function its checkpoints compute: where the
# data lives and which examples a job reads, how long training runs and how it updates,
# how many examples an evaler or decoder takes and how a decoder samples, how the layers
# are laid out on devices (a pipelined run equals the unpartitioned one), and the precision
# a job computes in (fprop_dtype: the variables keep their dtype, so a float32 run exports
# as bfloat16). A job on a logdir applies them on top of the recorded params; every other
# key defines the model.
_JOB_KEYS = re.compile(r'(input|task\.train|task\.eval|task\.decoder)([.\[]|$)'
                       r'|task\.pipeline\.(balance|num_cells|virtual_stages|partition_by|'
                       r'devices|num_replicas|num_micro_batches|recompute|schedule|'
                       r'cell_functions|jit_compile|tensor_parallel)$|(.*\.)?fprop_dtype$')
# Of the input keys, those that decide what the ids and labels mean define the model: a
# model scored with another tokenizer, preprocessing or source/target feature is scored on
# another vocabulary or task (accuracy 0.0009 instead of 0.093 with another tokenizer).
_MEANING_KEYS = re.compile(r'input\.\w+\.(tokenizer|preprocess|source_key|target_key)$')
# Of the training keys, the optimizer's class decides what the checkpointed slots mean.
_OPTIMIZER_CLASS = 'task.train.optimizer.cls'


def _is_job_key(key: str) -> bool:
    return bool(_JOB_KEYS.match(key)) and not _MEANING_KEYS.match(key)


@gin.configurable('model')
def gin_model_overrides(overrides: Optional[dict] = None) -> dict:
    """Model params set from gin: `model.overrides = {'task.train.max_steps': 100}`."""
    return dict(overrides or {})


def split_overrides(text: str) -> list[tuple[str, str]]:
    """'a.b=1,c.d=[1, 2],e='x,y'' -> [('a.b', '1'), ('c.d', '[1, 2]'), ('e', "'x,y'")].

    Commas inside brackets or quotes do not split.
    """
    items, depth, quote, start = [], 0, None, 0
    for i, ch in enumerate(text + ','):
        if quote:
            if ch == quote:
                quote = None
        elif ch in '\'"':
            quote = ch
        elif ch in '([{':
            depth += 1
        elif ch in ')]}':
            depth -= 1
        elif ch == ',' and depth == 0:
            item = text[start:i].strip()
            start = i + 1
            if not item:
                continue
            if '=' not in item:
                raise ValueError(f'--params_override item {item!r} has no "=": write '
                                 'key=value pairs separated by commas, e.g. '
                                 "task.train.max_steps=100,input.train.batch_size=16")
            key, value = item.split('=', 1)
            items.append((key.strip(), value.strip()))
    return items


def override_keys(params_override: str, params_file_override: str = '') -> list[str]:
    """The keys the command's --params_override and --params_file_override name.

    A job on a logdir checks each of them against the record, also one set to the
    model's default (which the params alone cannot tell from one left alone).
    """
    keys = [key for key, _ in split_overrides(params_override)]
    if params_file_override and os.path.exists(params_file_override):  # else load_params says
        with open(params_file_override) as f:
            lines = [line.strip() for line in f]
        keys += [params_text.format_path(params_text.parse_path(line)[0]) for line in lines
                 if line and not line.startswith('#')]
    return keys


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _typed_text(params: Params, key: str, value: str) -> str:
    """`value` as params text: a bare word (``never``) is quoted where the param expects a
    str, as Lingvo reads it; anything else stays as written, so a name that would import
    or evaluate code is still refused by FromText."""
    if not _BARE_WORD.fullmatch(value) or value in _LITERAL_WORDS or _is_number(value):
        return value
    try:
        expects_str = params.ExpectedType(key) == 'str' or isinstance(params.Get(key), str)
    except ParamsError:  # an unknown key: FromText names it and suggests a close one
        return repr(value)
    return repr(value) if expects_str else value


def apply_overrides(params: Params, pairs: Sequence[tuple[str, str]], source: str) -> None:
    """Sets each key from its text value through Params.FromText (typed, never eval'd)."""
    for key, value in pairs:
        try:
            params.FromText(f'{key} : {_typed_text(params, key, value)}')
        except Exception as e:  # noqa: BLE001 - re-raised with the source named
            raise ValueError(f"{source}: {e}") from None


def load_params(model: str, params_override: str = '', params_file_override: str = '',
                gin_files: Sequence[str] = (), gin_bindings: Sequence[str] = ()) -> Params:
    """The model's params with file, flag and gin overrides applied, in that order.

    Params text may then name classes of tfpipe, of the registered models' package
    and of the package the model itself comes from (e.g. `mypkg` for a model
    defined in `mypkg.lm`); reading it imports no other module.
    """
    params = model_registry.get_params(model)
    params_text.trust_package(model_registry.PARAMS_PACKAGE)
    params_text.trust_package(model_registry.get_class(model).__module__.split('.')[0])
    if params_file_override:
        if not os.path.exists(params_file_override):
            raise ValueError(f'--params_file_override {params_file_override} does not exist: '
                             'give the path of a params.txt-style file')
        with open(params_file_override) as f:
            try:
                params.FromText(f.read())
            except Exception as e:  # noqa: BLE001
                raise ValueError(f"{params_file_override}: {e}") from None
    apply_overrides(params, split_overrides(params_override), '--params_override')
    if gin_files or gin_bindings:
        try:
            gin.parse_config_files_and_bindings(list(gin_files), list(gin_bindings))
        except (SyntaxError, ValueError, OSError) as e:  # gin reports syntax as SyntaxError
            where = (f'{e.filename} line {e.lineno}' if isinstance(e, SyntaxError) and
                     e.filename else 'the --gin_file/--gin_bindings')
            raise ValueError(f'gin: {where}: {e.msg if isinstance(e, SyntaxError) else e}: '
                             'fix the binding (gin syntax: scope.name = value)') from None
    apply_overrides(params, [(k, repr(v)) for k, v in gin_model_overrides().items()], 'gin')
    return params


def check_logdir(logdir: str, model: str) -> None:
    """A logdir belongs to one model: refuse another model's checkpoints."""
    path = os.path.join(logdir, MODEL_FILE)
    if os.path.exists(path):
        with open(path) as f:
            owner = f.read().strip()
        if owner != model:
            raise ValueError(f'--logdir {logdir} holds checkpoints of model {owner}, not '
                             f'{model}: use a new --logdir for {model}')


def write_job_files(logdir: str, job_dir: str, model: str, params: Params,
                    params_file: str = PARAMS_FILE) -> None:
    os.makedirs(job_dir, exist_ok=True)
    logdir_access.write_file(os.path.join(logdir, MODEL_FILE), model + '\n')
    write_params(os.path.join(job_dir, params_file), params)


def write_params(path: str, params: Params) -> None:
    """Atomically: a reader never sees half a params file."""
    logdir_access.write_file(path, params.ToText())


def saved_train_params(train_dir: str, params: Params,
                       params_file: str = PARAMS_FILE) -> Optional[Params]:
    """The params of this logdir's checkpoints (or of its trainer's latest start).

    None when the file does not exist (before the first checkpoint).
    """
    path = os.path.join(train_dir, params_file)
    if not os.path.exists(path):
        return None
    saved = params.Copy()
    with open(path) as f:
        try:
            saved.FromText(f.read())
        except Exception as e:  # noqa: BLE001 - re-raised with the file named
            raise ValueError(f'{path}: {e}: this logdir was written by another version of '
                             'the model or of tfpipe, or the file was edited; fix the line '
                             'or use a new --logdir') from None
    return saved


def _lines(params: Params) -> dict[str, str]:
    """{key: value text} of every line of params.ToText(), in its order."""
    return dict(line.split(' : ', 1) for line in params.ToText().splitlines() if ' : ' in line)


def _is_parent(text: str) -> bool:
    """A line that only names a Params (or a list of them): its own lines say what differs."""
    return text.startswith(('Params(', '[Params(', 'InstantiableParams('))


_ABSENT = '(none)'  # the text of a key one of two params does not have


def model_changes(old: Params, new: Params, keys: Optional[Sequence[str]] = None,
                  optimizer: bool = False) -> dict[str, tuple[str, str]]:
    """{key: (old text, new text)} of each key that defines the model (not a job key) and
    differs.

    Only among `keys` when given; with `optimizer`, the optimizer's class counts too
    (what a trainer's checkpointed slots mean).
    """
    before, after = _lines(old), _lines(new)
    candidates = keys if keys is not None else list(dict.fromkeys([*before, *after]))
    changes = {}
    for key in candidates:
        pair = before.get(key, _ABSENT), after.get(key, _ABSENT)
        if pair[0] != pair[1] and not any(map(_is_parent, pair)) and (
                not _is_job_key(key) or (optimizer and key == _OPTIMIZER_CLASS)):
            changes[key] = pair
    return changes


def _summary(changes: dict[str, tuple[str, str]], most: int = 4) -> str:
    """'key: old -> new; ...' of the first `most` changes, for a one-line error."""
    lines = [f'{key}: {old} -> {new}' for key, (old, new) in changes.items()]
    more = f'; and {len(lines) - most} more' if len(lines) > most else ''
    return '; '.join(lines[:most]) + more


def _override_text(key: str, text: str) -> str:
    """The --params_override item that sets `key` back to `text` (a class: a new Params)."""
    if key.endswith('.cls'):
        return f'{key[:-len(".cls")]}=Params(cls={text})'
    return f'{key}={text}'


def params_for_logdir(params: Params, logdir: Optional[str], model: str,
                      set_keys: Sequence[str] = ()) -> Params:
    """The params a job reading `logdir` builds from: the ones its trainer recorded in
    train/params.txt, with the job keys this command sets applied on top.

    One logdir is one experiment: an evaler, decoder, generate, export or inspect run
    that rebuilt the model from its own flags would load the checkpoints into another
    model whenever the shapes happen to fit (a 2-head attention reads a 4-head one's
    weights). `params` are the command's (the model and its overrides, before
    --tfds_data_dir is filled in); `set_keys` the keys its overrides name, so that one
    set to the model's default is seen too. A logdir without recorded params (no
    trainer has saved there yet) keeps `params`. Raises ValueError naming the model
    keys this command sets to values other than the record's.
    """
    if not logdir:
        return params
    check_logdir(logdir, model)
    path = os.path.join(logdir, 'train', PARAMS_FILE)
    registered = model_registry.get_params(model)
    recorded = saved_train_params(os.path.dirname(path), registered)
    if recorded is None:
        return params
    default, mine = _lines(registered), _lines(params)
    chosen = [key for key, text in mine.items() if text != default.get(key) or key in set_keys]
    changes = model_changes(recorded, params, chosen)
    if changes:
        raise ValueError(f'{path} records the model this logdir was trained with, and this '
                         f'command changes it ({_summary(changes)}): leave these overrides out '
                         '(every job on a logdir builds the recorded model), or train the '
                         'change in a new --logdir')
    for name, input_params in recorded.input.IterParams():  # where the data lives: this job's
        if input_params is not None and 'data_dir' in input_params:
            input_params.data_dir = registered.input.Get(name).data_dir
    recorded.FromText('\n'.join(f'{key} : {mine[key]}' for key in chosen if _is_job_key(key)))
    return recorded


def check_resumable(saved: Optional[Params], params: Params, train_dir: str) -> None:
    """Checkpoints restore only into the model and optimizer they were saved from, and the
    checkpointed input position only into the input it was saved from."""
    if saved is None or not os.path.exists(os.path.join(train_dir, 'checkpoint')):
        return
    changes = model_changes(saved, params, optimizer=True)
    if changes:
        matching = ','.join(_override_text(key, old) for key, (old, _) in changes.items()
                            if old != _ABSENT)
        raise ValueError(f'the model or optimizer changed since the checkpoints in {train_dir} '
                         f'were written ({_summary(changes)}): they cannot be restored into '
                         f'another model; to resume, give --params_override={matching} as '
                         f'recorded in {PARAMS_FILE} there, or train the change in a new '
                         '--logdir')
    old, new = saved.input.train.Copy(), params.input.train.Copy()
    for input_params in (old, new):  # where the data lives may change; what it is may not
        if 'data_dir' in input_params:
            input_params.data_dir = None
    diff = old.TextDiff(new)
    if diff:
        change = '; '.join(line.strip() for line in diff.splitlines())
        raise ValueError(f'input.train changed since the checkpoints in {train_dir} were written '
                         f'({change}): the saved input position cannot be restored into another '
                         'input; revert the change or use a new --logdir')
