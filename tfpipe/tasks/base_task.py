"""BaseTask: a model with its losses, metrics, decoder and train/eval settings.

A task owns one pipelined body (`p.pipeline`, a PipeliningLayer) and says how a
batch of the input becomes the pipeline's inputs and targets, how a
micro-batch's outputs become per-example losses, what eval metrics are and
what the decoder writes. The trainer calls only the methods below.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import tensorflow as tf

from tfpipe import lr_schedules, optimizers
from tfpipe.base_layer import BaseLayer
from tfpipe.hyperparams import Params
from tfpipe.pipeline.pipelining_layer import PipeliningLayer

Metrics = dict[str, tuple[tf.Tensor, tf.Tensor]]  # name -> (value, weight)


@dataclasses.dataclass(frozen=True)
class ServingSignature:
    """One function of an exported SavedModel, as its users see it.

    `inputs` names and types every input (leading dimension None: any batch);
    `fn` takes them as keyword arguments and returns a dict of named outputs. The
    exporter traces `fn` in evaluation mode (tfpipe/export.py), so it only says
    what the model computes for a request.
    """
    inputs: dict[str, tf.TensorSpec]
    fn: Callable[..., dict[str, tf.Tensor]]


def train_params() -> Params:
    p = Params()
    p.Define('max_steps', 1000, 'Training stops at this global step.')
    p.Define('learning_rate', 0.1, 'Base rate; the rate used is learning_rate * '
             'lr_schedule.Value(step).')
    p.Define('optimizer', optimizers.SGD.Params(), 'Optimizer params.')
    p.Define('lr_schedule', lr_schedules.Constant.Params().Set(value=1.0),
             'Multiplier of learning_rate over steps.')
    p.Define('clip_gradient_norm_to_value', 0.0, 'Clip the global gradient norm (0: off).')
    p.Define('shard_optimizer_states', False, 'With pipeline.num_replicas R > 1: each replica '
             'keeps the optimizer slots of 1/R of every variable and updates that part, and '
             'the updated parts are all-gathered (ZeRO stage 1; see '
             'tfpipe.pipeline.sharded_optimizer). Same updates and checkpoints; Adam\'s '
             'state falls from 16 to 4 + 4 + 8/R bytes per parameter, for one all-gather of '
             'the weights per step. Off by default: measured only on logical CPUs sharing '
             'two cores, where it was faster (0.67x-0.89x: replicas no longer repeat the whole '
             'update), which says nothing of devices with their own compute, where the '
             'all-gather is added traffic (docs/optimizer_sharding.md).')
    p.Define('sharding', 'none', "What each of the R data-parallel replicas keeps 1/R of "
             "(tfpipe.pipeline.sharding; docs/optimizer_sharding.md): 'none'; "
             "'optimizer_states' (ZeRO stage 1, as shard_optimizer_states=True); 'gradients' "
             '(ZeRO stage 2: the gradient sums too, reduce-scattered instead of all-reduced); '
             "'weights' (ZeRO stage 3: the weights too between steps, each cell's all-gathered "
             'once per step; one trainer client only). Same updates and checkpoints as '
             'unsharded. Refused at R=1, where it does nothing.')
    p.Define('regather_per_micro_batch', False, "With sharding='weights' (ZeRO stage 3): "
             "each recomputing cell all-gathers its whole weights in every forward and "
             'backward task and frees them after it, instead of once a step kept through '
             'all micro-batches: the whole weights of a cell are held only while one of its '
             'tasks runs, for 2M all-gathers of each of its weights per step instead of one '
             'of the cell (cells that keep their activations still gather once). Same '
             'updates. Measured on logical '
             'CPUs it was slower (1.25-1.41x) and did not lower the step\'s peak '
             '(docs/optimizer_sharding.md). Refused at other stages.')
    p.Define('save_interval_steps', 100, 'Checkpoint every this many steps.')
    p.Define('save_max_to_keep', 5, 'Checkpoints kept in the train dir.')
    p.Define('summary_interval_steps', 10, 'TensorBoard summaries every this many steps.')
    return p


def eval_params() -> Params:
    p = Params()
    p.Define('samples_per_summary', 1000, 'Examples per evaluation of a checkpoint: exactly '
             'the first this many of the split (all of it if smaller), not whole batches.')
    p.Define('decoder_samples_per_summary', 100, 'Examples decoded per checkpoint, likewise '
             'exact.')
    return p


class BaseTask(BaseLayer):
    """Subclasses define the batch <-> pipeline mapping, loss, metrics and decoding."""

    @classmethod
    def Params(cls):
        p = super().Params()
        p.name = 'task'
        p.Define('pipeline', PipeliningLayer.Params(), 'The pipelined body of the model.')
        p.Define('train', train_params(), 'Training settings.')
        p.Define('eval', eval_params(), 'Evaluation and decoding settings.')
        return p

    def __init__(self, params, parent=None):
        super().__init__(params, parent)
        # M is set in one place only, task.pipeline.num_micro_batches.
        self.pipe = self.CreateChild('pipe', self.params.pipeline)

    # -- What subclasses define ----------------------------------------------------------

    def PipelineInputs(self, batch: dict) -> Any:
        raise NotImplementedError

    def PipelineTargets(self, batch: dict) -> Any:
        raise NotImplementedError

    def PerExampleLoss(self, outputs: Any, targets: Any) -> tf.Tensor:
        """One micro-batch's loss per example, shape [b]."""
        raise NotImplementedError

    def ComputeLoss(self, theta: dict, predictions: Any, batch: dict) -> Metrics:
        """Eval metrics of a batch: name -> (value, weight); must include 'loss'.

        Each value is a mean over the batch weighted by ExampleWeights(batch), and
        its weight counts what it averaged (0 for padding), so the evaler's
        weighted mean over batches is the metric of exactly the real examples.
        """
        raise NotImplementedError

    def Decode(self, theta: dict, batch: dict) -> dict:
        """Decoder outputs: tensors with one row per example of the batch (leading dim).

        The decoder drops the rows of padding (weight 0) before PostProcessDecodeOut.
        """
        raise NotImplementedError

    def PostProcessDecodeOut(self, decode_out: dict) -> list[dict]:
        """Decoder tensors (as numpy) -> one JSON-able record per example."""
        raise NotImplementedError

    def DecodeMetrics(self, records: list[dict]) -> dict[str, float]:
        """Corpus-level metrics of all decoded records (accuracy, BLEU...)."""
        raise NotImplementedError

    def ServingSignatures(self, features: dict[str, tf.TensorSpec]
                          ) -> dict[str, ServingSignature]:
        """The SavedModel signatures of this task by name ('serving_default' first).

        `features` is the spec of one input example per feature (no batch dimension),
        read from the model's input, so a signature knows image sizes and sequence
        lengths. Signatures compute with `ServingPredictions`, which takes any batch.
        """
        raise ValueError(f'task {type(self).__name__} has no export signature: define '
                         'ServingSignatures() on it (see docs/export.md) to export it')

    def CheckInput(self, input_params: Params) -> None:
        """Raises ValueError if this task cannot read the input's examples.

        Jobs call it before they write anything, so a mismatch (a sequence longer
        than the model's positions) is bad input, not a failure at the first step.
        """

    def FinalizeMetrics(self, scores: dict[str, float]) -> dict[str, float]:
        """The evaler's metrics of a whole split from their weighted means (e.g.
        perplexity = exp(mean log-perplexity), which no mean of batches gives)."""
        return scores

    # -- Shared --------------------------------------------------------------------------

    def ThroughputUnit(self, batch: dict) -> tuple[str, int]:
        """What the trainer's rate counts, and how many of it one example holds."""
        return 'examples', 1

    def ExampleWeights(self, batch: dict) -> tf.Tensor:
        """float32 [B]: the input's 'weight' (0 marks an eval batch's padding), else ones."""
        if 'weight' in batch:
            return tf.cast(batch['weight'], tf.float32)
        targets = tf.nest.flatten(self.PipelineTargets(batch))[0]
        return tf.ones([tf.shape(targets)[0]], tf.float32)

    def ComputePredictions(self, theta: dict, batch: dict) -> Any:
        return self.pipe.FProp(theta['pipe'], self.PipelineInputs(batch))

    def ServingPredictions(self, batch: dict) -> Any:
        """The pipeline's outputs for a batch of any size: each cell on its own device,
        in order, on the whole batch.

        FProp cuts the batch into micro-batches at trace time, which needs a static
        batch size; a served request has none. In evaluation mode the result is
        FProp's (each example's computation does not depend on the cut).
        """
        x, theta = self.PipelineInputs(batch), self.pipe.theta
        for cell in self.pipe.cells:
            with tf.device(cell.device):
                x = cell.forward(cell.read_theta(theta), x)
        return x

    def ForwardBackward(self, theta: dict, batch: dict) -> tuple[tf.Tensor, dict | list[dict]]:
        """Mean training loss of the batch and its gradients (structure of theta).

        With data-parallel replicas (pipeline.num_replicas > 1) the gradients are a
        list, one dict per replica, all-reduced: replica r's go to the variables
        `pipe.ReplicaVariablesByPath()[r]`, so every copy takes the same step.
        """
        pipe_theta = theta['pipe']
        if self.pipe.num_replicas > 1:
            pipe_theta = [pipe_theta] + self.pipe.ReplicaThetas()[1:]
        loss, grads = self.pipe.ForwardBackward(pipe_theta, self.PipelineInputs(batch),
                                                self.PerExampleLoss, self.PipelineTargets(batch))
        if isinstance(grads, list):
            return loss, [{'pipe': g} for g in grads]
        return loss, {'pipe': grads}
