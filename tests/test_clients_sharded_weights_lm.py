"""ZeRO stages 2 and 3 with Adafactor across 2 trainer clients, on the LM.

Two trainer clients (real processes on loopback), each one replica of
lm.pystdlib.TinyTransformerLM (K=2, M=2, recompute, the softmax tied to the embedding),
at task.train.sharding='gradients' (each keeps half of every gradient sum and
updates half of every weight) and at 'weights' (each also holds only half of every
weight between steps), with Adafactor (factored, momentum,
parameter scale): its statistics are of the whole weight, so a factored moment of the
258 x 32 embedding sums rows that lie in both clients' parts, and the 258-entry output
bias's unfactored moment and RMS span both parts. They must train as one process with
R=2 unsharded replicas does: loss at every step and the chief's checkpoint key by key
(whole weights, whole slots) within 1e-5. 258 is even, so at 2 clients each part is
exactly half of the bias (checked: each client holds half the weight bytes, no
padding); a part padded past a weight's end (258 at R=4) is tests/test_sharded_weights.py's
fc3 bias, in one process. oneDNN is off in every process; each is stopped by its PID in
teardown (the `processes` fixture).
"""
import os
import re

import numpy as np
import pytest

from tests import trainer_helpers as th
from tests.test_clients import free_port

MODEL = 'lm.pystdlib.TinyTransformerLM'
STEPS = 4
STAGES = ('gradients', 'weights')
EXACT = {'TF_ENABLE_ONEDNN_OPTS': '0'}
WEIGHT_BYTES = re.compile(r'weights: (\d+) bytes per replica, (\d+) unsharded')
# A softmax ignores a bias added to every key: its gradient is rounding noise, which
# Adafactor's normalised update scales to steps of lr x 1e-3 (its parameter scale's
# floor): zero in exact arithmetic, here small, not equal (tests/test_clients_experts.py).
KEY_BIAS = re.compile(r'atten(\.S|-)key(\.S|-)b/')


def _flags(optimizer_file: str, **overrides) -> list[str]:
    return [*th.fast_flags(STEPS, STEPS), th.overrides(**overrides),
            f'--params_file_override={optimizer_file}']


@pytest.fixture(scope='module')
def runs(tmp_path_factory, data_dir, processes):
    """{'reference': logdir, stage: {'chief', 'other': logdir, 'stderr': the clients'}}."""
    root = tmp_path_factory.mktemp('stage3_clients_lm')
    adafactor = root / 'adafactor.txt'
    adafactor.write_text('task.train.optimizer : Params(cls=tfpipe.optimizers.Adafactor)\n')
    d = {'reference': str(root / 'reference')}
    started = [processes.start(th.command(MODEL, d['reference'], data_dir, *_flags(
        str(adafactor), **{'task.pipeline.num_replicas': 2})), environ=EXACT)]
    clients = {}
    for stage in STAGES:
        d[stage] = {who: str(root / f'{stage}_{who}') for who in ('chief', 'other')}
        spec = 'trainer=' + ','.join(f'127.0.0.1:{free_port()}' for _ in range(2))
        flags = _flags(str(adafactor), **{'task.train.sharding': stage})
        clients[stage] = [processes.start([*th.command(MODEL, d[stage][who], data_dir, *flags),
                                           f'--task={task}', f'--cluster_spec={spec}'],
                                          environ=EXACT)
                          for task, who in enumerate(('chief', 'other'))]
    for stage in STAGES:
        d[stage]['stderr'] = th.finish(clients[stage])
    th.finish(started)
    return d


@pytest.mark.parametrize('stage', STAGES)
def test_sharded_adafactor_clients_train_the_lm_as_one_unsharded_process(runs, stage):
    saved, expected = th.same_run(runs[stage]['chief'], runs['reference'], STEPS)
    # The embedding's factored moments (per row and per column) and the output bias's.
    slots = {re.sub(r'^optimizer/_slots/task-pipe-|/\.ATTRIBUTES/VARIABLE_VALUE$', '', key):
             value.shape for key, value in saved.items() if key.startswith('optimizer/_slots/')}
    assert {'embedding-emb/vr': (258,), 'embedding-emb/vc': (32,),
            'logits-b/v': (258,)}.items() <= slots.items(), slots
    for key, value in expected.items():
        if KEY_BIAS.search(key):
            assert np.abs(saved[key]).max() < 1e-4, key
            continue
        np.testing.assert_allclose(saved[key], value, rtol=1e-5, atol=1e-7, err_msg=key)
    other = runs[stage]['other']
    assert not os.path.exists(other) or os.listdir(other) == []  # the chief saves alone


def test_each_client_holds_half_of_every_weight_at_stage_3(runs):
    for stderr in runs['weights']['stderr']:
        (held, whole), = WEIGHT_BYTES.findall(stderr)
        assert 2 * int(held) == int(whole)  # 258 and every other size even: no padding
