"""Prints the thread pools and logical CPUs TensorFlow got, for tests/test_threads.py.

Run as `python -m tests.thread_probe trainer|library ARGS...` in a process whose
TensorFlow runtime starts here (a fresh interpreter, or one forked before the runtime
starts, as tests/trainer_forkserver.py forks it): the pools are sized once, when the
runtime starts.

- `trainer [--fake_gpu] FLAGS...`: the trainer's device set-up (trainer/main.py
  `_configure_devices`) under its FLAGS; `--fake_gpu` makes TensorFlow list one GPU, to
  take the trainer's GPU branch on a machine without GPUs.
- `library [--inter_set_before N] [INTRA INTER]`: `tfpipe.configure_logical_cpus(3, ...)`
  (`None` for a count left to tfpipe), after the program sized the inter-op pool itself
  with `--inter_set_before`.

Prints: intra-op threads, inter-op threads, logical CPUs.
"""
import sys

import tensorflow as tf


def trainer(args: list[str]) -> None:
    from absl import flags
    if args[:1] == ['--fake_gpu']:
        args = args[1:]
        physical = tf.config.list_physical_devices
        tf.config.list_physical_devices = lambda kind=None: (
            ['fake GPU'] if kind == 'GPU' else physical(kind))
    from trainer import main
    flags.FLAGS(['trainer'] + args)
    main._configure_devices()


def library(args: list[str]) -> None:
    import tfpipe
    if args[:1] == ['--inter_set_before']:  # a program that sized a pool itself keeps it
        tf.config.threading.set_inter_op_parallelism_threads(int(args[1]))
        args = args[2:]
    tfpipe.configure_logical_cpus(3, *[None if a == 'None' else int(a) for a in args])


if __name__ == '__main__':
    {'trainer': trainer, 'library': library}[sys.argv[1]](sys.argv[2:])
    print(tf.config.threading.get_intra_op_parallelism_threads(),
          tf.config.threading.get_inter_op_parallelism_threads(),
          len(tf.config.list_logical_devices('CPU')))
