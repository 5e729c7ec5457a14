"""Keras in, pipeline out: GPipe for a `keras.Sequential` in one call.

    pipe = tfpipe.keras.pipeline(model, num_cells=4, num_micro_batches=4)
    pipe.compile(optimizer='adam', loss='sparse_categorical_crossentropy')
    pipe.fit(x, y, batch_size=64)

The returned `keras.Model` holds copies of the model's layers (same config,
same weights if the model is built), cut into K cells; each cell's variables
are created on its device, and its forward, recompute and backward work runs
there, scheduled by tfpipe's own executor (`tfpipe.pipeline.executor`): the
same code as `PipeliningLayer`, fed with Keras layers instead of tfpipe ones.
A Keras layer is run on the executor's weight tensors through
`keras.StatelessScope`, so the executor's tapes see every weight read.

What is pipelined exactly, and what is refused (with an error naming the layer):
- `Dropout` is replaced by tfpipe's stateless dropout (the mask is a function
  of layer, step and example index), so a recomputed forward pass drops the
  same units and the result does not depend on K or M; other layers that draw
  random numbers (GaussianNoise, an RNN with dropout or recurrent_dropout above
  0) are refused. An RNN without them (LSTM, GRU) is pipelined.
- `BatchNormalization` is refused: its moving statistics would be updated once
  per micro-batch; use `tfpipe.layers.BatchNorm` (micro-batch statistics,
  one full-batch update of the moving statistics) in a tfpipe model instead.
- Losses a layer adds in `call()` (`self.add_loss`, and Keras'
  `activity_regularizer`, which Keras divides by the batch size) are trained
  and reported as Keras does, in `fit`'s and `evaluate`'s `loss`: each
  micro-batch's value counts b/N, like the compiled loss, so a loss that is a
  mean over the batch's examples (or does not depend on them) is exact; one
  that sums over examples would count 1/M of itself (say so if you have one).
- Layers with non-trainable state (stateful RNNs), weight regularizers (Keras
  computes them from the variables when the loss is read, outside the
  executor's tapes), layers that appear twice (shared weights) and functional
  models with branches are refused.
"""
from __future__ import annotations

import math
import zlib
from typing import Any, Optional, Sequence, Union

import keras
import tensorflow as tf

from tfpipe import devices as devices_lib
from tfpipe import fprop_context
from tfpipe.layers.dropout import stateless_uniform_slice
from tfpipe.pipeline import microbatch, partition, schedule
from tfpipe.pipeline.cell import Cell, recompute_flags
from tfpipe.pipeline.executor import PipelineRun

__all__ = ['PipelinedModel', 'pipeline']

SCHEDULES = {'fill_drain': schedule.fill_drain, '1f1b': schedule.one_f_one_b}


class _Name:
    """The params a Cell reads from each of its layers: `name`, and no `fprop_dtype` of
    its own (a Keras layer computes under its own dtype policy)."""

    fprop_dtype = None

    def __init__(self, name: str):
        self.name = name


class _KerasLayer:
    """One Keras layer as the executor sees a tfpipe layer: `FProp(theta, x)`.

    theta is the list of the layer's trainable weights as tensors; the layer
    runs on them (not on its variables) so that the executor's tapes, which
    watch theta, give the weight gradients, and a recompute reads the same
    values as the forward pass.
    """

    NESTED_ACTIVATIONS = False

    def __init__(self, name: str, layer: keras.layers.Layer):
        self.params = _Name(name)
        self.layer = layer
        # By position, not by Keras' auto-generated name ('dropout_3'), so that the
        # same model built twice draws the same masks.
        self._dropout_key = zlib.crc32(f'tfpipe.keras/{name}'.encode())

    def FProp(self, theta: list, x: tf.Tensor) -> tf.Tensor:
        ctx = fprop_context.current()
        if isinstance(self.layer, keras.layers.Dropout):
            return self._dropout(x, ctx)
        mapping = list(zip(self.layer.trainable_variables, theta))
        with keras.StatelessScope(state_mapping=mapping, collect_losses=True) as scope:
            y = self.layer(x, training=ctx.training)
        # A loss the layer adds (add_loss, activity_regularizer) is an auxiliary loss
        # of the pipeline: differentiated beside the cell's outputs, weighted b/N.
        for i, loss in enumerate(scope.losses):
            if ctx.aux_losses is not None:
                ctx.aux_losses.add(self.params.name, f'add_loss_{i}', loss, 1.0)
        return y

    def _dropout(self, x: tf.Tensor, ctx: fprop_context.FPropContext) -> tf.Tensor:
        """tfpipe's stateless mask: a function of (layer, step, example index) only."""
        rate = float(self.layer.rate)
        if not ctx.training or rate == 0.0:
            return x
        per_example = math.prod(x.shape[1:].as_list())
        uniform = stateless_uniform_slice(self._dropout_key, ctx.step,
                                          ctx.example_offset * per_example,
                                          x.shape[0] * per_example)
        keep = tf.reshape(uniform, x.shape) >= rate
        return tf.where(keep, x / (1.0 - rate), tf.zeros_like(x))


