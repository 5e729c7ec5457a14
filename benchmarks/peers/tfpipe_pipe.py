"""tfpipe's side of peers_benchmark.py: PipeliningLayer through the library, as a user runs it.

Run by the parent with the project's Python from the repository root (PYTHONPATH=.), one
process per kernel setting (TF_ENABLE_ONEDNN_OPTS in the environment) and thread setting:
`--threads=default` is tfpipe's own choice on logical CPUs, `intra/inter` passes both pools to
`configure_logical_cpus` (0 is TensorFlow's default). The README's library order: import
tfpipe, configure the logical CPUs, then build; the step is library_defaults_benchmark.py's.
"""
from __future__ import annotations

import steps

args = steps.parse_args(__doc__.split('\n\n')[0])

import tfpipe  # noqa: E402  (before TensorFlow, as the README shows)

threads = {} if args.threads == 'default' else dict(
    zip(('intra_op_threads', 'inter_op_threads'), (int(v) for v in args.threads.split('/'))))
tfpipe.configure_logical_cpus(8, **threads)

import tensorflow as tf  # noqa: E402
from tfpipe import runtime_defaults  # noqa: E402
from tfpipe_step import build_step  # noqa: E402

x = tf.random.normal([steps.BATCH, steps.WIDTH])
for cells, micro in steps.configs(args.configs):
    step = build_step(cells, micro)
    ms = steps.median_step_ms(lambda: step(x).numpy(), args.warmup, args.steps)
    steps.report(cells, micro, ms, onednn=runtime_defaults.onednn_enabled(),
                 threads=[tf.config.threading.get_intra_op_parallelism_threads(),
                          tf.config.threading.get_inter_op_parallelism_threads()])
