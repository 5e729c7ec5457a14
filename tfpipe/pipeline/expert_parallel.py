"""Expert parallelism: the experts of an MoE layer spread over P data-parallel replicas.

As in GShard, Megatron-Core and DeepSpeed-MoE, the expert group is carved out of
the R data-parallel replicas (P divides R): the R replicas form R/P expert groups
of P, and member i of a group holds experts [i*E/P, (i+1)*E/P) of every MoE layer.
Tokens are routed locally, travel to their experts' member by an all-to-all and
come back by another.

Groups are *consecutive* replicas (replica r is member r % P of group r // P), as
Megatron-Core's default rank order (expert ranks inside data-parallel ranks) and
DeepSpeed's `_create_expert_and_data_parallel` lay them out: the all-to-all moves
activations twice per MoE layer and micro-batch, the heaviest and most
latency-bound traffic of the step, so its members should be the replicas that sit
closest (one host's GPUs, adjacent logical CPUs); the replicas that hold the same
experts ({r' : r' % P == r % P}, R/P of them, strided) meet once a step to sum
their expert gradients, which tolerates the slower link.

The all-to-all is TensorFlow's `CollectiveAllToAllV2` (v3 fails across processes,
see the shared notes). Each member builds its own op (a replica's cell is traced
on its own), so the members agree on keys by name: the group key of the member
devices and one instance key per (group, layer path, collective name)
(`instance_key`). Raw v2 collectives among logical CPUs of one process deadlock
inside a tf.function unless each carries an ordering token (measured: 2 members
on 2 logical CPUs hung without, returned in 0.1 s with): every device gets one
resource variable whose handle all collectives on that device take, so automatic
control dependencies run them in program order on every member, which is the
same order since every member traces the same layers. The op has no gradient;
the backward of an all-to-all is the same all-to-all of the output gradient
(chunk j received from member j goes back to member j), under tf.custom_gradient
with its own instance key.

Across trainer clients (one replica per process, `spanning_clients`) the members are
P consecutive clients: each process builds its replica with its own E/P experts, its
all-to-alls take the group's key agreed without messages (across_clients.group_key),
its expert gradients are summed over the clients holding the same experts
(`all_reduce_across_clients`) and `ClientExperts` keeps the chief's checkpoints whole.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
import weakref
from typing import Any, Callable, ContextManager, Iterator, Optional, Sequence

import tensorflow as tf

from tfpipe import variable_shards
from tfpipe.build_scope import BuildScope
from tfpipe.pipeline import across_clients, replicas
from tfpipe.pipeline import ties as ties_lib
from tfpipe.pipeline.cell import Cell

_lock = threading.Lock()
_instance_keys: dict[tuple, int] = {}
_tokens: dict[str, tf.Variable] = {}
_expert_variables: 'weakref.WeakValueDictionary[int, tf.Variable]' = \
    weakref.WeakValueDictionary()


def check_expert_parallel(value: Any, num_replicas: int, where: str) -> int:
    """P as an int >= 1 that divides R, else a one-line ValueError naming both."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f'{where}: expert_parallel={value!r} must be an int >= 1 (1: every '
                         'replica holds all experts)')
    if num_replicas % value:
        raise ValueError(f'{where}: expert_parallel={value} does not divide num_replicas='
                         f'{num_replicas}: the expert groups are carved out of the replicas; '
                         'set expert_parallel to a divisor of num_replicas')
    return value


def check_num_experts(num_experts: int, expert_parallel: int, where: str) -> None:
    """One line naming E and P when P does not divide E."""
    if num_experts % expert_parallel:
        raise ValueError(f'{where}: num_experts={num_experts} is not divisible by '
                         f'expert_parallel={expert_parallel}: each member holds num_experts/P '
                         'experts; set num_experts to a multiple of expert_parallel or change '
                         'expert_parallel')


@dataclasses.dataclass(frozen=True)
class ExpertGroup:
    """The P devices that hold one MoE layer's experts together, and which one is this.

    devices[i]: where member i's copy of the layer (its cell) runs; rank: this copy's
    member index, i.e. it holds experts [rank*E/P, (rank+1)*E/P).
    """

    devices: tuple[str, ...]
    rank: int
    # Across trainer clients: the group's collective key (agreed without messages;
    # across_clients.group_key), and every member's device is this client's own.
    client_key: int = 0

    @property
    def size(self) -> int:
        return len(self.devices)