def _rnn_dropout(layer: keras.layers.Layer) -> Optional[dict[str, float]]:
    """An RNN cell's dropout rates, None for other layers.

    Keras RNN cells (LSTMCell, GRUCell, SimpleRNNCell) own a seed generator whether or
    not they drop anything: they draw random numbers only with a rate above 0.
    """
    if not all(hasattr(layer, a) for a in ('dropout', 'recurrent_dropout', 'seed_generator')):
        return None
    return {'dropout': layer.dropout, 'recurrent_dropout': layer.recurrent_dropout}


def _refusal(layer: keras.layers.Layer) -> Optional[str]:
    """Why `layer` cannot be pipelined exactly, or None."""
    if isinstance(layer, keras.layers.Dropout):
        return None
    # Keras 3 has no public API for all of a layer's sub-layers (nor, below, for a
    # functional model's graph): these private attributes are read, never written.
    inner = [layer] + list(layer._flatten_layers(include_self=False))
    for sub in inner:
        where = f'layer {sub.name!r}' + ('' if sub is layer else f' (inside {layer.name!r})')
        if isinstance(sub, keras.layers.BatchNormalization):
            return (f'{where} is a BatchNormalization, whose moving statistics would be '
                    'updated once per micro-batch; build the model with tfpipe layers and '
                    'use tfpipe.layers.BatchNorm (micro-batch statistics, one full-batch '
                    'update of the moving statistics)')
        rates = _rnn_dropout(sub)
        if rates is not None and any(rates.values()):
            named = ', '.join(f'{k}={v}' for k, v in rates.items())
            return (f'{where} draws dropout masks ({named}), which a recomputed forward pass '
                    'would not reproduce; set both to 0 and put a keras.layers.Dropout between '
                    'layers instead')
        if isinstance(sub, keras.layers.Dropout) or (
                rates is None and getattr(sub, 'seed_generator', None)):
            return (f'{where} draws random numbers, which a recomputed forward pass would not '
                    'reproduce; only top-level keras.layers.Dropout is supported')
        if getattr(sub, 'stateful', False):
            return f'{where} is stateful (it carries state across batches); use stateful=False'
    # An RNN cell without dropout never draws from (nor advances) its seed generator.
    unused_seeds = {id(sub.seed_generator.state) for sub in inner
                    if _rnn_dropout(sub) is not None and sub.seed_generator is not None}
    for sub in inner:  # generic checks after the specific ones, which name the inner layer
        where = f'layer {sub.name!r}' + ('' if sub is layer else f' (inside {layer.name!r})')
        state = [v.path for v in sub.non_trainable_variables if id(v) not in unused_seeds]
        if state:
            return (f'{where} has non-trainable state {state}, which the pipeline would '
                    'update once per micro-batch')
        regularizers = [a for a in ('kernel_regularizer', 'bias_regularizer')
                        if getattr(sub, a, None)]
        if regularizers:
            return (f'{where} has {regularizers[0]}; remove it, or add the penalty in a '
                    'layer\'s call() with add_loss (trained by the pipeline)')
    return None


