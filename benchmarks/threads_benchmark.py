"""Trainer steps/s of the default model under TensorFlow thread-pool settings, side by side.

    PYTHONPATH=. python benchmarks/threads_benchmark.py            # ~15 minutes on 2 cores
    PYTHONPATH=. python benchmarks/threads_benchmark.py --quick    # ~5 minutes
    PYTHONPATH=. python benchmarks/threads_benchmark.py --settings=0/0,1/2,2/2 --rounds=12

Thread pools are process-wide and fixed when TensorFlow starts, so each setting gets its own
child process. A child configures devices exactly as `python -m trainer --run_locally=cpu` does
(`trainer.main._configure_devices` with the thread flags; the `default` setting passes none, so
it measures tfpipe's current default), builds the trainer's own `Trainer` for
image.shapes.AmoebaNetPipe (K=4, M=4, recompute, 8 logical CPUs), traces and warms up its step,
then waits. The parent runs rounds: in each round every child runs `--steps` training steps
(next batch from the trainer's input, the trainer's `_step`, loss and norm read back, as the
trainer's loop does) one child at a time, in a new random order every round (so no setting
always follows the same one), so a slow phase of the shared machine hits every setting.

Reported per setting: steps/s median and quartiles over rounds; process CPU seconds per wall
second (cores kept busy) and per step; the per-round ratio of the round's best steps/s to this
setting's (1.00 = the best of that round), median and quartiles; and this setting's steps/s
over TensorFlow's default (0/0) in the same round. `default` is the same setting as one of the
explicit ones (tfpipe's default: `devices.default_threads`, 1/2 on a 2-core host), so the gap
between those two rows is the noise floor of the run.

The machine is shared: other processes' load steals cores, and a setting with more threads
loses less of its share to them than one that runs single-threaded ops, so a high load average
biases the comparison towards more threads. The load average is printed per round; CPU seconds
per step are less sensitive to it.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import select
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = 'image.shapes.AmoebaNetPipe'
# 'intra/inter' as the trainer's --intra_op_threads / --inter_op_threads; 'default' passes
# neither (tfpipe's default on logical CPUs); 0 is TensorFlow's own default for that pool.
DEFAULT_SETTINGS = 'default,0/0,1/2,2/2,1/4,2/4,1/8,1/16'
READY_TIMEOUT = 900  # seconds for a child to build, trace and warm up on a loaded machine
# Between two settings' turns: the previous child's idle thread pools stop spinning, so they
# do not slow down the next one (with a fixed rotation, one setting would always follow the
# one with the most threads).
SETTLE_SECONDS = 0.3


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--settings', default=DEFAULT_SETTINGS,
                    help='comma list of intra/inter thread counts, or "default"')
    ap.add_argument('--rounds', type=int, default=None, help='default 40 (--quick: 10)')
    ap.add_argument('--steps', type=int, default=5,
                    help='training steps per setting per round: few, so that the settings '
                    'are compared within seconds of each other')
    ap.add_argument('--warmup', type=int, default=10, help='steps after tracing, discarded')
    ap.add_argument('--quick', action='store_true')
    ap.add_argument('--num_logical_cpus', type=int, default=8)
    ap.add_argument('--data_dir', default=os.path.expanduser('~/tensorflow_datasets'))
    ap.add_argument('--child', default=None, help='internal: the setting this child measures')
    args = ap.parse_args(argv)
    args.rounds = args.rounds or (10 if args.quick else 40)
    return args


def thread_flags(setting: str) -> list[str]:
    """'1/2' -> the trainer's flags; 'default' -> none."""
    if setting == 'default':
        return []
    try:
        intra, inter = (int(v) for v in setting.split('/'))
    except ValueError:
        raise SystemExit(f'error: setting {setting!r} is not INTRA/INTER or default: write '
                         'e.g. --settings=default,0/0,1/2') from None
    return [f'--intra_op_threads={intra}', f'--inter_op_threads={inter}']


# -- child: one thread setting, the trainer's own step -------------------------------------

def child(args) -> None:
    global _PROTOCOL
    _PROTOCOL = os.fdopen(os.dup(1), 'w')  # answers to the parent; anything else printed,
    os.dup2(2, 1)                          # by Python or by C++ (dataset generation), to stderr
    os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
    from absl import flags
    from trainer import main
    flags.FLAGS(['trainer', '--run_locally=cpu', f'--num_logical_cpus={args.num_logical_cpus}',
                 *thread_flags(args.child)])
    main._configure_devices()  # noqa: SLF001 - exactly the trainer's device and thread setup
    import tensorflow as tf
    from trainer import experiment, runtime_options, train_job
    tf.get_logger().setLevel('ERROR')
    params = experiment.load_params(MODEL)
    params.input.train.data_dir = args.data_dir
    trainer = train_job.Trainer(params, tempfile.mkdtemp(prefix='threads_bench_'),
                                runtime_options.RuntimeOptions())
    t0 = time.perf_counter()

    def run(steps: int) -> None:
        for _ in range(steps):
            loss, norm, *_ = trainer._step(next(trainer.iterator))  # noqa: SLF001
            float(loss), float(norm)

    run(1 + args.warmup)
    _say(ready=True, seconds=time.perf_counter() - t0,
         intra=tf.config.threading.get_intra_op_parallelism_threads(),
         inter=tf.config.threading.get_inter_op_parallelism_threads())
    for line in sys.stdin:
        steps = int(line)
        w0, c0 = time.perf_counter(), time.process_time()
        run(steps)
        _say(seconds=time.perf_counter() - w0, cpu=time.process_time() - c0)
    os._exit(0)  # the parent is gone: skip TensorFlow's teardown, which can take a while


