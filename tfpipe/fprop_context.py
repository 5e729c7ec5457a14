"""Per-call state that reaches layers without being a param or an FProp argument.

Three things change from call to call but must not change a layer's signature
`FProp(theta, *inputs)`:

- **mode**: training (BatchNorm uses batch statistics, Dropout drops) or eval;
- **step**: the global step, which seeds Dropout so every step draws a fresh mask
  while a recomputed forward pass draws the *same* mask;
- **example offset**: where the current micro-batch starts in the mini-batch, so a
  Dropout mask depends on the global example index and not on how the mini-batch
  was cut into micro-batches.

A fourth, the **batch-statistics sink**, lets the pipeline collect BatchNorm's
sufficient statistics from every micro-batch and apply one moving-average update
per mini-batch (equal to a full-batch BN update) instead of M updates.

A fifth, the **auxiliary-loss sink**, collects losses a layer adds to the training
loss (a mixture of experts' load-balancing and router z-losses,
tfpipe/layers/mixture_of_experts.py) without changing what the layer returns, so such
a layer composes with sequences, residuals and pipeline cells like any other.

The context is thread-local and scoped with `with`, the same way `tf.device` and
`tf.name_scope` are: values are read while the graph is traced.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any, Iterator, Optional


class BatchStatsSink:
    """Collects per-micro-batch BatchNorm statistics instead of applying them.

    `record(layer, count, mean, variance)` is called by BatchNorm in training
    mode. A sink created with `discard=True` drops them: the pipeline uses it
    while recomputing a forward pass, which must not update anything.
    """

    def __init__(self, discard: bool = False):
        self.discard = discard
        self.records: dict[int, tuple[Any, list]] = {}

    def record(self, layer: Any, count: int, mean: Any, variance: Any) -> None:
        if self.discard:
            return
        entry = self.records.setdefault(id(layer), (layer, []))
        entry[1].append((count, mean, variance))


class AuxLossSink:
    """Collects the auxiliary losses layers compute during one forward pass.

    `record(layer, name, value, weight)` is called by a layer in FProp. Unlike
    BatchNorm's statistics these must be *differentiated*: whoever runs the forward
    under a tape adds `total()` to the loss it differentiates, in the same trace (the
    recorded tensors belong to the graph that computed them). A PipeliningLayer gives
    its cells sinks of its own and records into the caller's sink one entry per
    (layer, name), already summed over its micro-batches (tfpipe/pipeline/aux_losses.py).
    """

    def __init__(self):
        self.records: list[tuple[str, str, Any, float]] = []  # (layer path, name, value, weight)

    def record(self, layer: Any, name: str, value: Any, weight: float) -> None:
        self.add(layer.path, name, value, weight)

    def record_statistic(self, layer: Any, name: str, value: Any) -> None:
        """A value to report, never added to the loss nor differentiated (weight None):
        e.g. the fraction of tokens an MoE layer dropped, its load per expert."""
        self.add(layer.path, name, value, None)

    def add(self, path: str, name: str, value: Any, weight: Optional[float]) -> None:
        """A record of the layer at `path` (the pipeline's form: it holds paths, not
        layers); weight None for a statistic."""
        self.records.append((path, name, value, weight))

    def total(self) -> Any:
        """The sum of weight * value over every loss record (0.0 when none)."""
        return sum((weight * value for _, _, value, weight in self.records
                    if weight is not None), 0.0)

    def metrics(self) -> dict[str, Any]:
        """What a trainer reports: 'aux_loss', the weighted total added to the training
        loss, and per loss name the unweighted value averaged over the layers that
        recorded it (a load-balancing loss reads 1.0 for uniform routing whatever the
        number of MoE layers); scalar statistics likewise, averaged over layers. Empty
        when nothing was recorded."""
        if not self.records:
            return {}
        by_name: dict[str, list] = {}
        for _, name, value, _ in self.records:
            if value.shape.rank == 0:
                by_name.setdefault(name, []).append(value)
        out = {'aux_loss': self.total()}
        out.update((name, sum(values) / len(values)) for name, values in by_name.items())
        return out

    def statistics(self) -> dict[str, Any]:
        """Every record by '<name>/<layer path>' (per layer: vectors too, e.g. the load
        per expert), for TensorBoard."""
        return {f'{name}/{path}': value for path, name, value, _ in self.records}


@dataclasses.dataclass(frozen=True)
class FPropContext:
    training: bool = True
    step: Any = None
    example_offset: int = 0
    batch_stats: Optional[BatchStatsSink] = None
    aux_losses: Optional[AuxLossSink] = None


_local = threading.local()


def current() -> FPropContext:
    """The innermost active context (training mode, no step, offset 0 by default)."""
    stack = getattr(_local, 'stack', None)
    return stack[-1] if stack else FPropContext()


@contextlib.contextmanager
def scope(**overrides: Any) -> Iterator[FPropContext]:
    """Runs the body with some context fields replaced; the rest are inherited."""
    ctx = dataclasses.replace(current(), **overrides)
    stack = getattr(_local, 'stack', None)
    if stack is None:
        stack = _local.stack = []
    stack.append(ctx)
    try:
        yield ctx
    finally:
        stack.pop()


def training(step: Any) -> contextlib.AbstractContextManager:
    """Training mode at global step `step` (a Python int, tensor or variable).

    Typical use in a custom loop:
        with tfpipe.fprop_context.training(step=global_step):
            loss, grads = pipe.ForwardBackward(pipe.theta, x, loss_fn, y)
    """
    return scope(training=True, step=step)


def evaluation() -> contextlib.AbstractContextManager:
    """Eval mode: BatchNorm uses moving statistics, Dropout is the identity."""
    return scope(training=False)
