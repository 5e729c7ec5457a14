"""Trainer clients agree on what they run before the first step, or all refuse.

Each client of a run (tfpipe/clients.py) loads its params from its own flags,
so nothing stops two of them from disagreeing: one with learning rate 0.4 and
one with 0.004 used to train to the end and the chief saved the mix; another
--model or num_micro_batches ended in a TensorFlow traceback; another
--max_steps left one client waiting for a step its peer never ran, and another
trace step or save interval (gin's trainer.*) left both deadlocked in collectives
of different functions. So before the chief claims its logdir every client
all-gathers a fingerprint (the model name, the params as text with the trainer's
options applied, every other option of its training loop, the cluster as it sees
it, its task index) over the
collective runtime the step uses anyway, compares all of them with the chief's,
and, if any differ, every client refuses with the same line naming what
differs (exit 2). The gather has a deadline: two clients that both believe
they are task 0 (the same addresses in another order) each lead a group of
their own and would wait for each other forever.
"""
from __future__ import annotations

import json
import time
from typing import Mapping, Optional, Sequence

from absl import logging

from tfpipe.clients import TRAINER
from tfpipe.cluster import ClusterError, lost_worker_error

# A group of its own: across_clients' groups are 1 + device index (CPU) and 100001 + index.
GROUP_KEY = 300001
# Instance keys out of reach of across_clients' counter, which starts at 1.
_LENGTHS_KEY, _BYTES_KEY = 1 << 30, (1 << 30) + 1
MAX_KEYS_SHOWN = 3


def fingerprint(model: str, params, clients, settings: Mapping[str, str]) -> dict:
    """What must be equal on every client, plus this client's task index.

    `params` as the trainer will run them and `settings` the rest of what decides
    which collectives its steps and saves run (the trainer's options, e.g.
    'trainer.pipeline_trace_step'), compared key by key like params. `data_dir`
    keys are left out: each host may keep its own copy of the datasets
    (--tfds_data_dir).
    """
    lines = (line.partition(' : ') for line in params.ToText().splitlines())
    compared = {key: value for key, _, value in lines if key and not key.endswith('.data_dir')}
    return {'model': model, 'cluster': list(clients.addresses), 'task': clients.task_index,
            'params': {**compared, **settings}}


def check(clients, mine: dict, timeout_seconds: float) -> None:
    """Gathers every client's fingerprint; raises ClusterError (exit 2) if they differ."""
    import tensorflow as tf
    data = json.dumps(mine, sort_keys=True).encode()
    start = time.monotonic()
    try:
        texts = _all_gather(clients, data, timeout_seconds)
    except tf.errors.DeadlineExceededError:
        raise ClusterError(
            f'the trainer clients did not all join the start-up check within '
            f'{timeout_seconds:g} s, though every client\'s port answers: two clients may '
            'both run as one task (e.g. the same addresses in another order with the same '
            '--task), or one is stuck; give every client the same cluster spec and its own '
            '--task, or raise --cluster_wait_seconds') from None
    except tf.errors.OpError as e:
        lost = lost_worker_error(clients, e)
        if lost is not None:
            raise lost from e
        raise
    problem = disagreement([json.loads(text) for text in texts])
    if problem:
        raise ClusterError(problem)
    logging.info('the %d trainer clients agree (fingerprints of %d bytes, gathered in %.2f s)',
                 clients.count, len(data), time.monotonic() - start)


def disagreement(fingerprints: Sequence[dict]) -> Optional[str]:
    """The one-line refusal naming what differs from the chief's fingerprint, or None."""
    by_task: dict[int, list[dict]] = {}
    for fp in fingerprints:
        by_task.setdefault(fp['task'], []).append(fp)
    for task, same in sorted(by_task.items()):
        if len(same) > 1:
            where = ', '.join(fp['cluster'][task] for fp in same)
            return (f'{len(same)} trainer clients run as task {task} (at {where}): give '
                    'every client the same cluster spec and its own --task')
    chief = by_task.get(0, [fingerprints[0]])[0]
    problems = []
    for task, (fp,) in sorted(by_task.items()):
        if task != chief['task']:
            problems += _differences(task, fp, chief)
    if not problems:
        return None
    return ('the trainer clients disagree, so none starts: ' + '; '.join(problems) +
            ': give every client the same --model, --max_steps, --pipeline_trace_step, '
            'overrides, gin files and bindings and cluster spec (only the task index differs)')


def _differences(task: int, fp: dict, chief: dict) -> list[str]:
    out = []
    if fp['model'] != chief['model']:
        out.append(f"client {task}'s --model={fp['model']} differs from the chief's "
                   f"{chief['model']}")
    if fp['cluster'] != chief['cluster']:
        out.append(f"client {task}'s cluster {','.join(fp['cluster'])} differs from the "
                   f"chief's {','.join(chief['cluster'])}")
    mine, theirs = fp['params'], chief['params']
    keys = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
    for key in keys[:MAX_KEYS_SHOWN]:
        out.append(f"client {task}'s {key}={mine.get(key, '(unset)')} differs from the "
                   f"chief's {theirs.get(key, '(unset)')}")
    if len(keys) > MAX_KEYS_SHOWN:
        out.append(f'and {len(keys) - MAX_KEYS_SHOWN} more params')
    return out


def _all_gather(clients, data: bytes, timeout_seconds: float) -> list[bytes]:
    """Every client's `data`, in task order, over the collective runtime.

    Two gathers: the lengths, then the bytes padded to the longest (a gather
    needs one shape on every member). Bytes travel as int32: CPU gathers take
    no uint8.
    """
    import numpy as np
    import tensorflow as tf
    from tensorflow.python.ops import collective_ops  # the public tf.distribute wraps these
    count = clients.count
    device = f'/job:{TRAINER}/replica:0/task:{clients.task_index}/device:CPU:0'

    @tf.function(autograph=False)
    def gather(values, instance_key):
        with tf.device(device):
            return collective_ops.all_gather(values, count, GROUP_KEY, instance_key,
                                             timeout=timeout_seconds)

    lengths = gather(tf.constant([len(data)], tf.int32), _LENGTHS_KEY).numpy()
    longest = int(lengths.max())
    padded = np.zeros([longest], np.int32)
    padded[:len(data)] = np.frombuffer(data, np.uint8)
    rows = gather(tf.constant(padded), _BYTES_KEY).numpy().reshape(count, longest)
    return [row[:n].astype(np.uint8).tobytes() for row, n in zip(rows, lengths)]
