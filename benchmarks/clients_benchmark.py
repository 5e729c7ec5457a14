"""Trainer clients (one process per replica) vs one trainer process with R replicas.

Side by side in one run, on loopback, SmallConvPipe (K=2, 16 examples per replica, so
the global batch is 16R), each client on 2 logical CPUs, the single client on 2R:
  1. seconds and CPU seconds to the first step, per process, for R = 1, 2, 4 clients
     vs the single client with num_replicas=R (goal: a client's CPU seconds within
     1.3x of R=1, where the single client's grow about R-fold);
  2. ops in each process's traced step for each R (goal: constant for a client);
  3. examples/s of 2 clients vs one client with R=2, and the all-reduce's share of
     the 2-client step (the step's collectives alone, timed by 2 processes);
  4. on paper: step time for R up to 1024 clients of K=8 GPUs with a ring all-reduce.

Run (from the repository root; every process it starts is stopped by PID at exit):
    PYTHONPATH=. TF_CPP_MIN_LOG_LEVEL=2 python benchmarks/clients_benchmark.py   # ~4 min
"""
from __future__ import annotations

import argparse
import atexit
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = 'image.shapes.SmallConvPipe'
PER_REPLICA_BATCH = 16
CPUS_PER_CLIENT = 2
GOAL = 1.3
_PROCS: list[subprocess.Popen] = []


def _stop_all() -> None:
    for proc in _PROCS:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


atexit.register(_stop_all)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def _env() -> dict:
    return {**os.environ, 'PYTHONPATH': REPO, 'TF_CPP_MIN_LOG_LEVEL': '2'}


