"""The Transformer LM that tensor-parallel steps are checked on, its T=1 step and the
comparison.

The LM of tests/test_lm.py widened to 4 heads (so that T=4 divides them), with
residual and attention dropout, in float64. Shared by
tests/test_tensor_parallel_lm.py (8 logical CPUs) and the 16-device child of
tests/test_tensor_parallel_16.py (its own TensorFlow), so that both build and
compare the same task.
"""
import numpy as np
import tensorflow as tf

from tests import test_lm as lm
from tfpipe import bodies, fprop_context, variable_shards
from tfpipe.base_layer import flatten_by_path
from tfpipe.pipeline import partition
from tfpipe.pipeline.pipelining_layer import PipeliningLayer
from tfpipe.tasks.lm import LanguageModel

STEP, LR = 3, 0.5
HEADS = 4


def lm_task(t, k=1, r=1, m=1, heads=HEADS, blocks=1, **pipeline):
    body = bodies.transformer_lm_body(lm.VOCAB, lm.CONTEXT, 16, 32, heads, blocks,
                                      dropout_keep_prob=0.8)
    for p in body:
        p.dtype = tf.float64
        if 'atten_dropout_keep_prob' in p:
            p.atten_dropout_keep_prob = 0.9
    p = LanguageModel.Params()
    p.pipeline = PipeliningLayer.Params().Set(
        name='pipe', body=body, num_micro_batches=m, num_replicas=r, tensor_parallel=t,
        balance=partition.even_balance(len(body), k),
        tied_weights=dict(bodies.TRANSFORMER_TIES), **pipeline)
    return p.Instantiate()


def whole(task, values):
    """{whole weight path: numpy value} from values keyed like task.VariablesByPath()."""
    out, parts = {}, {}
    for path, var in task.VariablesByPath().items():
        sharded = variable_shards.of(var)
        value = tf.convert_to_tensor(values[path]).numpy()
        if sharded is None:
            out[path] = value
        else:
            parts.setdefault(sharded.path, (sharded.axis, []))[1].append(value)
    out.update({path: np.concatenate(v, axis) for path, (axis, v) in parts.items()})
    return out


def sgd_step(task, batch):
    """(loss, whole gradients, whole weights after one SGD step) of a training step."""
    @tf.function(autograph=False)
    def step():
        # One theta, also for R=2: the replicas' gradients are summed onto it.
        with fprop_context.training(step=STEP):
            loss, grads = task.pipe.ForwardBackward(
                task.theta['pipe'], task.PipelineInputs(batch), task.PerExampleLoss,
                task.PipelineTargets(batch))
        return loss, flatten_by_path({'pipe': grads}, task.path)

    loss, flat = step()
    grads = whole(task, flat)
    for path, var in task.VariablesByPath().items():
        var.assign_sub(LR * tf.convert_to_tensor(flat[path]))
    return loss.numpy(), grads, whole(task, {p: v for p, v in task.VariablesByPath().items()})


_reference = {}


def reference():
    """The generated batch and the T=1, K=1 task's SGD step, computed once per process."""
    if not _reference:
        _reference['batch'] = lm.generated_batch()
        _reference['out'] = sgd_step(lm_task(1), _reference['batch'])
    return _reference['batch'], _reference['out']


def assert_same_step(got, ref):
    (loss, grads, weights), (ref_loss, ref_grads, ref_weights) = got, ref
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-9)
    assert sorted(grads) == sorted(ref_grads) and sorted(weights) == sorted(ref_weights)
    for path in ref_grads:
        np.testing.assert_allclose(grads[path], ref_grads[path], rtol=1e-7, atol=1e-10,
                                   err_msg=path)
        np.testing.assert_allclose(weights[path], ref_weights[path], rtol=1e-7, atol=1e-10,
                                   err_msg=path)
