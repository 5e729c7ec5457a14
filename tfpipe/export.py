"""A trained checkpoint as a SavedModel that TensorFlow loads and serves without tfpipe.

Serving stacks (TensorFlow Serving, converters, `saved_model_cli`, someone
else's Python) know SavedModels, not tfpipe checkpoints. The export rebuilds the
task for inference, restores the checkpoint's variables (keyed by layer path,
so any K, R, schedule or executor it was trained with restores), and saves the
task's `ServingSignatures` traced in evaluation mode (BatchNorm moving
statistics, no dropout). The SavedModel holds only the variables and the
traced graphs: loading it imports nothing of tfpipe.

Placement:
- `ONE_DEVICE` (default): the body is one cell run in sequence, and the device
  annotations are removed from the saved graphs, so the loading runtime places
  the ops on its own devices (a GPU if it has one).
- `PIPELINED`: the trained cells keep their devices (one replica's; a
  tensor-parallel cell its home device); a request runs through them in order.
  The device names are those of the exporting process
  ('/job:localhost/replica:0/task:0/device:CPU:1'); a runtime without
  such a device places those ops elsewhere (TensorFlow's soft placement).

Every signature checks the declared sizes of its inputs (an image model exported
for 16x16 refuses 32x32 with an error naming the shape, instead of answering).

The checkpoint is pinned before the model is built: its files are hard-linked
(or copied, across file systems) beside the target, so a live trainer that
rotates it out (`save_max_to_keep`) meanwhile does not pull it from under the
restore. The SavedModel is written into a temporary directory beside the
target and renamed into place with the user's umask, so a failed export
leaves nothing half-written. A full disk there is an error naming the target
and its file system (ExportDiskFullError), not the checkpoint the pin copied.
"""
from __future__ import annotations

import errno
import os
import re
import shutil
import tempfile
from typing import Optional

import tensorflow as tf
from tensorflow.core.protobuf import saved_model_pb2
from tensorflow.python.saved_model import fingerprinting_utils

from tfpipe import checkpoints, fprop_context
from tfpipe.hyperparams import Params

ONE_DEVICE = 'one_device'
PIPELINED = 'pipelined'
PLACEMENTS = (ONE_DEVICE, PIPELINED)
SAVED_MODEL_FILE = 'saved_model.pb'


class CheckpointGoneError(ValueError):
    """The checkpoint's files went away before the export pinned them (rotated out)."""


class ExportDiskFullError(ValueError):
    """The export directory's disk (or quota) filled up while the export wrote there."""


def inference_task_params(task_params: Params, placement: str = ONE_DEVICE) -> Params:
    """The task's params for serving: one replica, no tensor or expert parallelism (the
    checkpoint holds whole weights and experts, and a SavedModel then holds no
    collectives), and for ONE_DEVICE one cell."""
    if placement not in PLACEMENTS:
        raise ValueError(f'unknown export placement {placement!r}: use one of {list(PLACEMENTS)}')
    p = decoding_task_params(task_params)  # every expert on replica 0
    pipe = p.pipeline
    split = pipe.tensor_parallel
    if placement == ONE_DEVICE:
        pipe.Set(balance=[len(pipe.body)], num_cells=None, virtual_stages=1, devices=None,
                 schedule='fill_drain', num_micro_batches=1)
    elif pipe.devices is not None:
        num_devices = len(pipe.devices) // (pipe.num_replicas * split)
        pipe.devices = list(pipe.devices)[:num_devices * split:split]  # replica 0's cells' homes
    pipe.Set(num_replicas=1, tensor_parallel=1)
    return p


def decoding_task_params(task_params: Params) -> Params:
    """The task's params for a decoder or --mode=generate: every expert on replica 0
    (expert_parallel=1). Decoding runs replica 0 alone, so at P > 1 its MoE layers'
    all-to-all would wait forever for members that never join (the decoder job hung so);
    checkpoints hold each expert whole, so replica 0 restores them all."""
    p = task_params.Copy()
    p.pipeline.expert_parallel = 1
    return p


def feature_specs(input_params: Params) -> dict[str, tf.TensorSpec]:
    """One example's features (no batch dimension, no 'weight') as the model's input gives them."""
    spec = input_params.Instantiate().EvalDataset(1).element_spec
    return {k: tf.TensorSpec(v.shape[1:], v.dtype) for k, v in spec.items() if k != 'weight'}


def build(task_params: Params, features: dict[str, tf.TensorSpec],
          placement: str = ONE_DEVICE) -> tuple[tf.Module, dict]:
    """The task built for inference, as a module holding its variables by layer path, and its
    signatures as concrete functions traced in evaluation mode."""
    task = inference_task_params(task_params, placement).Instantiate()
    signatures = task.ServingSignatures(features)  # raises first if the task has none
    module = tf.Module()
    module.variables_by_path = task.VariablesByPath()
    concrete = {}
    for name, sig in signatures.items():
        concrete[name] = tf.function(_serving_fn(name, sig),
                                     autograph=False).get_concrete_function(**sig.inputs)
    return module, concrete


