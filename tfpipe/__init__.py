"""tfpipe: config-driven TensorFlow 2 training with GPipe pipeline parallelism.

`import tfpipe` loads no TensorFlow by itself. It first applies TensorFlow's
start-up settings (tfpipe/runtime_defaults.py), which only count before
TensorFlow loads; the names below load their modules, and TensorFlow, on first
use. So a program that imports tfpipe before TensorFlow runs on the trainer's
kernels and allocator, and a process that never builds a model (the launcher of
local trainer clients) stays small.
"""
import importlib
import importlib.util

from tfpipe import runtime_defaults

runtime_defaults.apply()

_NAMES = {'BaseLayer': 'tfpipe.base_layer', 'LayerMeta': 'tfpipe.base_layer',
          'configure_logical_cpus': 'tfpipe.devices', 'configure_threads': 'tfpipe.devices',
          'InstantiableParams': 'tfpipe.hyperparams', 'Params': 'tfpipe.hyperparams',
          'PipeliningLayer': 'tfpipe.pipeline.pipelining_layer'}

__all__ = sorted(_NAMES) + ['fprop_context', 'layers']


def __getattr__(name: str):
    """A public name or a submodule (`tfpipe.layers`), imported on first use."""
    if name in _NAMES:
        value = getattr(importlib.import_module(_NAMES[name]), name)
    elif importlib.util.find_spec(f'{__name__}.{name}') is not None:
        value = importlib.import_module(f'{__name__}.{name}')
    else:
        raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
    globals()[name] = value
    return value
