"""Running an exported SavedModel the way a user without tfpipe runs it."""
import os
import subprocess
import sys

import numpy as np

import model_registry
from tfpipe import fprop_context, lm_inputs

from tests import trainer_helpers as th

SERVE_SCRIPT = os.path.join(th.REPO, 'tests', 'serve_without_tfpipe.py')
SAVED_MODEL_CLI = os.path.join(os.path.dirname(sys.executable), 'saved_model_cli')


def run_signature(saved_model: str, signature: str, inputs: dict,
                  tmp_path) -> tuple[subprocess.CompletedProcess, str]:
    """Runs `signature` on `inputs` (numpy arrays by input name) in a process that cannot
    import tfpipe (tests/serve_without_tfpipe.py, forked from a server that imported
    TensorFlow alone); (the process, its outputs' .npz path)."""
    in_path = str(tmp_path / f'{signature}_inputs.npz')
    out_path = str(tmp_path / f'{signature}_outputs.npz')
    np.savez(in_path, **inputs)
    env = {k: v for k, v in os.environ.items() if k != 'PYTHONPATH'}
    env['TF_CPP_MIN_LOG_LEVEL'] = '2'
    result = th.run_script_without_tfpipe(SERVE_SCRIPT, [saved_model, signature, in_path,
                                                         out_path], env, str(tmp_path), 180)
    return result, out_path


def serve(saved_model: str, inputs: dict, tmp_path, signature: str = 'serving_default') -> dict:
    """The signature's outputs, computed without tfpipe; the run must succeed."""
    result, out_path = run_signature(saved_model, signature, inputs, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout
    assert 'tfpipe modules loaded: []' in result.stdout
    return dict(np.load(out_path))


def document_row(model: str, task) -> tuple[np.ndarray, np.ndarray]:
    """The first dev row of registered LM `model` that starts a document: its tokens (the
    row's targets) within that document, and the evaler's log-prob of each
    (-cross-entropy, evaluation mode) from `task`, the model restored in this process."""
    params = model_registry.get_params(model)
    batch = next(iter(params.input.dev.Instantiate().EvalDataset(16)))
    with fprop_context.evaluation():
        logits = task.ComputePredictions(task.theta, batch)
    xent, _ = task.TokenLosses(logits, task.PipelineTargets(batch))
    starts = np.flatnonzero((batch['inputs'].numpy()[:, 0] == lm_inputs.EOD_ID)
                            & (batch['segment_ids'].numpy()[:, 0] == 1))
    row = int(starts[0])
    length = int((batch['segment_ids'].numpy()[row] == 1).sum())
    return batch['targets'].numpy()[row, :length], -xent.numpy()[row, :length]


def prefixes(tokens: np.ndarray, lengths: list[int]) -> np.ndarray:
    """Rows holding the first lengths[i] of `tokens`, 0-padded to len(tokens)."""
    ids = np.zeros([len(lengths), len(tokens)], tokens.dtype)
    for i, n in enumerate(lengths):
        ids[i, :n] = tokens[:n]
    return ids