SINGLE = ExpertGroup(('',), 0)
_building: BuildScope[ExpertGroup] = BuildScope(SINGLE)
_clients: BuildScope[Optional[across_clients.Peers]] = BuildScope(None)


def groups_of(replica_devices: Sequence[str], expert_parallel: int) -> list[ExpertGroup]:
    """Replica r's ExpertGroup, given each replica's device for one cell (consecutive groups)."""
    p = expert_parallel
    return [ExpertGroup(tuple(replica_devices[r - r % p:r - r % p + p]), r % p)
            for r in range(len(replica_devices))]


def expert_data_parallel(num_replicas: int, expert_parallel: int, replica: int) -> list[int]:
    """The replicas holding the same experts as `replica` (whose expert gradients it sums)."""
    return list(range(replica % expert_parallel, num_replicas, expert_parallel))


def layout(replica_devices: Sequence[Sequence[str]],
           expert_parallel: int) -> list[list[ExpertGroup]]:
    """[replica][device slot] -> the ExpertGroup of that replica's cells on that slot: the
    same slot of the P consecutive replicas of its group; built within `spanning_clients`
    (one replica per process), the same slot of the P consecutive clients of its group."""
    peers = _clients.current()
    if peers is not None and peers.expert_parallel > 1:
        return [[_client_group(peers, device) for device in devices]
                for devices in replica_devices]
    slots = range(len(replica_devices[0]))
    by_slot = [groups_of([devices[s] for devices in replica_devices], expert_parallel)
               for s in slots]
    return [[by_slot[s][r] for s in slots] for r in range(len(replica_devices))]


def check_jit_compile(groups: Sequence[Sequence[ExpertGroup]], jit_compile: bool,
                      where: str) -> None:
    """One line when cells that exchange tokens (any group of `layout`'s has P > 1)
    would be compiled: XLA has no kernel for CollectiveAllToAllV2."""
    if jit_compile and any(g.size > 1 for slots in groups for g in slots):
        raise ValueError(f'{where}: jit_compile=True compiles the cell functions, but XLA has '
                         'no kernel for the expert all-to-all (CollectiveAllToAllV2) that '
                         'expert_parallel > 1 runs: set jit_compile=False')


def building_with(groups: Sequence[ExpertGroup], homes: Sequence[str],
                  inner: Callable[[Sequence[str]], ContextManager]
                  ) -> Callable[[Sequence[str]], ContextManager]:
    """A replica's build scope for a slot's devices (home first): `inner`'s (tensor
    parallelism) inside `building` of the slot's expert group (slot found by its home)."""
    @contextlib.contextmanager
    def scope(devices: Sequence[str]) -> Iterator[None]:
        with building(groups[list(homes).index(devices[0])]), inner(devices):
            yield
    return scope


def mark_expert_variable(var: tf.Variable) -> None:
    """Records that `var` holds 1/P of some experts (its gradient sums over R/P replicas)."""
    _expert_variables[id(var)] = var


def is_expert_variable(var: Any) -> bool:
    return _expert_variables.get(id(var)) is var


def expert_leaves(cell: Cell, theta: dict) -> list[bool]:
    """For each leaf of the cell's flat theta (as `Cell.read_theta` builds it from the
    pipeline's variables `theta`): whether it is an expert weight held 1/P."""
    out = {n: tf.nest.map_structure(is_expert_variable, theta[n]) for n in cell.names}
    ties_lib.read_into(out, theta, cell.ties, is_expert_variable)
    return tf.nest.flatten(out)


class WholeExperts:
    """Each expert weight of the pipeline as one `variable_shards.ShardedWeight` over the P
    members of replica group 0 (replicas 0..P-1), so that checkpoints, which take replica
    0's variables through `whole_view`, save all E experts under the layer's path ([E, D,
    H] for `.../moe/wi`) and restore them into any P: a P=2 checkpoint resumes at P=1 or
    P=4, as tensor-parallel shards do at any T. Not a tf.Module, so that the pipeline
    does not count other replicas' variables as its own; it only keeps them alive."""

    def __init__(self, replica_variables: Sequence[dict[str, tf.Variable]], expert_parallel: int):
        self.weights = [
            variable_shards.ShardedWeight(path, [replica_variables[r][path]
                                                 for r in range(expert_parallel)], 0,
                                          checkpoint_only=True)
            for path, var in replica_variables[0].items()
            if expert_parallel > 1 and is_expert_variable(var)]


