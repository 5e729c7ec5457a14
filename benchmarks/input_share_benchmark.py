"""Input bytes per trainer client per step at R = 1, 2, 4 clients.

    PYTHONPATH=. python benchmarks/input_share_benchmark.py [--steps=N]

Client 0's input iterator (`TfdsInput.Iterator(share)`, the share the trainer gives
it: `replicas.examples_of_group`) for image.shapes.SmallConvPipe and
image.shapes.AmoebaNetPipe (tfpipe_shapes, generated here), side by side, the R
values interleaved so that the machine's load falls on all of them alike. Per
client and step:

- `fed`: bytes of the decoded, preprocessed batch it feeds to its step (1/R);
- `decoded`: examples it decodes and preprocesses (1/R);
- `scanned`: stored bytes of the records that pass through its seeded shuffle:
  the whole global batch's, encoded (PNG), for every R. The shuffle order depends
  on every record, so each client still streams them; it decodes only its own;
- `s/step`: the median seconds per batch of the iterator alone (prefetching two
  batches, so mostly the wait for the next), and its ratio to R=1.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import tensorflow_datasets as tfds

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import model_registry  # noqa: E402  pylint: disable=wrong-import-position
from tfpipe import datasets  # noqa: E402  pylint: disable=wrong-import-position
from tfpipe.pipeline import replicas  # noqa: E402  pylint: disable=wrong-import-position

COUNTS = (1, 2, 4)


def stored_bytes_per_example(data_dir: str, split: str) -> float:
    """Mean bytes of a stored example (encoded image + label) of tfpipe_shapes."""
    builder = tfds.builder('tfpipe_shapes', data_dir=data_dir)
    ds = builder.as_dataset(split=split, decoders={'image': tfds.decode.SkipDecoding()})
    total = count = 0
    for ex in ds:
        total += len(ex['image'].numpy()) + ex['label'].dtype.size
        count += 1
    return total / count


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument('--steps', type=int, default=100)
    args = parser.parse_args()
    data_dir = tempfile.mkdtemp(prefix='input_share_')
    datasets.prepare('tfpipe_shapes', data_dir)
    for model in ('image.shapes.SmallConvPipe', 'image.shapes.AmoebaNetPipe'):
        params = model_registry.get_params(model)
        train = params.input.train.Copy().Set(data_dir=data_dir)
        micro = params.task.pipeline.num_micro_batches
        tfds_input = train.Instantiate()
        scanned = stored_bytes_per_example(data_dir, train.split) * train.batch_size
        iterators = {}
        for count in COUNTS:
            share = replicas.examples_of_group(train.batch_size, micro, count, 0, model)
            iterators[count] = (share, tfds_input.Iterator(share if count > 1 else None))
            next(iterators[count][1])  # builds the tf.data pipeline: not measured
        seconds = {count: [] for count in COUNTS}
        for _ in range(args.steps):
            for count in COUNTS:
                begin = time.perf_counter()
                next(iterators[count][1])
                seconds[count].append(time.perf_counter() - begin)
        median = {count: statistics.median(times) for count, times in seconds.items()}
        print(f'{model}: global batch {train.batch_size}, {micro} micro-batches per replica, '
              f'{args.steps} steps')
        print('| R | examples decoded | fed bytes | scanned bytes | s/step | fed / R=1 | '
              's/step / R=1 |')
        print('|---|---|---|---|---|---|---|')
        base_bytes = iterators[1][1].batch_bytes
        for count in COUNTS:
            share, iterator = iterators[count]
            print(f'| {count} | {len(share)} | {iterator.batch_bytes} | {scanned:.0f} | '
                  f'{median[count] * 1000:.2f} ms | {iterator.batch_bytes / base_bytes:.2f}x | '
                  f'{median[count] / median[1]:.2f}x |')


if __name__ == '__main__':
    main()
