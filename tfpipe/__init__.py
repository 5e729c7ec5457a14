"""tfpipe: config-driven TensorFlow 2 training with GPipe pipeline parallelism."""
# Before anything below imports TensorFlow: its kernels and allocator are chosen when it
# loads (tfpipe/runtime_defaults.py).
from tfpipe import runtime_defaults

runtime_defaults.apply()

# pylint: disable=wrong-import-position
from tfpipe import fprop_context, layers
from tfpipe.base_layer import BaseLayer, LayerMeta
from tfpipe.devices import configure_logical_cpus, configure_threads
from tfpipe.hyperparams import InstantiableParams, Params
from tfpipe.pipeline.pipelining_layer import PipeliningLayer

__all__ = ['BaseLayer', 'InstantiableParams', 'LayerMeta', 'Params', 'PipeliningLayer',
           'configure_logical_cpus', 'configure_threads', 'fprop_context', 'layers']
