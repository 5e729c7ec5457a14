"""The Transformer LM on 4 logical CPUs as K=4,T=1 vs K=2,T=2 vs K=1,T=4 (issue 27).

One process, the BFC allocator on (the only CPU allocator with peak statistics; all
logical CPUs share it, so its peak is the 4 devices' together). For each layout the
same LM (lm.pystdlib.TransformerLM's sizes: width 64, 4 heads, 4 blocks, rows of 128
bytes, batch 16, M=4, recompute 'never') runs the training step (ForwardBackward +
SGD). Printed per layout:

- step time: median of interleaved rounds (the layouts take turns, so machine load
  hits them alike), as a ratio to K=4,T=1;
- host peak of a steady step (all devices), and the largest per-device share of the
  weights (+ their gradients and Adam's two slots: x4), read from where each
  variable lives;
- bytes all-reduced per step, counted in the traced step (cell_functions=False, so
  every micro-batch's ops are in the graph; each collective once, by instance key,
  its payload = one member's output), against the prediction: per block and
  micro-batch two activation all-reduces forward (attention's and the feed-forward's
  partial sums) and two backward (their input copies' gradients), [b, t, d] each,
  i.e. 4 * blocks * batch * length * d * 4 bytes per step; plus the embedding's
  lookup (forward), the logits' input copies (backward) and the cross-entropy's three
  [b, t] collectives (the max as an all-gather of T values).

Run (from the repository root):
    PYTHONPATH=. python benchmarks/tensor_parallel_lm_benchmark.py [--rounds=5]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault('TF_CPU_ALLOCATOR_USE_BFC', 'true')
os.environ.setdefault('TF_ENABLE_ONEDNN_OPTS', '1')

import tfpipe  # noqa: E402

tfpipe.configure_logical_cpus(4)

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfpipe import bodies, fprop_context, inputs  # noqa: E402
from tfpipe.base_layer import flatten_by_path  # noqa: E402
from tfpipe.pipeline.pipelining_layer import PipeliningLayer  # noqa: E402
from tfpipe.tasks.lm import LanguageModel  # noqa: E402

LAYOUTS = [(4, 1), (2, 2), (1, 4)]  # (K, T)
WIDTH, HIDDEN, HEADS, BLOCKS = 64, 256, 4, 4
BATCH, LENGTH, MICRO = 16, 128, 4
COLLECTIVES = ('CollectiveReduce', 'CollectiveGather', 'CollectiveReduceV2',
               'CollectiveGatherV2')


def lm_task(k: int, t: int, cell_functions: bool = True) -> LanguageModel:
    body = bodies.transformer_lm_body(inputs.BYTE_VOCAB_SIZE, LENGTH, WIDTH, HIDDEN, HEADS,
                                      BLOCKS)
    p = LanguageModel.Params()
    p.pipeline = PipeliningLayer.Params().Set(
        name='pipe', body=body, num_cells=k, num_micro_batches=MICRO, recompute='never',
        tensor_parallel=t, tied_weights=dict(bodies.TRANSFORMER_TIES),
        cell_functions=cell_functions)
    return p.Instantiate()


def batch() -> dict:
    rng = np.random.default_rng(0)
    ids = rng.integers(2, inputs.BYTE_VOCAB_SIZE, size=[BATCH, LENGTH + 1])
    return {'inputs': tf.constant(ids[:, :-1], tf.int32),
            'targets': tf.constant(ids[:, 1:], tf.int32),
            'segment_ids': tf.ones([BATCH, LENGTH], tf.int32),
            'positions': tf.tile(tf.range(LENGTH)[None], [BATCH, 1])}


def step_fn(task: LanguageModel, data: dict):
    variables = task.VariablesByPath()

    @tf.function
    def step():
        with fprop_context.training(step=1):
            loss, grads = task.ForwardBackward(task.theta, data)
        flat = flatten_by_path(grads, task.path)
        for path, var in variables.items():
            var.assign_sub(0.01 * tf.convert_to_tensor(flat[path]))
        return loss
    return step


def measured_bytes(k: int, t: int, data: dict) -> int:
    task = lm_task(k, t, cell_functions=False)
    graph = step_fn(task, data).get_concrete_function().graph
    seen, total = set(), 0
    for op in graph.get_operations():
        if op.type in COLLECTIVES:
            key = op.get_attr('instance_key')
            if key not in seen:
                seen.add(key)
                out = op.outputs[0]
                total += out.shape.num_elements() * out.dtype.size
    return total


def predicted_bytes(t: int) -> tuple[int, int]:
    """(the blocks' 4 activation all-reduces per block per micro-batch, everything)."""
    if t == 1:
        return 0, 0
    activation = BATCH * LENGTH * WIDTH * 4  # summed over the micro-batches
    blocks = 4 * BLOCKS * activation
    positions = BATCH * LENGTH * 4
    return blocks, blocks + 2 * activation + positions * (t + 2)


def per_device_weight_bytes(task: LanguageModel) -> dict[str, int]:
    out: dict[str, int] = {}
    for var in task.VariablesByPath().values():
        device = tf.DeviceSpec.from_string(var.device)
        name = f'CPU:{device.device_index}'
        out[name] = out.get(name, 0) + var.shape.num_elements() * var.dtype.size
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument('--rounds', type=int, default=5)
    args = parser.parse_args()
    data = batch()
    tasks = {layout: lm_task(*layout) for layout in LAYOUTS}
    steps = {layout: step_fn(task, data) for layout, task in tasks.items()}
    peaks = {}
    for layout, step in steps.items():
        step()  # trace and warm up
        tf.config.experimental.reset_memory_stats('CPU:0')
        step().numpy()
        peaks[layout] = tf.config.experimental.get_memory_info('CPU:0')['peak']
    times = {layout: [] for layout in LAYOUTS}
    for _ in range(args.rounds):
        for layout, step in steps.items():
            start = time.perf_counter()
            step().numpy()
            times[layout].append(time.perf_counter() - start)
    base = statistics.median(times[LAYOUTS[0]])
    print(f'LM width {WIDTH}, {HEADS} heads, {BLOCKS} blocks, batch {BATCH} x {LENGTH}, '
          f'M={MICRO}, 4 logical CPUs, {args.rounds} interleaved rounds')
    print('layout      step (ratio)      host peak  max weights/device (x4 w+g+Adam)  '
          'all-reduced/step: measured  predicted blocks  predicted total')
    for layout in LAYOUTS:
        k, t = layout
        median = statistics.median(times[layout])
        weights = max(per_device_weight_bytes(tasks[layout]).values())
        measured = measured_bytes(k, t, data)
        blocks, total = predicted_bytes(t)
        print(f'K={k},T={t}   {median * 1e3:7.1f} ms ({median / base:4.2f})  '
              f'{peaks[layout] / 2 ** 20:7.1f} MiB  {weights / 2 ** 20:6.2f} MiB '
              f'({4 * weights / 2 ** 20:6.2f} MiB)            {measured / 2 ** 20:8.2f} MiB  '
              f'{blocks / 2 ** 20:8.2f} MiB  {total / 2 ** 20:8.2f} MiB')


if __name__ == '__main__':
    main()