def _serving_fn(name: str, sig):
    """`sig.fn` in evaluation mode, behind a check of every input's declared sizes.

    A loaded signature passes a tensor of any shape to its graph (TensorFlow does
    not check it): a convolutional net answers a 32x32 image as readily as a
    16x16 one, and an input of another rank can abort the process in a kernel.
    The check turns both into an error naming the shape.
    """
    def serve(**inputs):
        checked = {key: _checked(name, key, spec.shape, inputs[key])
                   for key, spec in sig.inputs.items()}
        with fprop_context.evaluation():
            return sig.fn(**checked)
    return serve


def _checked(signature: str, key: str, declared: tf.TensorShape, value: tf.Tensor) -> tf.Tensor:
    """`value`, available only once it is found to have `declared`'s rank and known sizes."""
    rank = len(declared)
    known = [i for i, d in enumerate(declared) if d is not None]
    # The check reads the shape through an op that hides the traced static shape: from
    # [batch, 16, 16, 3] grappler folds the rank, Size(Shape(x)), to the constant 4, and a
    # [2, 16, 16, 3, 1] input then passed the check and failed in a convolution's kernel.
    shape = tf.shape(tf.raw_ops.PlaceholderWithDefault(input=value, shape=None))
    padded = tf.concat([shape, tf.fill([rank], -1)], 0)  # a lower rank gathers -1, not an error
    got = tf.concat([[tf.size(shape)], tf.gather(padded, tf.constant(known, tf.int32))], 0)
    expected = [rank] + [declared[i] for i in known]
    shown = '[' + ', '.join('batch' if i == 0 and d is None else ('any' if d is None else str(d))
                            for i, d in enumerate(declared)) + ']'
    check = tf.debugging.assert_equal(
        got, tf.constant(expected, got.dtype), summarize=len(expected),
        message=f'signature {signature}: input {key} must have shape {shown}, the shape the '
                'model was exported for (x below: the rank and those sizes as given)')
    with tf.control_dependencies([check]):  # no kernel sees the input before the check
        return tf.identity(value)


def export(task_params: Params, features: dict[str, tf.TensorSpec], checkpoint_path: str,
           export_dir: str, placement: str = ONE_DEVICE, overwrite: bool = False) -> str:
    """Writes the SavedModel of `checkpoint_path` to `export_dir` and returns it.

    An `export_dir` that exists and is not empty is refused unless `overwrite`;
    it is then replaced whole, only once the new SavedModel is complete. Raises
    CheckpointGoneError when the checkpoint's files are gone before they are pinned.
    """
    export_dir = os.path.abspath(export_dir)
    check_target(export_dir, overwrite)
    parent = os.path.dirname(export_dir)
    created = _make_dirs(parent)
    prefix = f'.{os.path.basename(export_dir)}'
    pin_dir = tempfile.mkdtemp(prefix=f'{prefix}.checkpoint-', dir=parent)
    tmp = None
    try:
        pinned = _pin(checkpoint_path, pin_dir)
        module, signatures = build(task_params, features, placement)
        try:
            checkpoints.restore(checkpoints.make(module.variables_by_path), pinned, partial=True)
        except checkpoints.CheckpointError as e:  # name the user's checkpoint, not the pin
            raise checkpoints.CheckpointError(str(e).replace(
                pinned, os.path.abspath(checkpoint_path))) from None
        tmp = tempfile.mkdtemp(prefix=f'{prefix}.tmp-', dir=parent)
        tf.saved_model.save(module, tmp, signatures=signatures)
        if placement == ONE_DEVICE:
            clear_devices(tmp)
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes it 0700, private to this user
        _replace(tmp, export_dir)
    except BaseException as e:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(pin_dir, ignore_errors=True)
        if created is not None:
            _remove_empty(created, parent)
        if _is_disk_full(e):  # after the clean-up, so the free space shown is the disk's own
            raise ExportDiskFullError(_disk_full_message(export_dir)) from None
        raise
    shutil.rmtree(pin_dir, ignore_errors=True)
    return export_dir