def _cpu_seconds(pid: int) -> float:
    with open(f'/proc/{pid}/stat') as f:
        fields = f.read().rsplit(')', 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf('SC_CLK_TCK')


class Run:
    """One trainer process: wall and CPU seconds to its first step, then its step rates."""

    def __init__(self, cmd: list[str]):
        self.start = time.time()
        self.proc = subprocess.Popen(cmd, env=_env(), cwd=REPO, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)
        _PROCS.append(self.proc)
        self.first = None  # (seconds, CPU seconds) when step 1 was logged
        self.rates: list[float] = []
        self.tail: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.tail = (self.tail + [line])[-30:]
            if self.first is None and re.search(r'step 1/\d+ ', line):
                self.first = (time.time() - self.start, _cpu_seconds(self.proc.pid))
            rate = re.search(r' ([\d.]+) steps/s', line)
            if rate:
                self.rates.append(float(rate.group(1)))

    def wait(self) -> 'Run':
        self.proc.wait(timeout=900)
        self._reader.join()
        if self.proc.returncode != 0 or self.first is None:
            raise RuntimeError(''.join(self.tail))
        return self


def trainer_cmd(logdir: str, data_dir: str, cpus: int, steps: int, replicas: int,
                *extra: str) -> list[str]:
    return [sys.executable, '-m', 'trainer', f'--model={MODEL}', f'--logdir={logdir}',
            f'--tfds_data_dir={data_dir}', f'--num_logical_cpus={cpus}', '--job=trainer',
            f'--max_steps={steps}', '--gin_bindings=trainer.summary_interval_steps=1',
            f'--gin_bindings=trainer.save_interval_steps={steps}',
            f'--params_override=input.train.batch_size={PER_REPLICA_BATCH * replicas},'
            f'task.pipeline.num_replicas={replicas}', *extra]


def run_clients(root: str, data_dir: str, count: int, steps: int) -> list[Run]:
    """`count` clients, each in a fresh logdir (`root` is fresh per section)."""
    spec = 'trainer=' + ','.join(f'127.0.0.1:{free_port()}' for _ in range(count))
    return [Run(trainer_cmd(os.path.join(root, f'clients{count}_{r}'), data_dir,
                            CPUS_PER_CLIENT, steps, count, f'--task={r}',
                            f'--cluster_spec={spec}'))
            for r in range(count)]


def run_single(root: str, data_dir: str, replicas: int, steps: int) -> Run:
    return Run(trainer_cmd(os.path.join(root, f'single{replicas}'), data_dir,
                           CPUS_PER_CLIENT * replicas, steps, replicas))


def traced_ops(replicas: int, clients: int, data_dir: str) -> int:
    """Ops of one process's traced step (outer graph plus its function library)."""
    import tensorflow as tf
    import model_registry
    from tfpipe import fprop_context
    from tfpipe.pipeline.across_clients import Peers
    from trainer import experiment
    params = model_registry.get_params(MODEL)
    batch = PER_REPLICA_BATCH * max(replicas, clients)
    experiment.apply_overrides(params, [
        ('input.train.batch_size', repr(batch)), ('input.train.data_dir', repr(data_dir)),
        ('task.pipeline.num_replicas', repr(replicas)),
        ('task.pipeline.devices', repr([f'/device:CPU:{i}' for i in range(2 * replicas)]))],
        'ops')
    task = params.task.Instantiate()
    if clients > 1:
        task.pipe.JoinClients(Peers(clients, 0))
    spec = params.input.train.Instantiate().Dataset().element_spec

    @tf.function
    def step(b):
        with fprop_context.training(step=tf.constant(0, tf.int64)):
            return task.ForwardBackward(task.theta, b)

    graph = step.get_concrete_function(spec).graph
    library = graph.as_graph_def().library.function
    return len(graph.get_operations()) + sum(len(f.node_def) for f in library)


def all_reduce_client(task: int, spec: str, rounds: int) -> None:
    """--all_reduce_client: time the 2-client step's collectives alone (packed per cell)."""
    import tfpipe
    tfpipe.configure_logical_cpus(CPUS_PER_CLIENT)
    import tensorflow as tf
    import model_registry
    from tfpipe import clients
    from tfpipe.pipeline import across_clients
    cluster = clients.from_flags(spec, 'trainer', task, {})
    peers = clients.start(cluster, 60)
    pipe = model_registry.get_params(MODEL).task.Instantiate().pipe
    shapes = [[v.shape for v in tf.nest.flatten(cell.read_theta(pipe.theta))]
              for cell in pipe.cells]

    @tf.function
    def reduce_all():
        outs = []
        for cell, cell_shapes in zip(pipe.cells, shapes):
            with tf.device(cell.device):
                grads = [tf.ones(s) for s in cell_shapes]
            outs.append(across_clients.all_reduce_sum(peers, grads, cell.device)[0])
        return tf.add_n([tf.reduce_sum(o) for o in outs])

    for _ in range(3):
        reduce_all()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        float(reduce_all())
        times.append(time.perf_counter() - start)
    print(f'all_reduce_ms {1000 * statistics.median(times):.3f}', flush=True)
    os._exit(0)


def time_all_reduce(rounds: int = 50) -> float:
    spec = 'trainer=' + ','.join(f'127.0.0.1:{free_port()}' for _ in range(2))
    procs = [subprocess.Popen([sys.executable, __file__, f'--all_reduce_client={r}',
                               f'--spec={spec}', f'--rounds={rounds}'], env=_env(), cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
             for r in range(2)]
    _PROCS.extend(procs)
    out = [p.communicate(timeout=300)[0] for p in procs]
    return float(re.search(r'all_reduce_ms ([\d.]+)', out[0]).group(1)) / 1000


def paper_model() -> None:
    """Step time of R clients x K=8 GPUs, each cell's gradients in its own ring of R."""
    params, compute, bandwidth, hop = 1e9, 1.0, 12.5e9, 20e-6
    grad_bytes = 4 * params
    print(f'\n4. On paper: a 1e9-parameter model (float32 gradients, {grad_bytes / 1e9:.0f} GB '
          f'per replica) in K=8 cells, {compute:.1f} s of pipelined compute per step and '
          f'replica (weak scaling: batch grows with R), {bandwidth * 8 / 1e9:.0f} Gb/s per '
          f'host shared by its 8 rings, {hop * 1e6:.0f} us per ring hop, no overlap of '
          'all-reduce and compute:')
    print(f'{"R":>6} {"all-reduce s":>13} {"step s":>8} {"efficiency":>11} '
          f'{"examples/s vs R=1":>18}')
    for r in (1, 2, 8, 64, 256, 1024):
        ring = 0.0 if r == 1 else 2 * (r - 1) / r * grad_bytes / bandwidth + 2 * (r - 1) * hop
        step = compute + ring
        print(f'{r:>6} {ring:>13.3f} {step:>8.3f} {compute / step:>10.0%} '
              f'{r * compute / step:>18.1f}')
    print('The ring moves 2(R-1)/R of the gradient bytes per host whatever R is, so the '
          f'bandwidth term stops growing (at most {2 * grad_bytes / bandwidth:.2f} s here) '
          'and throughput keeps scaling ~R-fold; what grows is the latency term '
          f'2(R-1) x {hop * 1e6:.0f} us ({2 * 1023 * hop:.2f} s at R=1024), which reaches '
          f'the compute time near R = compute / (2 x hop) = {compute / (2 * hop):.0f}. '
          f'Before that, R=1024 replicas of {PER_REPLICA_BATCH} examples make a '
          f'{1024 * PER_REPLICA_BATCH}-example global batch: the optimizer, not the network, '
          'sets the limit.')


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--all_reduce_client', type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument('--spec', default=None, help=argparse.SUPPRESS)
    ap.add_argument('--rounds', type=int, default=50, help=argparse.SUPPRESS)
    ap.add_argument('--steps', type=int, default=12, help='steps per run')
    args = ap.parse_args()
    if args.all_reduce_client is not None:
        all_reduce_client(args.all_reduce_client, args.spec, args.rounds)
    import tfpipe
    tfpipe.configure_logical_cpus(CPUS_PER_CLIENT * 4)  # for the single client's traced step
    from tfpipe import datasets
    root = tempfile.mkdtemp(prefix='tfpipe_clients_bench_')
    data_dir = os.path.join(root, 'tfds')
    datasets.prepare('tfpipe_shapes', data_dir)
    print(f'load before: {os.getloadavg()[0]:.1f}; {os.cpu_count()} cores', flush=True)

    print('\n1. Seconds (CPU seconds) to the first step, per process; clients and the single '
          'client run side by side for each R:')
    print(f'{"R":>3} {"client (max over R)":>22} {"single client R":>18} '
          f'{"client CPU / R=1 client":>24}')
    first_cpu = {}
    for r in (1, 2, 4):
        clients = run_clients(os.path.join(root, 'first'), data_dir, r, 2)
        single = run_single(os.path.join(root, 'first'), data_dir, r, 2)
        for run in [*clients, single]:
            run.wait()
        wall = max(c.first[0] for c in clients)
        cpu = max(c.first[1] for c in clients)
        first_cpu[r] = cpu
        print(f'{r:>3} {wall:>12.1f} s ({cpu:>5.1f}) {single.first[0]:>8.1f} s '
              f'({single.first[1]:>5.1f}) {cpu / first_cpu[1]:>23.2f}x  (goal <= {GOAL}x)',
              flush=True)

    print('\n2. Ops in one process\'s traced step (ForwardBackward, outer graph + functions):')
    for r in (1, 2, 4):
        print(f'   R={r}: a client {traced_ops(1, r, data_dir):>6}   the single client '
              f'{traced_ops(r, 1, data_dir):>6}', flush=True)

    print(f'\n3. Throughput, {args.steps} steps, R=2 (2 x {PER_REPLICA_BATCH} examples):')
    clients = run_clients(os.path.join(root, 'rate'), data_dir, 2, args.steps)
    single = run_single(os.path.join(root, 'rate'), data_dir, 2, args.steps)
    for run in [*clients, single]:
        run.wait()
    batch = 2 * PER_REPLICA_BATCH
    c_rate = statistics.median(clients[0].rates) * batch
    s_rate = statistics.median(single.rates) * batch
    reduce_s = time_all_reduce()
    print(f'   2 clients {c_rate:.1f} examples/s, one client R=2 {s_rate:.1f} examples/s: '
          f'ratio {c_rate / s_rate:.2f}')
    print(f'   the step\'s all-reduces alone (2 processes): {reduce_s * 1000:.1f} ms = '
          f'{reduce_s * c_rate / batch:.0%} of the 2-client step')
    paper_model()
    print(f'\nload after: {os.getloadavg()[0]:.1f}')


if __name__ == '__main__':
    main()
