"""A step that overlaps a checkpoint save vs a normal step: synchronous save, tfpipe's
writer thread (tfpipe/checkpoint_writer.py, the trainer's default) and TensorFlow's
`CheckpointOptions(experimental_enable_async_checkpoint=True)`, side by side in one run.

    PYTHONPATH=. python benchmarks/async_checkpoint_benchmark.py                # GPT-2 small
    PYTHONPATH=. python benchmarks/async_checkpoint_benchmark.py --rounds=3 \\
        --model=lm.pystdlib.TransformerLM

One process builds the trainer's own `Trainer` for the model (devices configured as
`python -m trainer --run_locally=cpu` does), traces and warms up its step. Each round, in
a new random order, runs: a normal step; `sync` (the save, then a step); `writer` (the
snapshot and the thread's start, then a step, then the wait for the write, its thread at
nice 19 as the trainer's); `writer_nice0` (the same at the caller's priority); `tf_async`
(TensorFlow's async save of the same checkpoint object, then a step, then its sync). The
figure per variant is (the time the loop was held by the save + the next step) over the
round's normal step, median over rounds: the issue's goal is <= 1.2x. Also printed: how
long the loop was held (the snapshot, or the whole synchronous write), how long each write
took in all, and the host copy an asynchronous save holds while it writes (the state's
bytes).

Measured (2026-11-29 17:46, quiet, load 1.0-2.1, 5 rounds, normal step 3.97 s): sync
1.61x, writer 1.11x (min 1.08), writer_nice0 1.27x, tf_async 1.28x; writes 2.4 s sync,
5.5 s beside the steps at nice 19, 4.9 s at the caller's priority; 1,025 MB of state.

TensorFlow's async variant is here for the comparison only: it copies only objects with
`_copy_trackable_to_cpu`, so tensor-parallel weights and sharded optimizer slots would be
written from their live values (see the writer's docstring); this model has neither.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time

MODEL = 'lm.pystdlib.GPT2SmallShapedLM'


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--model', default=MODEL)
    parser.add_argument('--rounds', type=int, default=2)
    parser.add_argument('--num_logical_cpus', type=int, default=8)
    args = parser.parse_args()
    os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
    from absl import flags
    from trainer import main as trainer_main
    flags.FLAGS(['trainer', '--run_locally=cpu', f'--num_logical_cpus={args.num_logical_cpus}'])
    trainer_main._configure_devices()  # noqa: SLF001 - exactly the trainer's device setup
    import tensorflow as tf
    from tfpipe import checkpoint_writer, checkpoints
    from trainer import experiment, runtime_options, train_job
    tf.get_logger().setLevel('ERROR')

    trainer = train_job.Trainer(experiment.load_params(args.model),
                                tempfile.mkdtemp(prefix='async_ckpt_bench_'),
                                runtime_options.RuntimeOptions(save_max_to_keep=2))
    number = [0]

    def step() -> float:
        begin = time.perf_counter()
        loss, norm, *_ = trainer._step(next(trainer.iterator))  # noqa: SLF001
        float(loss), float(norm)
        return time.perf_counter() - begin

    def next_number() -> int:
        number[0] += 1
        return number[0]

    names = ('sync', 'writer', 'writer_nice0', 'tf_async')
    written: dict[str, list[float]] = {name: [] for name in names}
    held_by: dict[str, list[float]] = {name: [] for name in names}

    def sync() -> float:
        begin = time.perf_counter()
        trainer.manager.save(checkpoint_number=next_number(), options=checkpoints.io_options())
        held = time.perf_counter() - begin
        written['sync'].append(held)
        held_by['sync'].append(held)
        return held + step()

    def own_writer(name: str, nice: int):
        writer = checkpoint_writer.CheckpointWriter(trainer.manager, checkpoints.io_options(),
                                                    True, lambda record: None, nice=nice)

        def run() -> float:
            begin = time.perf_counter()
            writer.save(next_number())
            held = time.perf_counter() - begin
            held_by[name].append(held)
            total = held + step()
            writer.wait()
            written[name].append(time.perf_counter() - begin)
            return total
        return run

    tf_options = tf.train.CheckpointOptions(
        experimental_io_device=checkpoints.io_options().experimental_io_device,
        experimental_enable_async_checkpoint=True)

    def tf_async() -> float:
        begin = time.perf_counter()
        trainer.manager.save(checkpoint_number=next_number(), options=tf_options)
        held = time.perf_counter() - begin
        held_by['tf_async'].append(held)
        total = held + step()
        trainer.manager.sync()
        written['tf_async'].append(time.perf_counter() - begin)
        return total

    t0 = time.perf_counter()
    step()
    print(f'{args.model}: first step {time.perf_counter() - t0:.1f} s (traces)', flush=True)
    _, state_bytes = checkpoint_writer.snapshot(trainer.manager.checkpoint)
    variants = {'sync': sync, 'writer': own_writer('writer', checkpoint_writer.WRITER_NICE),
                'writer_nice0': own_writer('writer_nice0', 0), 'tf_async': tf_async}
    tf_async()  # TensorFlow's first async save copies into new variables: not a measure
    variants['writer']()  # the same for the writer's first snapshot
    step()
    ratios: dict[str, list[float]] = {name: [] for name in variants}
    normals = []
    for _ in range(args.rounds):
        normal = step()
        normals.append(normal)
        for name in random.sample(list(variants), len(variants)):
            ratios[name].append(variants[name]() / normal)
            step()  # whatever the write left behind settles before the next variant
        print(f'round: normal step {normal:.2f} s, ' + ', '.join(
            f'{n} {r[-1]:.2f}x' for n, r in ratios.items()), flush=True)
    print(f'state (model, optimizer slots, step, input position): {state_bytes / 1e6:.0f} MB; '
          f'an asynchronous save holds one more host copy of it while it writes')
    print(f'normal step: median {statistics.median(normals):.2f} s over {args.rounds} rounds')
    print('variant   (held + next step) / normal step   held (s)   write took (s)')
    for name in variants:
        print(f'{name:9} {statistics.median(ratios[name]):.2f}x (min {min(ratios[name]):.2f}, '
              f'max {max(ratios[name]):.2f})               '
              f'{statistics.median(held_by[name][-args.rounds:]):.2f}       '
              f'{statistics.median(written[name][-args.rounds:]):.2f}')
    os._exit(0)  # skip TensorFlow's teardown


if __name__ == '__main__':
    main()
