"""The worker job: one TensorFlow server that runs the cells the trainer places on it.

    python -m trainer --job=worker --task=0 --cluster_spec=worker=HOST:PORT,HOST:PORT \
        --run_locally=cpu --num_logical_cpus=4

This is the single-client form, chosen explicitly by --job=worker (TF_CONFIG
without it makes trainer clients, tfpipe/clients.py). A worker holds no model,
no params and no logdir: the trainer connects to it and sends it the cells'
variables and functions. It serves until SIGTERM or SIGINT and then exits 0. Its devices are its GPUs, or `--num_logical_cpus` logical CPUs
with `--run_locally=cpu` (the default when it has no GPU).
"""
from __future__ import annotations

import os
import signal
import sys
import threading
from typing import NoReturn, Optional

from absl import logging

from tfpipe import cluster as cluster_lib


def serve(cluster: cluster_lib.Cluster, run_locally: Optional[str], num_logical_cpus: int,
          intra_op_threads: Optional[int] = None,
          inter_op_threads: Optional[int] = None) -> NoReturn:
    """Starts this task's server and blocks until SIGTERM/SIGINT, then exits 0."""
    import tensorflow as tf
    use_cpus = run_locally == 'cpu' or (
        run_locally is None and not tf.config.list_physical_devices('GPU'))
    stop = threading.Event()
    # Installed before the server starts, so a signal that arrives during start-up
    # still ends the worker cleanly. The wait below wakes on signals; the server's
    # own join() is a C++ call that would never let the handler run.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: stop.set())
    server = cluster_lib.start_server(cluster, num_logical_cpus if use_cpus else None,
                                      intra_op_threads, inter_op_threads)
    address = cluster.jobs[cluster.task_type][cluster.task_index]
    logging.info('worker task %d serving at %s (%s); stop with SIGTERM or SIGINT',
                 cluster.task_index, address, server.target)
    # Serving forever is this job's purpose, but a worker started where clients were
    # meant (a cluster manager's TF_CONFIG plus --job=worker) would look like a hang:
    # say what it waits for.
    print(f'worker task {cluster.task_index} serving at {address} for the single-client form: '
          'it trains nothing itself and waits, until SIGTERM or SIGINT, for one trainer '
          'started with --cluster_spec=worker=... (for a trainer per process, drop '
          '--job=worker: docs/clients.md)', file=sys.stderr)
    print(cluster_lib.exposure_notice(address, f'worker task {cluster.task_index}'),
          file=sys.stderr, flush=True)
    while not stop.wait(1.0):
        pass
    logging.info('worker task %d stopping', cluster.task_index)
    sys.stderr.flush()
    # A tf.distribute.Server cannot be stopped from Python (Server.stop is not
    # implemented) and its threads keep the interpreter alive: leave directly.
    os._exit(0)
