"""tfpipe memory prediction benchmark: the host peak inspect_model predicts, against the
peak the trainer measures.

For each model (and params overrides), in fresh processes with the BFC allocator:
`--mode=inspect_model` prints the predicted peak of the host's allocator (the
logical CPUs share it), and the trainer (`--job=trainer`, the training step alone:
evaler and decoder threads in the same process add their own) prints the measured
peak on its progress line. Prints both and their ratio. The 'users' configurations
are models as users write them (tests/memory_models.py: a wide conv net on its own
generated images, a byte LM with one 2 MiB document) and a Keras model pipelined by
tfpipe.keras (tests/keras_memory_probe.py: `keras_memory.predict_fit` against the
allocator's peak after `fit`, each in a fresh process).

Run (from the repository root; about 30 s per configuration):
    PYTHONPATH=. python benchmarks/memory_prediction_benchmark.py
    PYTHONPATH=. python benchmarks/memory_prediction_benchmark.py --configs=default
    PYTHONPATH=. python benchmarks/memory_prediction_benchmark.py --configs=users
    PYTHONPATH=. python benchmarks/memory_prediction_benchmark.py --configs=gpt2 --steps=6

The GPT-2-shaped LMs' runs train a few steps and read the last progress line's peak:
the most of several steps, each ordered by the threads its own way. (Their peak used to
grow over the first steps: the optimizer moved its slots into new buffers every step,
docs/memory.md.)
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

_PREDICTED = re.compile(r'host allocator .*: peak ([\d.]+) MiB')
_MEASURED = re.compile(r'peak CPU:0 ([\d.]+) MiB')
AMOEBA = 'image.shapes.AmoebaNetPipe'
TRANSFORMER = 'mt.reverse.TransformerPipe'
GPT2 = 'lm.pystdlib.GPT2SmallShapedLM'
GPT2_MEDIUM = 'lm.pystdlib.GPT2MediumShapedLM'
KERAS = 'keras'  # not a trainer model: tests/keras_memory_probe.py
USERS = [('tests.memory_models.WideConvNet', ''), ('tests.memory_models.LongDocumentLM', ''),
         (KERAS, '')]
CONFIGS = {
    'default': [(AMOEBA, ''), (TRANSFORMER, '')],
    'users': USERS,
    # Issue 39's models at K = 4 (their default), 1, 2 and K=2 x T=2 (minutes each).
    'gpt2': [(GPT2, ''), (GPT2, 'task.pipeline.balance=[17]'),
             (GPT2, 'task.pipeline.balance=[8, 9]'),
             (GPT2, 'task.pipeline.balance=[8, 9],task.pipeline.tensor_parallel=2')],
    'gpt2_medium': [(GPT2_MEDIUM, ''), (GPT2_MEDIUM, 'task.pipeline.balance=[29]'),
                    (GPT2_MEDIUM, 'task.pipeline.balance=[14, 15]'),
                    (GPT2_MEDIUM,
                     'task.pipeline.balance=[14, 15],task.pipeline.tensor_parallel=2')],
    'all': [(AMOEBA, ''), (TRANSFORMER, ''),
            (AMOEBA, 'task.pipeline.num_micro_batches=1'),
            (AMOEBA, 'task.pipeline.num_micro_batches=8'),
            (AMOEBA, 'task.pipeline.schedule=1f1b'),
            (AMOEBA, 'task.pipeline.num_cells=2'),
            (AMOEBA, 'task.pipeline.num_micro_batches=2'),
            (TRANSFORMER, 'task.pipeline.num_micro_batches=1'),
            (TRANSFORMER, 'task.pipeline.schedule=1f1b'),
            (AMOEBA, "task.fprop_dtype='bfloat16'"),
            ('lm.pystdlib.TinyTransformerLM', '')] + USERS,
}


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env() -> dict:
    return dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2', TF_CPU_ALLOCATOR_USE_BFC='true',
                PYTHONPATH=REPO + os.pathsep + os.environ.get('PYTHONPATH', ''))


def run_trainer(model: str, override: str, data_dir: str, *flags: str) -> str:
    """The trainer binary's stderr (its log) in a fresh logdir; raises on failure."""
    repo, env = REPO, _env()
    with tempfile.TemporaryDirectory() as logdir:
        result = subprocess.run(
            [sys.executable, '-m', 'trainer', f'--model={model}', f'--logdir={logdir}',
             f'--tfds_data_dir={data_dir}', '--run_locally=cpu',
             f'--params_override={override}', *flags],
            env=env, cwd=repo, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        raise RuntimeError(result.stderr[-3000:])
    return result.stdout + result.stderr


def keras_probe(mode: str) -> float:
    """tests/keras_memory_probe.py's figure (MiB) in a fresh process."""
    result = subprocess.run([sys.executable, '-m', 'tests.keras_memory_probe', mode],
                            env=_env(), cwd=REPO, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        raise RuntimeError(result.stderr[-3000:])
    return float(result.stdout.split()[-1])


def predicted_and_measured(model: str, override: str, data_dir: str,
                           steps: int) -> tuple[float, float]:
    """(inspect_model's predicted host peak, the trainer's measured peak) in MiB."""
    if model == KERAS:
        return keras_probe('predict'), keras_probe('fit')
    predicted = _PREDICTED.findall(run_trainer(model, override, data_dir,
                                               '--mode=inspect_model'))
    measured = _MEASURED.findall(run_trainer(model, override, data_dir, '--job=trainer',
                                             f'--max_steps={steps}'))
    return float(predicted[-1]), float(measured[-1])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--configs', choices=sorted(CONFIGS), default='all')
    ap.add_argument('--steps', type=int, default=20)
    args = ap.parse_args(argv)
    from tfpipe import datasets
    with tempfile.TemporaryDirectory() as data_dir:
        for name in ('tfpipe_shapes', 'tfpipe_reverse'):
            datasets.prepare(name, data_dir)
        print(f'{"model":36s} {"overrides":38s} predicted  measured  predicted/measured')
        for model, override in CONFIGS[args.configs]:
            predicted, measured = predicted_and_measured(model, override, data_dir, args.steps)
            print(f'{model:36s} {override or "-":38s} {predicted:6.2f} MiB {measured:6.2f} MiB'
                  f'  {predicted / measured:.3f}', flush=True)


if __name__ == '__main__':
    main()
