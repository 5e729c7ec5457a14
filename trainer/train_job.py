"""The trainer job: the synchronous SGD loop over the pipelined step.

One step = `task.ForwardBackward` (GPipe over all micro-batches, gradients
summed per cell) -> global-norm clipping -> optimizer update, in one
tf.function. The checkpoint holds the model (by layer path), the optimizer
slots, the global step and the input's position (epoch and index, not the
shuffle buffer), so a resumed run sees exactly the data an uninterrupted run
would have seen.

With data-parallel replicas (`task.pipeline.num_replicas` R > 1) each replica
has its own copy of the variables and an optimizer with slots on its own
devices, gets the all-reduced gradients and applies the same update, so the
copies stay identical; only replica 0's copy and optimizer are checkpointed,
and a restore copies them into the others. With expert parallelism P (replicas
0..P-1 each hold 1/P of every MoE layer's experts) each expert weight and its
slots are saved whole, joined from replicas 0..P-1, and a restore gives every
replica those of its own experts. With `task.train.shard_optimizer_states`
one ShardedOptimizer holds every replica's part of the slots instead, and
checkpoints them whole.

As one of several trainer clients (`peers`, tfpipe/clients.py) the trainer holds
one replica; only the chief (client 0) touches its train dir: it restores,
saves and writes summaries. The others need no logdir: at the start of `run()`
every client receives the chief's weights, optimizer slots, step and input
position over the collective runtime. With sharded optimizer states each client
holds 1/R of the slots: every save all-gathers them so that the chief's
checkpoint holds them whole, and at start each client receives its part of the
chief's. With expert parallelism across clients each client's experts (and their
slots) travel the same way: gathered whole at each save, cut from the chief's at start.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import glob
import math
import os
import re
import shutil
import statistics
import time
from typing import Optional

import tensorflow as tf
from absl import logging

from tfpipe import checkpoint_writer, checkpoints, fprop_context, lr_schedules
from tfpipe.base_layer import flatten_by_path
from tfpipe.hyperparams import Params
from tfpipe.optimizers import BaseOptimizer
from tfpipe.pipeline import across_clients, expert_parallel, replicas, sharding
from tfpipe.pipeline.recorder import Recorder
from tfpipe.pipeline.sharded_optimizer import ShardedOptimizer
from tfpipe.tasks import classifier
from tfpipe.tuning import first_step_memory, timeline
from trainer import batch_split, experiment, progress_report, stop_signals
from trainer.guarded_update import guarded_update
from trainer.runtime_options import TASK_TRAIN_OPTIONS, RuntimeOptions, check_positive_int
from trainer.throughput import Progress, Throughput, measure_for


# Errors of a save that point at a lost peer (checkpoint I/O runs on the trainer, but the
# values come from the workers), not at the trainer's disk.
_LOST_PEER_ERRORS = (tf.errors.UnavailableError, tf.errors.AbortedError,
                     tf.errors.CancelledError)


# Trainer.signal_grace: how long a client that got SIGINT/SIGTERM may stay blocked.
SIGNAL_GRACE_FACTOR = 3.0
MIN_SIGNAL_GRACE = 10.0
# The derived step deadline (Trainer.step_timeout): a multiple of the median of the last
# STEP_TIMEOUT_WINDOW steps, never below MIN_STEP_TIMEOUT seconds.
STEP_TIMEOUT_FACTOR = 20.0
MIN_STEP_TIMEOUT = 60.0
UNMEASURED_STEP_TIMEOUT = 600.0
STEP_TIMEOUT_WINDOW = 50


class NonFiniteLossError(RuntimeError):
    pass


class Trainer:
    """Builds the task, optimizer, input and checkpoint; `run()` trains."""

    def __init__(self, params: Params, train_dir: str, options: RuntimeOptions,
                 peers: Optional[across_clients.Peers] = None):
        options.apply_to(params)  # the params it saves with its checkpoints say what it ran
        tp = params.task.train
        for name in TASK_TRAIN_OPTIONS:
            check_positive_int(f'task.train.{name}', getattr(tp, name))
        self.max_steps = tp.max_steps
        self.save_interval = tp.save_interval_steps
        self.summary_interval = tp.summary_interval_steps
        self.train_dir = train_dir
        self.params = params
        self.peers = peers
        self.split = self._resume_split()  # may set task.pipeline.num_micro_batches
        self.trace_step = options.pipeline_trace_step
        if self.trace_step is not None and self.trace_step > self.max_steps:
            raise ValueError(f'--pipeline_trace_step={self.trace_step} is beyond max_steps='
                             f'{self.max_steps}: pick a step in 1..{self.max_steps}')
        with (expert_parallel.spanning_clients(peers) if peers is not None
              else contextlib.nullcontext()):
            self.task = params.task.Instantiate()
        self.task.CheckInput(params.input.train)
        self.batch_size = params.input.train.batch_size
        self.input_share = None  # a client reads only its examples of each global batch
        if peers is not None:
            self.input_share = replicas.examples_of_group(
                self.batch_size, self.split.micro_batches, peers.count, peers.index,
                'task.pipeline')
            self.task.pipe.JoinClients(peers, global_batch_size=self.batch_size)
        self.optimizers: list[BaseOptimizer] | ShardedOptimizer
        stage = sharding.stage_of(tp, count=peers.count if peers else
                                  params.task.pipeline.num_replicas)
        if stage == sharding.WEIGHTS:
            # The layers now hold each replica's parts.
            self.task.pipe.ShardWeights(per_micro_batch=tp.regather_per_micro_batch)
            held, whole = self.task.pipe.weight_shards.Bytes()
            logging.info('weights: %d bytes per replica, %d unsharded', held, whole)
        self.replica_variables = [{p: v for p, v in copy.items() if v.trainable}
                                  for copy in self.task.pipe.ReplicaVariablesByPath()]
        self.variables = self.replica_variables[0]
        # A client's experts: checkpointed whole (before the optimizer's slots are joined;
        # at stage 3 as its weight parts, by the weight shards).
        experts = (expert_parallel.ClientExperts(peers, self.task.VariablesByPath())
                   if peers is not None and peers.expert_parallel > 1
                   and stage != sharding.WEIGHTS else None)
        if stage != sharding.NONE:
            if stage == sharding.GRADIENTS:
                self.task.pipe.DeferGradientSum()  # reduce-scattered by the optimizer
            shards = self.task.pipe.weight_shards
            self.optimizers = ShardedOptimizer(tp.optimizer, self.replica_variables, peers,
                                               shard_gradients=stage == sharding.GRADIENTS,
                                               weight_shapes=shards.shapes if shards else None,
                                               expert_parallel=peers.expert_parallel
                                               if peers else
                                               params.task.pipeline.expert_parallel)
            self.optimizer = self.optimizers
            held, whole = self.optimizers.SlotBytes()
            logging.info('optimizer slots: %d bytes per replica in this process, %d unsharded',
                         held, whole)
        else:
            self.optimizers = [tp.optimizer.Instantiate() for _ in self.replica_variables]
            for optimizer, variables in zip(self.optimizers, self.replica_variables):
                optimizer.CreateSlots(variables)
            self.optimizer = self.optimizers[0]  # checkpointed; expert slots joined whole
            self.optimizer.JoinReplicaSlots(self.replica_variables[0], list(
                zip(self.replica_variables[1:], self.optimizers[1:])))
        # What clients hold in parts (experts, stage 3's weights): the chief saves it whole.
        parts = [*(experts.parts if experts else []), *(
            self.task.pipe.weight_shards.client_parts if self.task.pipe.weight_shards else [])]
        self.split_values = across_clients.SplitValues(peers, parts) if parts else None
        horizon = lr_schedules.follow_max_steps(tp.lr_schedule, self.max_steps)
        if horizon.message:
            (logging.warning if horizon.warn else logging.info)(horizon.message)
        self.schedule = horizon.params.Instantiate()
        self.learning_rate = tp.learning_rate
        self.clip_norm = tp.clip_gradient_norm_to_value or None
        self.global_step = tf.Variable(0, dtype=tf.int64, trainable=False, name='global_step')
        self.input = params.input.train.Instantiate()
        # Checkpointed as its position in whole global batches, not its buffer: any R restores it.
        self.iterator = self.input.Iterator(self.input_share)
        restored = dict(step=self.global_step, optimizer=self.optimizer, iterator=self.iterator)
        self.checkpoint = checkpoints.make(self.task.VariablesByPath(), **restored)
        # Saved with every checkpoint, never restored: a resumed run reads it (batch_split).
        saved = checkpoints.make(self.task.VariablesByPath(), **restored,
                                 batch_split=batch_split.SplitRecord(self.split))
        # Restoring, a spare record takes the checkpoint's (TensorFlow warns of saved values
        # that nothing restores): this run's record keeps this run's split.
        spare = batch_split.SplitRecord(self.split)
        self._checkpoint_with_record = checkpoints.make(self.task.VariablesByPath(), **restored,
                                                        batch_split=spare)
        self.manager = tf.train.CheckpointManager(
            saved, train_dir, checkpoint_name='ckpt',
            max_to_keep=tp.save_max_to_keep)
        self.writer = checkpoint_writer.CheckpointWriter(
            self.manager, checkpoints.io_options(), options.async_checkpoints, self._saved)
        self._stop_signal: Optional[int] = None
        self._peer_stopping = False  # across clients: some client got SIGINT/SIGTERM (agreed)
        self._restored: Optional[str] = None
        self._saved_this_run = False
        # (last finished step, when it or a later save finished), None before the first
        # step: what the cluster watchdog reads to tell a frozen worker from a slow step.
        self.heartbeat: Optional[tuple[int, float]] = None
        self._step_timeout = options.step_timeout_seconds
        self._step_seconds: collections.deque = collections.deque(maxlen=STEP_TIMEOUT_WINDOW)
        self._save_seconds = 0.0  # the longest save of this run
        self._recorder: Optional[Recorder] = None
        self._peak_flops = options.peak_flops
        self._throughput: Optional[Throughput] = None  # known from the first batch

    def _resume_split(self) -> batch_split.Split:
        """This run's replicas x micro-batches: the latest checkpoint's global count kept."""
        pipeline = self.params.task.pipeline
        count = self.peers.count if self.peers is not None else pipeline.num_replicas
        saved = batch_split.saved(self.train_dir) if self._is_chief else None
        if self.peers is not None:
            saved = batch_split.from_chief(self.peers, saved)
        where = (f'the checkpoint in {self.train_dir}' if self._is_chief
                 else "the chief's checkpoint")
        return batch_split.resume(self.params, count, saved, where)

    def step_timeout(self) -> float:
        """Seconds a step may take before the cluster watchdog gives up on a frozen worker.

        trainer.step_timeout_seconds when set; else STEP_TIMEOUT_FACTOR x the median of the
        latest measured steps, at least MIN_STEP_TIMEOUT, so that a frozen worker is named
        within a minute where steps take milliseconds; UNMEASURED_STEP_TIMEOUT until
        STEP_TIMEOUT_WINDOW // 10 steps after the first (whose tracing may take minutes)
        are measured. TensorFlow's coordination service cannot tell sooner: a frozen worker
        still completes TCP handshakes, and the trainer's workers are plain gRPC servers.
        """
        if self._step_timeout is not None:
            return self._step_timeout
        measured = list(self._step_seconds)
        if len(measured) < STEP_TIMEOUT_WINDOW // 10:
            return UNMEASURED_STEP_TIMEOUT
        return max(MIN_STEP_TIMEOUT, STEP_TIMEOUT_FACTOR * statistics.median(measured))

    def restore_latest(self) -> int:
        """Restores the newest complete checkpoint, if any; returns the global step.

        Called twice: to validate before anything is written, and again once the
        train dir is locked, in case a trainer that held it saved meanwhile
        (a no-op when the newest checkpoint is still the one restored).
        """
        if not self._is_chief:
            return int(self.global_step.numpy())  # run() receives the chief's state
        path = checkpoints.latest(self.train_dir)
        if path is not None and path != self._restored:
            begin = time.monotonic()
            checkpoints.check_readable(path)
            checkpoints.restore(self._checkpoint_with_record if batch_split.recorded(path)
                                else self.checkpoint, path)
            self._sync_replicas()
            self._restored = path
            size = sum(os.path.getsize(f) for f in glob.glob(glob.escape(path) + '.*'))
            logging.info('restored %s at step %d: %.2f s, %.2f MB', path,
                         int(self.global_step.numpy()), time.monotonic() - begin, size / 1e6)
        return int(self.global_step.numpy())

    def _sync_replicas(self) -> None:
        """Copies replica 0's restored variables and optimizer state into the other replicas
        (an expert weight's and its slots: those of group 0's member with its experts)."""
        self.task.pipe.SyncReplicas()
        if isinstance(self.optimizers, ShardedOptimizer):
            return  # its slots restore into every replica's part
        replicas.sync_slots(self.optimizers, self.replica_variables, functools.partial(
            expert_parallel.source_replica,
            expert_parallel=self.params.task.pipeline.expert_parallel))

    @property
    def _is_chief(self) -> bool:
        return self.peers is None or self.peers.is_chief

    def _checkpointed_variables(self) -> list[tf.Variable]:
        """Everything a checkpoint restores, in an order every client agrees on (but a
        client's parts: `split_values` sends each client its own)."""
        out = [self.variables[path] for path in sorted(self.variables)]
        out += [v for path, v in sorted(self.task.VariablesByPath().items())
                if not v.trainable]
        out += [self.optimizer.iterations, *(
            self.optimizer.whole_slot_variables if isinstance(self.optimizer, ShardedOptimizer)
            else self.optimizer.slot_variables), self.global_step]
        out += list(getattr(self.iterator, 'variables', ()))  # the input's position
        return [v for v in out if not (self.split_values and self.split_values.holds(v))]

    def _receive_chief_state(self) -> None:
        sharded = isinstance(self.optimizer, ShardedOptimizer) and self.optimizer.spans_clients
        self._broadcast_chief_state(
            self.optimizer.ChiefSlots() if sharded else [],
            self.split_values.ChiefValues() if self.split_values else [])

    @tf.function(autograph=False)
    def _broadcast_chief_state(self, chief_slots, chief_parts):
        across_clients.broadcast_from_chief(self.peers, self._checkpointed_variables(),
                                            self.task.pipe.devices[0])
        if chief_slots:  # sharded optimizer states: each client's part of them
            self.optimizer.ReceiveSlots(chief_slots)
        if chief_parts:  # experts or stage 3's weights: each client's part of them
            self.split_values.Receive(chief_parts)

    def _gather_slots(self) -> contextlib.ExitStack:
        """Across clients with sharded optimizer states, experts or stage 3, every client
        sends its part of the slots and weights at each save, on every client (now, when
        called); the chief saves inside the context, the others close it."""
        stack = contextlib.ExitStack()
        if isinstance(self.optimizer, ShardedOptimizer):
            stack.enter_context(self.optimizer.GatherSlots())
        if self.split_values is not None:
            stack.enter_context(self.split_values.Gathered())
        return stack

    @tf.function(autograph=False)
    def _any_client_says(self, flag):
        """Whether any client passed a positive `flag` (every client calls it at once)."""
        total, = across_clients.all_reduce_sum(self.peers, [flag], self.task.pipe.devices[0])
        return total > 0

    def _chief_lacks_checkpoint(self, step: int) -> bool:
        """Whether the chief's newest checkpoint is older than `step`; every client gets the
        chief's answer, as all take part in a save (the slots' gather)."""
        latest = self.manager.latest_checkpoint
        lacks = latest is None or checkpoints.step_of(latest) != step
        if self.peers is None:
            return lacks
        return bool(self._any_client_says(tf.constant(float(lacks and self._is_chief))))

    @property
    def _stopping(self) -> bool:
        return self._peer_stopping if self.peers is not None else self._stop_signal is not None

    def _agree_on_stop(self) -> None:
        """After each step of a client: stop when any client got a signal, all at this step.

        A client acts on the agreed flag, never on its own signal alone: one that
        stopped by itself would leave the others waiting in the next step's
        collectives. (TensorFlow's PreemptionCheckpointHandler agrees on a step
        the same way, through the coordination service.)
        """
        own = tf.constant(0.0 if self._stop_signal is None else 1.0)
        self._peer_stopping = bool(self._any_client_says(own))

    # autograph=False: the step's Python is static (its control flow on tensors is tf.cond
    # and tf.where, the cells' functions are traced without AutoGraph already), and
    # converting it costs ~1.5 s of CPU at every trainer start, ~15% of a short run's.
    @tf.function(autograph=False)
    def _step(self, batch):
        """One synchronous step; the update is skipped when loss or gradients are not finite."""
        return self._build_step(batch, record=False)

    @tf.function(autograph=False)
    def _recorded_step(self, batch):
        """The same step with every pipeline task time-stamped (--pipeline_trace_step)."""
        return self._build_step(batch, record=True)

    def _build_step(self, batch, record: bool):
        step, aux = self.global_step, fprop_context.AuxLossSink()  # the body's, reported
        recording = self.task.pipe.RecordTimeline() if record else contextlib.nullcontext()
        with fprop_context.training(step=step), fprop_context.scope(aux_losses=aux), \
                recording as recorder:
            loss, grads = self.task.ForwardBackward(self.task.theta, batch)
        lr = self.learning_rate * self.schedule.Value(step + 1)  # step + 1: the update number
        norm = guarded_update(
            loss, [flatten_by_path(g, self.task.path) for g in
                   (grads if isinstance(grads, list) else [grads])],
            self.clip_norm, self.optimizers, self.replica_variables, lr, step,
            self.task.pipe.params.expert_parallel, self.peers, self.task.pipe.devices[0])
        aux = {**aux.metrics(), **aux.statistics()}  # 'name' and 'name/layer path'
        if not record:
            return loss, norm, lr, aux
        self._recorder = recorder
        return loss, norm, lr, aux, recorder.stamps()

    @tf.function(autograph=False)
    def _weights_are_finite(self):
        held = ([v for copy in self.replica_variables for v in copy.values()]
                if self.task.pipe.weight_shards else self.variables.values())  # stage 3: parts
        return tf.reduce_all([tf.reduce_all(tf.math.is_finite(v)) for v in held])

    def run(self) -> int:
        """Trains to max_steps; returns the final step. SIGINT/SIGTERM save and return; a
        trainer client blocked in collectives its peers do not join exits 1 instead."""
        deadline = None if self.peers is None else stop_signals.Deadline(
            acted=lambda: self._peer_stopping, grace=self.signal_grace,
            progress=lambda: self.heartbeat and self.heartbeat[1], message=self._blocked_message)
        with stop_signals.StopSignals(self._record_signal, deadline):
            try:
                return self._loop()
            finally:  # the last save (also on a signal or an error) ends before the run
                self.wait_for_save()

    def _record_signal(self, signum: int) -> None:
        self._stop_signal = signum

    def signal_grace(self) -> float:
        """SIGNAL_GRACE_FACTOR x the longest recent step (one after the chief's save waits for
        it) or save, at least MIN_SIGNAL_GRACE: a healthy client that got a signal finishes
        a step or save within that, so one that does not waits for peers that will not come."""
        return max(MIN_SIGNAL_GRACE,
                   SIGNAL_GRACE_FACTOR * max([*self._step_seconds, self._save_seconds]))

    def _blocked_message(self, name: str, seconds: float) -> str:
        return (f'{name}: trainer client {self.peers.index} has been blocked for {seconds:.0f} '
                f's after step {self.heartbeat[0] if self.heartbeat else 0}, in its input or in '
                'collectives its peers do not join (one is stuck, or runs another step or '
                'save), so the clients cannot agree on a step to save: stopped without '
                "saving; restart every client, which resumes from the chief's last checkpoint")

    def _loop(self) -> int:
        if self.peers is not None:
            self._receive_chief_state()
        step = int(self.global_step.numpy())
        writer = (tf.summary.create_file_writer(self.train_dir) if self._is_chief
                  else tf.summary.create_noop_writer())
        start_step, start_time = step, time.time()
        progress = Progress(self.max_steps, start_time)
        out_of_data = False
        if self.trace_step is not None and self.trace_step <= step:
            logging.warning('--pipeline_trace_step=%d: step %d is already done in %s; no '
                            'timeline recorded', self.trace_step, self.trace_step,
                            self.train_dir)
        while step < self.max_steps and not self._stopping:
            try:
                batch = next(self.iterator)
            except StopIteration:
                out_of_data = True
                break
            if self.heartbeat is None:
                self._log_input_bytes()
                self._throughput = self._measure_throughput(batch)
                # Before the first step traces: a model too big for the host says so.
                need = first_step_memory.predict(
                    self.task.pipe, self.params.task.pipeline.body,
                    self.task.PipelineInputs(batch),
                    [v for variables in self.replica_variables for v in variables.values()])
                if need is not None:
                    (logging.warning if need.exceeds else logging.info)('%s', need.line())
            begin = time.monotonic()
            try:
                if step + 1 == self.trace_step:
                    loss, norm, lr, aux, stamps = self._recorded_step(batch)
                    if self._is_chief:
                        self._write_timeline(step + 1, stamps.numpy(), writer)
                else:
                    loss, norm, lr, aux = self._step(batch)
                loss, norm = float(loss), float(norm)
            except tf.errors.InvalidArgumentError as e:
                label = classifier.bad_label(e)
                if label is None:
                    raise
                raise ValueError(self._bad_label_message(label, step + 1)) from None
            if not (math.isfinite(loss) and math.isfinite(norm)):
                self._non_finite(f'loss is {loss} and gradient norm {norm} at step {step}')
            if self.heartbeat is not None:  # the run's first step traces: not a measure
                self._step_seconds.append(time.monotonic() - begin)
            step += 1
            if self.peers is not None:
                self._agree_on_stop()
            self.heartbeat = (step, time.monotonic())
            progress.step_done(step, time.time())
            if step % self.summary_interval == 0 or step == self.max_steps:
                # The auxiliary losses reach the host only on the steps that report them.
                self._report(writer, progress, step, loss, norm, float(lr),
                             {n: v.numpy() for n, v in aux.items()})
            if step % self.save_interval == 0 or step == self.max_steps:
                self.save(step)
        if out_of_data:
            logging.warning('input.train ran out of data after step %d of %d (it does not '
                            'repeat): saving a checkpoint and stopping; set '
                            'input.train.repeat=True to train to max_steps', step,
                            self.max_steps)
        if self._stopping:
            logging.info('signal %s: saving a checkpoint at step %d and stopping',
                         self._stop_signal or 'to another client', step)
        self.wait_for_save()  # the manager knows its latest checkpoint once it is listed
        if (out_of_data or self._stopping) and self._chief_lacks_checkpoint(step):
            self.save(step)
        writer.flush()
        elapsed = time.time() - start_time
        logging.info('trained steps %d..%d in %.1fs', start_step, step, elapsed)
        return step

    def _log_input_bytes(self) -> None:
        """What this process reads per step: its share of the global batch, once per run."""
        share = self.input_share or range(self.batch_size)
        who = (f'client {self.peers.index} of {self.peers.count}' if self.peers is not None
               else 'this trainer')
        logging.info('input: %s reads examples %d..%d of each global batch of %d: %d bytes '
                     'per step (the global batch: %d)', who, share.start, share.stop - 1,
                     self.batch_size, self.iterator.batch_bytes,
                     self.iterator.batch_bytes // len(share) * self.batch_size)

    def _measure_throughput(self, batch) -> Throughput:
        """What one step of this process processes, its FLOPs and the peak they run at."""
        unit, per_example = self.task.ThroughputUnit(batch)
        used = {d for cells in self.task.pipe.replica_cells for cell in cells
                for d in cell.shard_devices}
        kind = tf.DeviceSpec.from_string(next(iter(used))).device_type or 'CPU'
        # The rate counts the global batch (every client's share); the FLOPs this
        # process's share, over this process's devices' peak: the same MFU.
        return measure_for(self.task.pipe, self.task.PipelineInputs(batch), unit,
                           per_example * self.batch_size, self._peak_flops, kind, len(used))

    def _report(self, writer, progress: Progress, step: int, loss: float, norm: float,
                lr: float, aux: dict) -> None:
        progress_report.report(writer, progress, self._throughput, step, self.max_steps,
                               self.batch_size, {'loss': loss, **aux}, norm, lr)

    def _write_timeline(self, step: int, stamps, writer) -> None:
        line = timeline.Timeline.from_stamps(self._recorder, stamps)
        paths = line.write(self.train_dir, step)
        with writer.as_default():
            line.write_summaries(step)
        logging.info('step %d: %s; wrote %s', step, line.summary(), ' and '.join(paths))

    def _bad_label_message(self, label: int, step: int) -> str:
        """Bad input found only while training: the label, the class count and the input."""
        train = self.params.input.train
        source = (f'examples_fn {train.examples_fn}({train.split!r})' if 'examples_fn' in train
                  else f'dataset {train.dataset}, split {train.split}')
        return (f'input.train ({source}) gave label {label} at step {step}, outside [0, '
                f'{self.params.task.num_classes}) for task.num_classes='
                f'{self.params.task.num_classes}: fix the labels the input yields or set '
                'task.num_classes to the number of classes')

    def _non_finite(self, what: str) -> None:
        raise NonFiniteLossError(
            f'{what}: training stopped; the last good checkpoint in {self.train_dir} is kept. '
            'Lower task.train.learning_rate or set task.train.clip_gradient_norm_to_value')

    def save(self, step: int) -> None:
        """Saves a checkpoint numbered `step`: in the background with
        trainer.async_checkpoints (after the previous save ends), else before returning.
        A failed save leaves no partial files.

        Only the chief saves: every client holds the same values (but for sharded
        optimizer states, whose parts every client sends it here, at this call on every
        client: the chief's snapshot of them is taken inside that exchange).
        """
        begin = time.monotonic()
        gathered = self._gather_slots()
        if not self._is_chief:
            gathered.close()
            return
        if not bool(self._weights_are_finite()):
            self._non_finite(f'the weights after step {step} are not finite')
        self.wait_for_save()
        with gathered:
            try:
                self.writer.save(step)
            except (OSError, tf.errors.OpError) as e:  # a synchronous save that failed
                self._save_failed(step, e)
        self._save_seconds = max(self._save_seconds, time.monotonic() - begin)
        self._note_save_progress()

    def wait_for_save(self) -> None:
        """Waits for the save in flight, if any, raising its failure (CheckpointError)."""
        try:
            self.writer.wait()
        except (OSError, tf.errors.OpError) as e:
            self._save_failed(self.writer.step_in_flight, e)

    def _save_failed(self, step: int, e: Exception) -> None:
        self._remove_partial_save(step)
        if isinstance(e, _LOST_PEER_ERRORS):
            raise e  # a worker died during the save: the cluster watchdog names it
        last = checkpoints.latest(self.train_dir)  # from disk: the state file may be older
        raise checkpoints.CheckpointError(
            f'saving checkpoint ckpt-{step} in {self.train_dir} failed '
            f'({_reason(e)}); its partial files were removed: free '
            f'space there and restart, which resumes from '
            f'{os.path.basename(last) if last else "step 0"}') from None

    def _note_save_progress(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat = (self.heartbeat[0], time.monotonic())  # a slow save is progress

    def _saved(self, record: checkpoint_writer.SaveRecord) -> None:
        """Once a checkpoint is listed (in the writer thread when asynchronous)."""
        logging.info('%s', record.line())
        self._note_save_progress()
        if not self._saved_this_run:
            # From now on the checkpoints are this run's: params.txt must describe them.
            experiment.write_params(os.path.join(self.train_dir, experiment.PARAMS_FILE),
                                    self.params)
            self._saved_this_run = True

    def _remove_partial_save(self, step: int) -> None:
        """Deletes what a failed save of `step` left: its temp dir and unlisted data files."""
        prefix = os.path.join(self.train_dir, f'ckpt-{step}')
        if prefix in self.manager.checkpoints:
            return  # listed as complete: never delete a checkpoint the state file names
        for path in glob.glob(glob.escape(prefix) + '_temp*'):
            shutil.rmtree(path, ignore_errors=True)
        for path in glob.glob(glob.escape(prefix) + '.*'):
            os.remove(path)


def _reason(error: Exception) -> str:
    """'No space left on device' out of an OSError or a TF op error naming a temp file."""
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    text = checkpoints.one_line(str(error)).rsplit('; ', 1)[-1]
    return re.sub(r'\s*\[Op:\w+\]$', '', text)[:200]


def train_dir_of(logdir: str) -> str:
    """Where the trainer writes checkpoints; the evaler and decoder read them there."""
    return os.path.join(logdir, 'train')