class ClientExperts:
    """A trainer client's expert weights (this client's E/P experts of each MoE layer,
    built within `spanning_clients`), which checkpoints hold whole as in one process
    (WholeExperts), with their optimizer slots (`parts`, once the optimizer joined its
    slots: optimizers.whole_slots). Only the chief reads and writes checkpoints:
    across_clients.SplitValues moves the rows. A fresh run keeps its initial rows: each
    client's experts are its slice of the P=1 initial value already (moe_experts.py)."""

    def __init__(self, peers: across_clients.Peers, variables: dict[str, tf.Variable]):
        p = peers.expert_parallel
        self._weights = [variable_shards.ClientSlices(path, var, peers.index % p, p)
                         for path, var in sorted(variables.items()) if is_expert_variable(var)]
        for weight in self._weights:
            variable_shards.save_whole_as(weight.part, weight)

    @property
    def parts(self) -> list[variable_shards.ClientSlices]:
        """The weights, then their slots, in an order every client agrees on."""
        return self._weights + [s for w in self._weights
                                for s in sorted(w.slots.values(), key=lambda s: s.path)]


def source_replica(replica: int, var: tf.Variable, expert_parallel: int) -> int:
    """Whose value replica `replica` copies after a restore: replica 0's, or for an expert
    weight that of the member of group 0 with the same rank (it holds the same experts)."""
    return replica % expert_parallel if is_expert_variable(var) else 0


def check_even(sizes: Sequence[int], expert_parallel: int, where: str) -> None:
    """All-to-all chunks are equal: with P > 1 every micro-batch must have one size."""
    if expert_parallel > 1 and len(set(sizes)) > 1:
        raise ValueError(f'{where}: a batch of {sum(sizes)} cuts into uneven micro-batches '
                         f'{list(sizes)}, but expert_parallel={expert_parallel} exchanges equal '
                         'all-to-all chunks: use a batch divisible by num_replicas x '
                         'num_micro_batches')


def all_reduce_grads(per_replica: Sequence[Sequence[tf.Tensor]], devices: Sequence[str],
                     is_expert: Sequence[bool], expert_parallel: int) -> list[list[tf.Tensor]]:
    """replicas.all_reduce_sum of one cell's flat gradients, except that an expert
    weight's gradient is summed only over the R/P replicas holding the same experts
    (replica r with r % P = its rank); every other gradient over all R."""
    if expert_parallel == 1 or not any(is_expert):
        return replicas.all_reduce_sum(per_replica, devices)
    num = len(per_replica)
    out: list[list] = [[None] * len(is_expert) for _ in range(num)]
    shared = [i for i, e in enumerate(is_expert) if not e]
    parts = [(list(range(num)), shared)] + [
        (expert_data_parallel(num, expert_parallel, rank), [i for i, e in enumerate(is_expert)
                                                           if e])
        for rank in range(expert_parallel)]
    for members, indices in parts:
        if not indices:
            continue
        reduced = replicas.all_reduce_sum([[per_replica[r][i] for i in indices]
                                           for r in members], [devices[r] for r in members])
        for r, sums in zip(members, reduced):
            for i, g in zip(indices, sums):
                out[r][i] = g
    return out


def spanning_clients(peers: across_clients.Peers) -> ContextManager:
    """Pipelines built inside are client `peers.index`'s replica of `peers.count`: with
    `peers.expert_parallel` P > 1 their MoE layers hold this client's E/P experts and
    exchange tokens with the other P-1 clients of its group (their own params say P=1:
    each process holds one replica, whose local steps know nothing of the others)."""
    return _clients.setting(peers)


def _client_group(peers: across_clients.Peers, device: str) -> ExpertGroup:
    p = peers.expert_parallel
    first = peers.index - peers.index % p
    members = tuple(range(first, first + p))
    return ExpertGroup((device,) * p, peers.index % p, across_clients.group_key(device, members))