def _layers_of(model: Union[keras.Model, Sequence[keras.layers.Layer]]) -> list:
    """The model's layers in order, refusing anything that is not a plain chain."""
    if isinstance(model, keras.Sequential):
        layers = list(model.layers)
    elif isinstance(model, keras.Model):
        layers = [l for l in model.layers if not isinstance(l, keras.layers.InputLayer)]
        for layer in layers:
            inbound = layer._inbound_nodes
            if len(inbound) != 1 or len(inbound[0].input_tensors) != 1:
                raise ValueError(
                    f'layer {layer.name!r} of functional model {model.name!r} takes '
                    f'{sum(len(n.input_tensors) for n in inbound)} inputs (a branch or a '
                    'shared layer): only a chain of layers can be pipelined; give a '
                    'keras.Sequential or a list of layers')
        for earlier, later in zip(layers, layers[1:]):
            if later._inbound_nodes[0].input_tensors[0] is not earlier.output:
                raise ValueError(f'layer {later.name!r} of functional model {model.name!r} '
                                 f'does not take the output of {earlier.name!r}: only a chain '
                                 'of layers can be pipelined')
    else:
        layers = list(model)
    if not layers:
        raise ValueError('the model has no layers to pipeline')
    seen: dict[int, str] = {}
    for layer in layers:
        if not isinstance(layer, keras.layers.Layer):
            raise ValueError(f'{layer!r} is not a Keras layer')
        if id(layer) in seen:
            raise ValueError(f'layer {layer.name!r} appears twice (shared weights): each layer '
                             'must be used once to be pipelined')
        seen[id(layer)] = layer.name
        why = _refusal(layer)
        if why is not None:
            raise ValueError(f'cannot pipeline: {why}')
    return layers


def _copy(layer: keras.layers.Layer) -> keras.layers.Layer:
    """A layer of the same config, built (under the caller's device) if `layer` is. Its
    own class is passed along, so a user's layer needs no Keras registration."""
    return keras.layers.deserialize(keras.layers.serialize(layer),
                                    custom_objects={type(layer).__name__: type(layer)})


def _read(variable: keras.Variable) -> tf.Tensor:
    # A tf.Variable's read_value() is placed under the enclosing device scope.
    value = variable.value
    return value.read_value() if isinstance(value, tf.Variable) else tf.identity(value)