_PROTOCOL = sys.stdout


def _say(**record) -> None:
    print(json.dumps(record), file=_PROTOCOL, flush=True)


# -- parent: rounds over the children ------------------------------------------------------

class Child:
    def __init__(self, setting: str, args):
        env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get('PYTHONPATH', ''),
                   TF_CPP_MIN_LOG_LEVEL='2')
        for name in ('TF_NUM_INTRAOP_THREADS', 'TF_NUM_INTEROP_THREADS'):
            env.pop(name, None)  # the settings, not the caller's environment, size the pools
        self.setting = setting
        self.log = tempfile.TemporaryFile('w+')  # a pipe could fill up and block the child
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), f'--child={setting}',
             f'--num_logical_cpus={args.num_logical_cpus}', f'--warmup={args.warmup}',
             f'--data_dir={args.data_dir}'],
            cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self.log, text=True)

    def read(self, timeout: float) -> dict:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ''
        if not line:
            self.stop()
            self.log.seek(0)
            raise RuntimeError(f'setting {self.setting}: child gave no answer; its stderr '
                               f'ends with:\n{self.log.read()[-3000:]}')
        return json.loads(line)

    def steps(self, n: int, timeout: float) -> dict:
        self.proc.stdin.write(f'{n}\n')
        self.proc.stdin.flush()
        return self.read(timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()  # this child's own PID
            self.proc.wait()


def quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) < 2:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4)
    return q1, q2, q3


def parent(args) -> int:
    settings = args.settings.split(',')
    for s in settings:
        thread_flags(s)  # refuse a malformed setting before starting anything
    print(f'# threads: trainer steps/s of {MODEL} (K=4, M=4, recompute), '
          f'{args.num_logical_cpus} logical CPUs on {os.cpu_count()} cores; {args.rounds} '
          f'rounds x {args.steps} steps per setting, order shuffled each round', flush=True)
    children = []
    try:
        children.append(Child(settings[0], args))  # alone: it may generate the dataset
        answers = [children[0].read(READY_TIMEOUT)]
        children += [Child(s, args) for s in settings[1:]]
        answers += [c.read(READY_TIMEOUT) for c in children[1:]]
        for c, ready in zip(children, answers):
            print(f'  {c.setting:<8} ready in {ready["seconds"]:.0f} s: TensorFlow reads back '
                  f'intra={ready["intra"]} inter={ready["inter"]}', flush=True)
        rates = {s: [] for s in settings}
        cores = {s: [] for s in settings}
        loads = []
        shuffle = random.Random(0)
        for r in range(args.rounds):
            order = list(children)
            shuffle.shuffle(order)
            for c in order:
                time.sleep(SETTLE_SECONDS)
                out = c.steps(args.steps, READY_TIMEOUT)
                rates[c.setting].append(args.steps / out['seconds'])
                cores[c.setting].append(out['cpu'] / out['seconds'])
            loads.append(os.getloadavg()[0])
            best = max(rates[s][-1] for s in settings)
            print(f'  round {r + 1:>2}: load {loads[-1]:4.2f}  ' +
                  '  '.join(f'{s} {best / rates[s][-1]:.2f}' for s in settings), flush=True)
    finally:
        for c in children:
            c.stop()
    report(settings, rates, cores, loads)
    return 0


def report(settings: list[str], rates: dict, cores: dict, loads: list[float]) -> None:
    rounds = len(loads)
    ratios = {s: [max(rates[t][r] for t in settings) / rates[s][r] for r in range(rounds)]
              for s in settings}
    base = '0/0' if '0/0' in settings else None
    print(f'\n{"setting":<8} {"steps/s median [q1, q3]":<24} {"cores":>5} {"CPU s/step":>10}  '
          f'{"best/this per round [q1, q3]":<28} {"best":>4}' +
          ('  this/TF default per round [q1, q3]' if base else ''))
    for s in sorted(settings, key=lambda s: statistics.median(ratios[s])):
        q1, med, q3 = quartiles(rates[s])
        r1, rmed, r3 = quartiles(ratios[s])
        wins = sum(1 for v in ratios[s] if v == 1.0)
        cpu = statistics.median(c / r for c, r in zip(cores[s], rates[s]))
        line = (f'{s:<8} {med:6.2f} [{q1:5.2f}, {q3:5.2f}]{"":<6} '
                f'{statistics.median(cores[s]):5.2f} {cpu:10.3f}  '
                f'{rmed:5.3f} [{r1:5.3f}, {r3:5.3f}]{"":<8} {wins:>4}')
        if base:
            b1, bmed, b3 = quartiles([rates[s][r] / rates[base][r] for r in range(rounds)])
            line += f'  {bmed:5.3f} [{b1:5.3f}, {b3:5.3f}]'
        print(line)
    print(f'load average per round: {" ".join(f"{v:.1f}" for v in loads)} (median '
          f'{statistics.median(loads):.1f}) on {os.cpu_count()} cores; a high load favours '
          'settings with more threads (they keep a larger share of the contended cores); '
          'CPU s/step (process CPU time per step) is less sensitive to that')


def main() -> int:
    args = parse_args()
    if args.child:
        child(args)
        return 0
    return parent(args)


if __name__ == '__main__':
    sys.exit(main())