def all_reduce_across_clients(peers: across_clients.Peers, grads: Sequence[tf.Tensor],
                              device: str, is_expert: Sequence[bool]) -> list[tf.Tensor]:
    """across_clients.all_reduce_sum of one cell's flat gradients, except that an expert
    weight's gradient is summed only over the clients holding the same experts (none
    when P is the number of clients); every other gradient over all clients."""
    if peers.expert_parallel == 1 or not any(is_expert):
        return across_clients.all_reduce_sum(peers, grads, device)
    out = list(grads)
    # The clients holding the same experts as this one.
    members = expert_data_parallel(peers.count, peers.expert_parallel, peers.index)
    for indices, among in (([i for i, e in enumerate(is_expert) if not e], ()),
                           ([i for i, e in enumerate(is_expert) if e], members)):
        if not indices or len(among) == 1:
            continue
        summed = across_clients.all_reduce_sum(peers, [grads[i] for i in indices], device,
                                               members=among)
        for i, g in zip(indices, summed):
            out[i] = g
    return out


def sum_over_client_group(peers: across_clients.Peers, value: tf.Tensor,
                          device: str) -> tf.Tensor:
    """`value` summed over this client's expert group (the P consecutive clients that
    together hold every expert once), on `device`: e.g. the expert gradients' squares,
    which the global norm must count once per expert rank, not once per client."""
    first = peers.index - peers.index % peers.expert_parallel
    members = list(range(first, first + peers.expert_parallel))
    total, = across_clients.all_reduce_sum(peers, [value], device, members=members)
    return total


def building(group: ExpertGroup) -> ContextManager:
    """MoE layers created inside hold their share of experts for `group` (PipeliningLayer
    sets it around each replica's cells; outside, a layer holds all experts)."""
    return _building.setting(group)


def current_group() -> ExpertGroup:
    """The expert group being built for: the current replica cell's, else SINGLE."""
    return _building.current()


def instance_key(group: ExpertGroup, name: str) -> int:
    """The instance key every member of `group` uses for collective `name` (a layer path,
    a role, a shape): allocated on the first member's request, found by the others."""
    key = (tuple(group.devices), group.client_key, name)
    with _lock:
        if key not in _instance_keys:
            # Across clients, in the clients' common trace order (across_clients).
            _instance_keys[key] = (across_clients.next_instance() if group.client_key
                                   else replicas.new_instance_key())
        return _instance_keys[key]


def _ordering_token(device: str) -> tf.Tensor:
    """The handle of `device`'s ordering variable (created once, outside any function)."""
    with _lock:
        var = _tokens.get(device)
        if var is None:
            with tf.init_scope(), tf.device(device):
                var = tf.Variable(0.0, trainable=False, name='collective_ordering')
            _tokens[device] = var
    return var.handle


def _raw_all_to_all(x: tf.Tensor, group: ExpertGroup, key: int) -> tf.Tensor:
    """The op wants a first dimension of exactly P: x is sent as [P, the rest flat]."""
    device = group.devices[group.rank]
    with tf.device(device):
        y = tf.raw_ops.CollectiveAllToAllV2(
            input=tf.reshape(x, [group.size, -1]), group_size=group.size,
            group_key=group.client_key or replicas.group_key(group.devices), instance_key=key,
            ordering_token=[_ordering_token(device)], communication_hint='auto')
        return tf.reshape(y, x.shape)


def all_to_all(x: tf.Tensor, group: ExpertGroup, name: str) -> tf.Tensor:
    """This member's all-to-all of x [P*n, ...]: chunk j of every member's x along axis 0
    arrives here as chunk j of the output from member j (chunk i of the output is what
    member i sent). Its gradient is the all-to-all of the output gradient back.

    Every member must call it with the same `name` and shape, in the same order
    relative to its other collectives; inside a tf.function only (eagerly a member
    would wait for the others, which the single Python thread has not issued).
    """
    if group.size == 1:
        return x
    if tf.executing_eagerly():
        raise ValueError(f'expert parallel all-to-all {name!r} called eagerly: its '
                         f'{group.size} members must be built into one tf.function (a '
                         'pipeline step); call the layer with expert_parallel=1 eagerly')
    if x.shape[0] is None or x.shape[0] % group.size:
        raise ValueError(f'all-to-all {name!r}: the first dimension {x.shape[0]} must split '
                         f'into {group.size} equal chunks')
    # TensorFlow keeps an instance's shape for the life of the process: one key per shape.
    what = f'{name}/{x.dtype.name}{x.shape.as_list()}'
    forward, backward = instance_key(group, f'{what}/fwd'), instance_key(group, f'{what}/bwd')

    @tf.custom_gradient
    def exchange(x):
        y = _raw_all_to_all(tf.stop_gradient(x), group, forward)

        def grad(dy):
            return _raw_all_to_all(tf.convert_to_tensor(dy), group, backward)
        return y, grad
    return exchange(x)
