"""tfpipe's side of peers_lm_benchmark.py: lm.pystdlib.GPT2SmallShapedLM's training step.

The registered model's task at K cells of `lm_shape.blocks_per_cell(K)` blocks (the
registered balance at K=4), M micro-batches, recompute always, on 8 logical CPUs; one
step is the task's ForwardBackward on a batch of its own input (packed pystdlib rows)
and the trainer's update (trainer.guarded_update with tfpipe's Adam, no clipping, as the
torch worker), in one tf.function. `--threads` as tfpipe_pipe.py.
"""
from __future__ import annotations

import steps

args = steps.parse_args(__doc__.split('\n\n')[0])

import tfpipe  # noqa: E402  (before TensorFlow, as the README shows)

threads = {} if args.threads == 'default' else dict(
    zip(('intra_op_threads', 'inter_op_threads'), (int(v) for v in args.threads.split('/'))))
tfpipe.configure_logical_cpus(8, **threads)

import tensorflow as tf  # noqa: E402

import lm_shape  # noqa: E402
import model_registry  # noqa: E402
from tfpipe import fprop_context, optimizers  # noqa: E402
from tfpipe.base_layer import flatten_by_path  # noqa: E402
from trainer.guarded_update import guarded_update  # noqa: E402

MODEL = 'lm.pystdlib.GPT2SmallShapedLM'


def build_step(cells: int, micro: int, batch: dict):
    """The task at K=cells, M=micro and its step (ForwardBackward, then Adam)."""
    params = model_registry.get_params(MODEL)
    blocks = lm_shape.blocks_per_cell(cells)
    # Embedding and positions join cell 0; unpack, final LayerNorm and logits the last.
    balance = [n + 2 * (k == 0) + 3 * (k == cells - 1) for k, n in enumerate(blocks)]
    params.task.pipeline.Set(balance=balance, num_micro_batches=micro, recompute='always')
    task = params.task.Instantiate()
    optimizer = optimizers.Adam.Params().Instantiate()
    variables = {p: v for p, v in task.pipe.VariablesByPath().items() if v.trainable}
    optimizer.CreateSlots(variables)
    step_var = tf.Variable(0, dtype=tf.int64)

    @tf.function
    def step():
        with fprop_context.training(step=step_var):
            loss, grads = task.ForwardBackward(task.theta, batch)
        guarded_update(loss, [flatten_by_path(grads['pipe'], task.pipe.path)], None,
                       [optimizer], [variables], tf.constant(lm_shape.LEARNING_RATE),
                       step_var)
        return loss
    return step, params


def main() -> None:
    params = model_registry.get_params(MODEL)
    batch = next(iter(params.input.train.Instantiate().Dataset()))
    assert batch['inputs'].shape.as_list() == [lm_shape.BATCH, lm_shape.LENGTH], batch['inputs']
    for cells, micro in steps.configs(args.configs):
        step, _ = build_step(cells, micro, batch)
        ms = steps.median_step_ms(lambda: step().numpy(), args.warmup, args.steps)
        steps.report(cells, micro, ms, threads=[
            tf.config.threading.get_intra_op_parallelism_threads(),
            tf.config.threading.get_inter_op_parallelism_threads()])


main()
