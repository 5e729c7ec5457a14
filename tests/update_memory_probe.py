"""What an optimizer update holds in the host's allocator, in a fresh process (the BFC
allocator, which keeps the statistics, must be on before TensorFlow starts):
python -m tests.update_memory_probe
Prints one JSON line: {'growth': {optimizer: bytes in use after UPDATES updates less
before them}, 'temporaries': [per update of WIDE weights: its peak above the weights,
slots and gradients, in weights]}.

growth: before each update the heap gets holes of 1.5 times a slot's size, each between
two live tensors, as a training step leaves it after its temporaries are freed: a slot
that moved into a new buffer at each update (`assign` adopting the new value's buffer)
would land in one, and the BFC allocator holds and counts the whole chunk (it splits a
free chunk only when it is at least twice the request). A slot updated in place keeps
its buffer.

temporaries: Adam's update of WIDE weights at once, their gradients made in the function
as a training step makes its sums: each weight's update holds a few temporaries of its
size, so how many weights' updates are under way at once sets the update's peak.
"""
import json
import os

os.environ['TF_CPU_ALLOCATOR_USE_BFC'] = 'true'
os.environ.setdefault('TF_ENABLE_ONEDNN_OPTS', '1')  # as the trainer and the test session

import tfpipe  # noqa: E402,F401  (before TensorFlow)
import tensorflow as tf  # noqa: E402

from tfpipe import optimizers  # noqa: E402

SHAPE = [256, 1024]  # 1 MiB in float32, a slot's size
HOLES, UPDATES = 16, 3
WIDE, CALLS = 48, 5
RULES = {'Adam': optimizers.Adam.Params(),
         'SGD': optimizers.SGD.Params().Set(momentum=0.9),
         'RMSProp': optimizers.RMSProp.Params()}


def in_use() -> int:
    return int(tf.config.experimental.get_memory_info('CPU:0')['current'])


def holed_heap() -> list:
    """HOLES free chunks of 1.5 slots, each between two live ones (returned: keep them)."""
    size = SHAPE[0] * SHAPE[1] * 3 // 2
    chunks = [tf.fill([size], 1.0) for _ in range(2 * HOLES + 1)]
    return chunks[::2]  # the others are freed: holes between the kept ones


def growth(rule) -> int:
    variables = {f'w{i}': tf.Variable(tf.ones(SHAPE)) for i in range(2)}
    optimizer = rule.Instantiate()
    optimizer.CreateSlots(variables)
    grads = {path: tf.fill(SHAPE, 0.5) for path in variables}

    @tf.function
    def update():
        optimizer.Apply(tf.constant(0.01), grads, variables)

    update()  # traced, and its first buffers allocated
    kept = holed_heap()
    before = in_use()
    for _ in range(UPDATES):
        update()
    after = in_use()
    del kept
    return after - before


def temporaries() -> list[float]:
    variables = {f'w{i:02d}': tf.Variable(tf.ones(SHAPE)) for i in range(WIDE)}
    optimizer = RULES['Adam'].Instantiate()
    optimizer.CreateSlots(variables)
    weight = SHAPE[0] * SHAPE[1] * 4

    @tf.function
    def update():
        grads = {path: var.read_value() * 1e-3 for path, var in variables.items()}
        optimizer.Apply(tf.constant(0.01), grads, variables)

    update()
    out = []
    for _ in range(CALLS):
        before = in_use()
        tf.config.experimental.reset_memory_stats('CPU:0')
        update()
        peak = tf.config.experimental.get_memory_info('CPU:0')['peak']
        out.append((peak - before) / weight - WIDE)
    return out


def main() -> None:
    print(json.dumps({'growth': {name: growth(rule) for name, rule in RULES.items()},
                      'temporaries': temporaries()}))


if __name__ == '__main__':
    main()
