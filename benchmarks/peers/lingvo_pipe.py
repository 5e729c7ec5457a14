"""Lingvo 0.14.2's side of peers_benchmark.py: lingvo.core.gpipe.PipeliningLayer, run with the
Lingvo venv's Python (TensorFlow 2.21, graph mode and a Session, as Lingvo's trainer runs).

The K cells (FeatureExtractionLayer of 8/K FCLayer relu each, even balance) go to K of 8
logical CPUs (a session with device_count CPU=8, Lingvo's cluster with K CPUs per split), as
tfpipe's cells go to its logical CPUs. Lingvo's GPipe runs on StackedRecurrent, which keeps
only the cells' inputs and recomputes the cell in backward: recompute is built in. The step is
tf.gradients of mean(y^2) and plain SGD (assign_sub), one Session.run. Asserts are off
(enable_asserts=False, as for speed). `--threads=intra/inter` sizes the session's pools;
`default` leaves TensorFlow's (0/0). Kernels: TF_ENABLE_ONEDNN_OPTS from the parent.

Lingvo's wheel ships its custom ops (x_ops.so) built for glibc 2.38; where the loader refuses
it (Debian 12 has 2.36), this worker registers a `lingvo.core.ops` that raises on any use. The
GPipe path with asserts off calls none of them, so a step that did would fail, not mislead.
"""
from __future__ import annotations

import sys
import types

import steps

args = steps.parse_args(__doc__.split('\n\n')[0])

import tensorflow as tf  # noqa: E402


def ops_or_stub() -> None:
    """Loads Lingvo's custom ops, or registers a module that fails on use when they cannot
    load here (the reason goes to stderr)."""
    import lingvo  # the package only: lingvo.core.ops is the module that loads x_ops.so
    path = f'{lingvo.__path__[0]}/core/ops/x_ops.so'
    try:
        tf.load_op_library(path)
        return
    except tf.errors.NotFoundError as e:
        reason = str(e).splitlines()[0]
    print(f'lingvo_pipe: custom ops unavailable ({reason}); GPipe uses none', file=sys.stderr)

    class Unavailable(types.ModuleType):
        def __getattr__(self, name):
            raise RuntimeError(f'lingvo custom op {name} used, but x_ops.so cannot load: '
                               f'{reason}')

    sys.modules['lingvo.core.ops'] = Unavailable('lingvo.core.ops')


ops_or_stub()
from lingvo.core import cluster_factory, gpipe, layers, py_utils  # noqa: E402

tf.compat.v1.disable_eager_execution()
tf.compat.v1.flags.FLAGS(['lingvo_pipe', '--enable_asserts=false',
                          '--enable_check_numerics=false'])


def build_graph(cells: int, micro: int):
    """The train op of one config in a fresh graph."""
    graph = tf.Graph()
    with graph.as_default():
        cluster = cluster_factory.ForTestingWorker(mode='sync', job='trainer_client',
                                                   cpus=cells, split_size=cells)
        cluster.params.worker.name = '/job:localhost'
        with cluster:
            py_utils.GetOrCreateGlobalStepVar()
            per_cell = steps.LAYERS // cells
            cell_tpl = [gpipe.FeatureExtractionLayer.Params().Set(name=f'cell{c}', sub=[
                layers.FCLayer.Params().Set(name=f'fc{c * per_cell + i}',
                                            input_dim=steps.WIDTH, output_dim=steps.WIDTH,
                                            activation='RELU')
                for i in range(per_cell)]) for c in range(cells)]
            pipe = gpipe.PipeliningLayer.Params().Set(
                name='pipe', cell_tpl=cell_tpl, num_micro_batches=micro).Instantiate()
            x = tf.compat.v1.get_variable(
                'x', [steps.BATCH, steps.WIDTH], trainable=False,
                initializer=tf.compat.v1.random_normal_initializer())
            y = pipe.FPropDefaultTheta(x)
            loss = tf.reduce_mean(tf.square(y))
            variables = pipe.vars.Flatten()
            grads = tf.gradients(loss, variables)
            train = tf.group(*[v.assign_sub(steps.LEARNING_RATE * g)
                               for v, g in zip(variables, grads)])
        init = tf.compat.v1.global_variables_initializer()
    return graph, init, train


def session_config() -> tf.compat.v1.ConfigProto:
    config = tf.compat.v1.ConfigProto(device_count={'CPU': 8})
    if args.threads != 'default':
        intra, inter = (int(v) for v in args.threads.split('/'))
        config.intra_op_parallelism_threads = intra
        config.inter_op_parallelism_threads = inter
    return config


for cells, micro in steps.configs(args.configs):
    graph, init, train = build_graph(cells, micro)
    with tf.compat.v1.Session(graph=graph, config=session_config()) as sess:
        sess.run(init)
        ms = steps.median_step_ms(lambda: sess.run(train), args.warmup, args.steps)
    steps.report(cells, micro, ms, threads=args.threads)