def _pin(checkpoint_path: str, directory: str) -> str:
    """The checkpoint's files hard-linked (or copied) into `directory`; returns the new prefix.

    A link keeps the files' data for the export whatever the trainer deletes,
    without copying on the same file system. Raises CheckpointGoneError if the
    index or any data shard is gone already.
    """
    source = os.path.abspath(checkpoint_path)
    name = os.path.basename(source)
    target = os.path.join(directory, name)
    try:
        files = [f for f in os.listdir(os.path.dirname(source)) if f.startswith(name + '.')]
        for f in files:
            src, dst = os.path.join(os.path.dirname(source), f), os.path.join(directory, f)
            try:
                os.link(src, dst)
            except FileNotFoundError:
                raise
            except OSError:  # another file system, or links not allowed
                shutil.copyfile(src, dst)
    except FileNotFoundError:
        files = []
    shards = [re.fullmatch(r'.*\.data-\d+-of-(\d+)', f) for f in files]
    counts = {int(m.group(1)) for m in shards if m}
    if name + '.index' not in files or len(counts) != 1 or \
            sum(m is not None for m in shards) != counts.pop():
        raise CheckpointGoneError(
            f'checkpoint {source} was removed (a running trainer rotates old checkpoints out, '
            'save_max_to_keep) before the export could read it: export a newer one')
    return target


def _is_disk_full(error: BaseException) -> bool:
    """Is `error` a write refused for want of space, from Python (the pin's links or
    copies) or from TensorFlow's file system (the SavedModel's files)?"""
    if isinstance(error, OSError):
        return error.errno in (errno.ENOSPC, errno.EDQUOT)
    return isinstance(error, tf.errors.ResourceExhaustedError) and any(
        os.strerror(code) in str(error) for code in (errno.ENOSPC, errno.EDQUOT))


def _disk_full_message(export_dir: str) -> str:
    """One line naming the export's target, the file system it is on and the fix.

    Everything the export writes (the pinned checkpoint, the SavedModel) goes beside
    the target, so the target's disk is the one that filled, never the logdir's.
    """
    mount = _existing_parent(export_dir)
    while not os.path.ismount(mount):
        mount = os.path.dirname(mount)
    stat = os.statvfs(mount)
    free = stat.f_bavail * stat.f_frsize
    shown = f'{free / 2**20:.1f} MiB' if free >= 2**20 else f'{free // 1024} KiB'
    return (f'no space left on the disk of the export directory {export_dir} (the file system '
            f'mounted at {mount}, {shown} free): free space there or give an --export_dir on '
            'another disk; the checkpoint was only read')


def _existing_parent(path: str) -> str:
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def check_target(export_dir: str, overwrite: bool) -> None:
    """Refuses a target that is a file, or a non-empty directory without `overwrite`."""
    if os.path.isfile(export_dir):
        raise ValueError(f'--export_dir {export_dir} is a file: give a directory path')
    if os.path.isdir(export_dir) and os.listdir(export_dir) and not overwrite:
        raise ValueError(f'--export_dir {export_dir} exists and is not empty: pass --overwrite '
                         'to replace it, or give another --export_dir')


def clear_devices(saved_model_dir: str) -> None:
    """Removes every op's device annotation from a SavedModel's graphs.

    tfpipe places each cell's ops on a device of the exporting process; without
    annotations the loading runtime places them itself, as for any model.
    """
    path = os.path.join(saved_model_dir, SAVED_MODEL_FILE)
    proto = saved_model_pb2.SavedModel()
    with open(path, 'rb') as f:
        proto.ParseFromString(f.read())
    for meta_graph in proto.meta_graphs:
        graph = meta_graph.graph_def
        for node in graph.node:
            node.device = ''
        for function in graph.library.function:
            for node in function.node_def:
                node.device = ''
    with open(path, 'wb') as f:
        f.write(proto.SerializeToString())
    # fingerprint.pb holds a checksum of saved_model.pb: written again for the new graphs
    # (TensorFlow exports the function that tf.saved_model.save itself calls only here).
    fingerprinting_utils.write_fingerprint(saved_model_dir)


def _replace(tmp: str, export_dir: str) -> None:
    """Moves the finished `tmp` to `export_dir`; an old `export_dir` goes only after that."""
    if not os.path.exists(export_dir):
        os.rename(tmp, export_dir)
        return
    old = tempfile.mkdtemp(prefix=f'.{os.path.basename(export_dir)}.old-',
                           dir=os.path.dirname(export_dir))
    os.rename(export_dir, os.path.join(old, 'export'))
    os.rename(tmp, export_dir)
    shutil.rmtree(old)


def _make_dirs(path: str) -> Optional[str]:
    """Creates `path` and missing parents; returns the topmost directory created (or None)."""
    top = None
    probe = path
    while not os.path.exists(probe):
        top = probe
        probe = os.path.dirname(probe)
    os.makedirs(path, exist_ok=True)
    return top


def _remove_empty(top: str, path: str) -> None:
    """Removes the empty directories from `path` up to `top`, which `_make_dirs` created."""
    while True:
        if os.listdir(path):
            return
        os.rmdir(path)
        if path == top:
            return
        path = os.path.dirname(path)
