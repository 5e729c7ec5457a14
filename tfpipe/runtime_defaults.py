"""TensorFlow settings tfpipe measured better, applied before TensorFlow loads.

TensorFlow reads both variables once, when it loads, so they are set by the
first tfpipe import that comes before TensorFlow's: `import tfpipe` in a user's
script (the README's library example) and the trainer's entry points alike, so
a library user's step runs on the same kernels and allocator as the trainer's.
A variable the user set wins.

- `TF_ENABLE_ONEDNN_OPTS=1`: oneDNN's CPU kernels, which TensorFlow 2.21 turns
  on by itself only on some CPUs. Without them a convolution's backward
  allocates an L3-sized scratch buffer per call (AmoebaNetPipe's peak 63 -> 11
  MiB) and a Transformer's micro-batched step takes 1.1x the time. The MLP of
  issue 26 (8 x Dense(1024)) runs within 5% of Eigen's step or faster with them
  (measured side by side; Dense's input gradient, tfpipe/layers/dense.py;
  docs/memory.md, benchmarks/README.md).
- `TF_CPU_ALLOCATOR_USE_BFC=true`: the CPU allocator that keeps peak
  statistics (tfpipe/memory_stats.py), measured at the same step time.

When TensorFlow was imported first and left oneDNN off, it is too late to
change: `apply` says so in one warning line with the fix.
"""
from __future__ import annotations

import os
import sys
import warnings
from typing import Mapping

DEFAULTS = {'TF_ENABLE_ONEDNN_OPTS': '1', 'TF_CPU_ALLOCATOR_USE_BFC': 'true'}
LATE_IMPORT_WARNING = (
    'tfpipe: TensorFlow was imported before tfpipe with oneDNN\'s CPU kernels off, so a '
    'convolution\'s backward takes up to 5x the memory and a Transformer\'s step 1.1x the '
    'time (docs/pipeline_layer.md, "Speed"): import tfpipe '
    'before TensorFlow, or set TF_ENABLE_ONEDNN_OPTS=1 (0 to keep them off and silence this)')


def apply() -> None:
    """Sets each default the user left unset, or warns when TensorFlow loaded first."""
    if 'tensorflow' not in sys.modules:
        for name, value in DEFAULTS.items():
            os.environ.setdefault(name, value)
        return
    if late_import_warning(os.environ, onednn_enabled()):
        warnings.warn(LATE_IMPORT_WARNING, RuntimeWarning, stacklevel=3)


def late_import_warning(environ: Mapping[str, str], onednn_on: bool) -> bool:
    """Whether a TensorFlow loaded before tfpipe deserves the warning: its oneDNN
    kernels are off and the user did not choose that."""
    return 'TF_ENABLE_ONEDNN_OPTS' not in environ and not onednn_on


def onednn_enabled() -> bool:
    """Whether this process's TensorFlow runs oneDNN's kernels (its own check, which
    knows the CPUs where TensorFlow turns them on by itself)."""
    from tensorflow.python.util import _pywrap_util_port
    return bool(_pywrap_util_port.IsMklEnabled())
