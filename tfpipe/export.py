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
- `PIPELINED`: the trained cells keep their devices (one replica's); a request
  runs through them in order. The device names are those of the exporting
  process ('/job:localhost/replica:0/task:0/device:CPU:1'); a runtime without
  such a device places those ops elsewhere (TensorFlow's soft placement).

The SavedModel is written into a temporary directory beside the target and
renamed into place, so a failed export leaves nothing half-written.
"""
from __future__ import annotations

import os
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


def inference_task_params(task_params: Params, placement: str = ONE_DEVICE) -> Params:
    """The task's params for serving: one replica, and for ONE_DEVICE one cell."""
    if placement not in PLACEMENTS:
        raise ValueError(f'unknown export placement {placement!r}: use one of {list(PLACEMENTS)}')
    p = task_params.Copy()
    pipe = p.pipeline
    if placement == ONE_DEVICE:
        pipe.Set(balance=[len(pipe.body)], num_cells=None, virtual_stages=1, devices=None,
                 schedule='fill_drain', num_micro_batches=1)
    elif pipe.devices is not None:
        num_devices = len(pipe.devices) // pipe.num_replicas
        pipe.devices = list(pipe.devices)[:num_devices]  # replica 0's
    pipe.num_replicas = 1
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
        concrete[name] = tf.function(_in_evaluation(sig.fn)).get_concrete_function(**sig.inputs)
    return module, concrete


def _in_evaluation(fn):
    def serve(**inputs):
        with fprop_context.evaluation():
            return fn(**inputs)
    return serve


def export(task_params: Params, features: dict[str, tf.TensorSpec], checkpoint_path: str,
           export_dir: str, placement: str = ONE_DEVICE, overwrite: bool = False) -> str:
    """Writes the SavedModel of `checkpoint_path` to `export_dir` and returns it.

    An `export_dir` that exists and is not empty is refused unless `overwrite`;
    it is then replaced whole, only once the new SavedModel is complete.
    """
    export_dir = os.path.abspath(export_dir)
    check_target(export_dir, overwrite)
    module, signatures = build(task_params, features, placement)
    checkpoints.restore(checkpoints.make(module.variables_by_path), checkpoint_path,
                        partial=True)
    parent = os.path.dirname(export_dir)
    created = _make_dirs(parent)
    tmp = tempfile.mkdtemp(prefix=f'.{os.path.basename(export_dir)}.tmp-', dir=parent)
    try:
        tf.saved_model.save(module, tmp, signatures=signatures)
        if placement == ONE_DEVICE:
            clear_devices(tmp)
        _replace(tmp, export_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if created is not None:
            _remove_empty(created, parent)
        raise
    return export_dir


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