class PipelinedModel(keras.Model):
    """A keras.Model whose layers run as GPipe cells on their own devices."""

    def __init__(self, layers: Sequence[keras.layers.Layer], balance: Sequence[int],
                 devices: Sequence[str], num_micro_batches: int, recompute: str,
                 schedule_name: str, **kwargs: Any):
        super().__init__(**kwargs)
        self.pipelined_layers = list(layers)  # tracked in order: get_weights() order
        self.balance = tuple(balance)
        self.num_micro_batches = num_micro_batches
        self.schedule_name = schedule_name
        flags = recompute_flags(recompute, len(self.balance))
        adapters = [_KerasLayer(f'{i:04d}', layer) for i, layer in enumerate(layers)]
        self.cells = [Cell(k, devices[k], adapters[start:stop], flags[k])
                      for k, (start, stop) in enumerate(partition.cell_ranges(self.balance))]

    def build(self, input_shape: Any) -> None:
        """Builds each cell's layers under its device, so their variables live there."""
        shape = input_shape
        for cell in self.cells:
            with tf.device(cell.device):
                for adapter in cell.layers:
                    if not adapter.layer.built:
                        adapter.layer.build(shape)
                    shape = adapter.layer.compute_output_shape(shape)
        self.built = True

    # -- Keras' step functions -----------------------------------------------------------
    # The pipeline cuts a batch into micro-batches at trace time, so it needs a
    # static batch size. Keras traces its steps with reduce_retracing=True, which
    # turns the batch dimension into None as soon as a second batch size (the
    # last, partial batch of an epoch) shows up. These step functions trace once
    # per batch shape instead (two shapes per dataset at most).

    def _make_function(self, step_function: Any) -> Any:
        traced = tf.function(step_function)

        def function(iterator: Any) -> Any:
            outputs = None
            for _, data in zip(range(self.steps_per_execution), iterator):
                outputs = traced(data)
            if outputs is None:
                raise StopIteration
            return outputs
        return function

    def make_train_function(self, force: bool = False) -> Any:
        if self.train_function is None or force:
            self.train_function = self._make_function(self.train_step)
        return self.train_function

    def make_test_function(self, force: bool = False) -> Any:
        if self.test_function is None or force:
            self.test_function = self._make_function(self.test_step)
        return self.test_function

    def make_predict_function(self, force: bool = False) -> Any:
        if self.predict_function is None or force:
            traced = tf.function(self.predict_step)

            def predict_function(data: list) -> Any:
                outputs = [traced(batch) for batch in data]
                return tf.nest.map_structure(lambda *parts: tf.concat(parts, 0), *outputs)
            self.predict_function = predict_function
        return self.predict_function

    # -- Running the schedule ----------------------------------------------------------

    def _thetas(self) -> list[dict]:
        thetas = []
        for cell in self.cells:
            with tf.device(cell.device), tf.name_scope(f'cell_{cell.index}/theta'):
                thetas.append({a.params.name: [_read(v) for v in a.layer.trainable_variables]
                               for a in cell.layers})
        return thetas

    def _split(self, x: Any) -> tuple[list, list[int]]:
        with tf.device(self.cells[0].device), tf.name_scope('split'):
            micro = microbatch.split(tf.nest.map_structure(tf.convert_to_tensor, x),
                                     self.num_micro_batches)
        sizes = [tf.nest.flatten(mb)[0].shape[0] for mb in micro]
        return micro, microbatch.offsets(sizes)

    def _merge(self, outputs: list) -> Any:
        with tf.device(self.cells[-1].device), tf.name_scope('merge'):
            return microbatch.merge(outputs)

    def _ticks(self, name: str, num_micro_batches: int) -> schedule.Schedule:
        return SCHEDULES[name](len(self.cells), num_micro_batches)

    def _step(self) -> Any:
        optimizer = getattr(self, 'optimizer', None)  # absent before compile()
        return optimizer.iterations if optimizer is not None else 0

    def call(self, x: Any, training: bool = False) -> Any:
        """Forward tasks only (predict, or a plain call: the losses layers add are
        left out of `self.losses`; `evaluate` reports them)."""
        return self._forward(x, training)[0]

    def _forward(self, x: Any, training: bool) -> tuple[Any, tf.Tensor]:
        """The outputs and the sum of the losses the layers added (weighted b/N)."""
        micro, offsets = self._split(x)
        ctx = fprop_context.FPropContext(training=bool(training), step=self._step())
        run = PipelineRun(self.cells, self._thetas(), micro, offsets, ctx)
        run.run(t for tick in self._ticks('fill_drain', len(micro)) for t in tick
                if t.phase == schedule.FORWARD)
        return self._merge(run.outputs), self._added_losses(run)

    def _added_losses(self, run: PipelineRun) -> tf.Tensor:
        with tf.device(self.cells[-1].device), tf.name_scope('added_losses'):
            return tf.add_n([tf.constant(0.0)] + [
                weight * tf.cast(value, tf.float32)
                for value, weight in run.aux_report().values()])

    def test_step(self, data: Any) -> dict:
        """Keras' evaluation step, with the losses the layers added in the `loss`, as
        Keras' own test_step has them (through `self.losses`, which a pipelined call
        does not fill)."""
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        y_pred, added = self._forward(x, training=False)
        loss = self.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight,
                                 training=False)
        self._loss_tracker.update_state(loss + added, sample_weight=microbatch.batch_size(x))
        return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def train_step(self, data: Any) -> dict:
        """One GPipe step: the schedule's forward and backward tasks, then one update.

        The compiled loss of a micro-batch of b examples out of N is scaled by
        b / N, so the sum over micro-batches is the mini-batch's mean loss
        (Keras' default 'sum_over_batch_size' reduction) and its gradient is
        the unpartitioned model's.
        """
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        n = microbatch.batch_size(x)
        micro, offsets = self._split(x)
        with tf.device(self.cells[-1].device), tf.name_scope('split_targets'):
            targets = [microbatch.split(tf.nest.map_structure(tf.convert_to_tensor, t),
                                        len(micro)) if t is not None else [None] * len(micro)
                       for t in (y, sample_weight)]
        losses = []

        def on_output(m: int, y_pred: Any) -> list:
            leaves = tf.nest.flatten(y_pred)
            with tf.GradientTape(watch_accessed_variables=False) as tape:
                tape.watch(leaves)
                b = leaves[0].shape[0]
                loss = self.compute_loss(x=None, y=targets[0][m], y_pred=y_pred,
                                         sample_weight=targets[1][m], training=True)
                loss = loss * (b / n)
            losses.append(loss)
            return tape.gradient(loss, leaves, unconnected_gradients=tf.UnconnectedGradients.ZERO)

        ctx = fprop_context.FPropContext(training=True, step=self._step())
        thetas = self._thetas()
        run = PipelineRun(self.cells, thetas, micro, offsets, ctx, on_output=on_output)
        run.run(t for tick in self._ticks(self.schedule_name, len(micro)) for t in tick)
        variables, grads = [], []
        for k, cell in enumerate(self.cells):
            cell_grads = run.theta_grads_of(k)
            for adapter in cell.layers:
                variables += adapter.layer.trainable_variables
                grads += cell_grads[adapter.params.name]
        self.optimizer.apply_gradients(zip(_once_all_summed(grads), variables))
        with tf.device(self.cells[-1].device), tf.name_scope('loss'):
            loss = tf.add_n(losses) + self._added_losses(run)  # Keras' loss includes them
        self._loss_tracker.update_state(loss, sample_weight=n)
        return self.compute_metrics(x, y, self._merge(run.outputs), sample_weight=sample_weight)


def _once_all_summed(grads: list) -> list:
    """`grads`, each released on its own device only when every one is summed.

    Without the gate the update of a late cell's weights starts while earlier cells
    still run their backward, and on logical CPUs, which share one allocator, the
    update's temporaries (Keras' Adam: two to four of a weight's size) stack on the
    backward's working set: a fit's peak then varies with the threads' timing, 94 to
    139 MiB for tests/keras_memory_probe.py's model. Gated, the peak is the larger of
    the two phases, which keras_memory.predict_fit predicts. On devices of their own
    the gate only delays each device's update to the end of the pipeline's last
    backward, as GPipe's synchronous update does.
    """
    present = [g for g in grads if g is not None]
    gated = []
    with tf.name_scope('all_gradients_summed'):
        for g in grads:
            if g is None:
                gated.append(None)
                continue
            with tf.device(g.device), tf.control_dependencies(present):
                gated.append(tf.identity(g))
    return gated


def pipeline(model: Union[keras.Model, Sequence[keras.layers.Layer]],
             num_cells: Optional[int] = None, balance: Optional[Sequence[int]] = None,
             num_micro_batches: int = 1, recompute: str = 'always',
             schedule: str = 'fill_drain',  # pylint: disable=redefined-outer-name
             devices: Optional[Sequence[str]] = None) -> PipelinedModel:
    """A keras.Model running `model`'s layers as K GPipe cells with M micro-batches.

    `model` is a keras.Sequential, a functional model that is a plain chain, or
    a list of layers. Give `balance` (layers per cell) or `num_cells` (layers
    spread evenly, by count). The layers are copied from their config, with
    the model's weights when it is built, so the original model is left as it
    is. `recompute`: 'always' | 'except_last' | 'never'; `schedule`:
    'fill_drain' | '1f1b'; `devices`: one per cell (None: GPUs if there are
    enough, else logical CPUs).
    """
    layers = _layers_of(model)
    if balance is None:
        if num_cells is None:
            raise ValueError('give balance=[layers per cell] or num_cells=K')
        if not 1 <= num_cells <= len(layers):
            raise ValueError(f'num_cells={num_cells} must be in [1, {len(layers)}] (one layer '
                             'per cell at least)')
        base, extra = divmod(len(layers), num_cells)
        balance = [base + (k < extra) for k in range(num_cells)]
    elif num_cells is not None and num_cells != len(balance):
        raise ValueError(f'num_cells={num_cells} disagrees with balance {list(balance)}; set '
                         'only one of them')
    balance = partition.validate_balance(list(balance), len(layers))
    if schedule not in SCHEDULES:
        raise ValueError(f'unknown schedule {schedule!r}; use one of {sorted(SCHEDULES)}')
    if not isinstance(num_micro_batches, int) or num_micro_batches < 1:
        raise ValueError(f'num_micro_batches={num_micro_batches!r} must be an int >= 1')
    cell_devices = devices_lib.resolve(devices, len(balance))
    copies = []
    for k, (start, stop) in enumerate(partition.cell_ranges(balance)):
        with tf.device(cell_devices[k]):  # a built layer's copy is built as it is made
            copies += [_copy(layer) for layer in layers[start:stop]]
    for copy, layer in zip(copies, layers):
        if layer.built:
            copy.set_weights(layer.get_weights())
    pipe = PipelinedModel(copies, balance, cell_devices, num_micro_batches, recompute, schedule,
                          name=f'{getattr(model, "name", "layers")}_pipelined')
    pipe.built = all(layer.built for layer in layers)
    return pipe
