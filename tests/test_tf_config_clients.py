"""The standard TF_CONFIG as cluster managers write it is a many-client run.

Ray Train, Kubeflow's TFJob, Vertex AI and SageMaker start the same command in
every task with TF_CONFIG={"cluster": {"worker": [...], "chief": [...]}, "task":
...}. Here, on loopback, with oneDNN off (TF_ENABLE_ONEDNN_OPTS=0: with it, R=2
and R=1 differ by kernel rounding that Adam amplifies, docs/clients.md):

- chief + worker and worker-only 2-client runs equal the one-process R=2 run
  (loss at every step, weights and BatchNorm statistics within 1e-5);
- an evaluator task evaluates the chief's checkpoints;
- clients that disagree (learning rate, micro-batches, model, max_steps, a gin
  trainer.* option or trace step, two clients both task 0) all exit 2 with one line
  before anything is written;
- a --job=worker server (the explicit single-client form) says what it waits
  for and that its port is open on every interface, which /proc/net confirms.

Every process is stopped by its PID in teardown.
"""
import json
import os
import re
import subprocess
import sys
import time

import pytest

from tests import trainer_helpers as th
from tests.test_clients import CLIENT_CPUS, MODEL, STEPS, assert_same_run, finish, free_port
from tfpipe import client_agreement, clients
from tfpipe import cluster as cluster_lib

EXACT = {'TF_ENABLE_ONEDNN_OPTS': '0'}


def tf_config(jobs: dict, task_type: str, index: int) -> dict:
    return {'TF_CONFIG': json.dumps({'cluster': jobs, 'task': {'type': task_type,
                                                                'index': index}})}


def addresses(count: int) -> list[str]:
    return [f'127.0.0.1:{free_port()}' for _ in range(count)]


def command(logdir: str, data_dir: str, *flags: str, model: str = MODEL) -> list[str]:
    cmd = th.command(model, logdir, data_dir, *flags)
    return [f'--num_logical_cpus={CLIENT_CPUS}' if a.startswith('--num_logical_cpus=') else a
            for a in cmd]


def train_flags(steps: int = STEPS) -> list[str]:
    return [*th.fast_flags(steps, 2), th.overrides(**{'task.pipeline.schedule': 'fill_drain'})]


@pytest.fixture(scope='module')
def runs(tmp_path_factory, data_dir, processes, clients_r2_exact):
    """chief+worker (+ an evaluator), worker-only, and the one-process R=2 run."""
    root = tmp_path_factory.mktemp('tf_config')
    d = {name: str(root / name) for name in ('chief', 'worker0', 'w0', 'w1')}
    d['r2'] = clients_r2_exact.logdir
    with_chief = {'chief': addresses(1), 'worker': addresses(1), 'evaluator': addresses(1)}
    workers_only = {'worker': addresses(2)}
    started = [
        processes.start(command(d['chief'], data_dir, *train_flags()),
                        {**EXACT, **tf_config(with_chief, 'chief', 0)}),
        processes.start(command(d['worker0'], data_dir, *train_flags()),
                        {**EXACT, **tf_config(with_chief, 'worker', 0)}),
        processes.start(command(d['w0'], data_dir, *train_flags()),
                        {**EXACT, **tf_config(workers_only, 'worker', 0)}),
        processes.start(command(d['w1'], data_dir, *train_flags()),
                        {**EXACT, **tf_config(workers_only, 'worker', 1)}),
        # The evaluator reads the chief's logdir while it trains (a shared file system in a
        # real cluster) and stops after the last step's checkpoint.
        processes.start(command(d['chief'], data_dir, f'--max_steps={STEPS}', th.overrides(
            **{'task.pipeline.schedule': 'fill_drain', 'task.eval.samples_per_summary': 32})),
            {**EXACT, **tf_config(with_chief, 'evaluator', 0)}),
    ]
    return d, finish(started)


def test_chief_and_worker_clients_equal_one_process_with_two_replicas(runs):
    d, errs = runs
    assert_same_run(d['chief'], d['r2'])
    assert not os.path.exists(d['worker0'])  # only the chief writes
    assert 'trainer client 1 (worker task 0, 127.0.0.1:' in errs[1]


def test_worker_only_clients_equal_one_process_with_two_replicas(runs):
    d, _ = runs
    assert_same_run(d['w0'], d['r2'])
    assert not os.path.exists(d['w1'])


def test_the_evaluator_task_evaluates_the_chiefs_checkpoints(runs):
    d, _ = runs
    with open(os.path.join(d['chief'], 'eval_dev', f'score-{STEPS}.txt')) as f:
        scores = dict(line.split(': ') for line in f.read().splitlines())
    assert scores['num_examples'] == '32'


def test_every_client_says_which_port_it_exposes_to_every_interface(runs):
    _, errs = runs
    for err in errs[:4]:
        notices = [line for line in err.splitlines()
                   if 'of every network interface' in line and 'no authentication' in line]
        assert len(notices) == 1, err[-3000:]


# -- Clients that disagree: all refuse with one line, exit 2, nothing written --------------

def _pair(processes, root: str, data_dir: str, name: str, flags0, flags1,
          spec0=None, spec1=None, models=(MODEL, MODEL), wait: float = 60, base=None):
    """Starts two clients of their own spec (default: trainer=A,B with tasks 0 and 1), each
    with `base` flags (default: 2 steps, a save every 2) and then its own."""
    both = addresses(2)
    spec0 = spec0 or [f'--cluster_spec=trainer={",".join(both)}', '--task=0']
    spec1 = spec1 or [f'--cluster_spec=trainer={",".join(both)}', '--task=1']
    base = th.fast_flags(2, 2) if base is None else base
    return [processes.start(command(os.path.join(root, f'{name}{i}'), data_dir,
                                    *base, f'--cluster_wait_seconds={wait}',
                                    *extra, *spec, model=model))
            for i, (extra, spec, model) in enumerate([(flags0, spec0, models[0]),
                                                       (flags1, spec1, models[1])])]


def test_clients_that_disagree_all_refuse_before_writing(tmp_path, data_dir, processes):
    root = str(tmp_path)
    a, b = addresses(2)
    cases = {
        'lr': (_pair(processes, root, data_dir, 'lr',
                     [th.overrides(**{'task.train.learning_rate': 0.4})],
                     [th.overrides(**{'task.train.learning_rate': 0.004})]),
               "client 1's task.train.learning_rate=0.004 differs from the chief's 0.4"),
        'micro': (_pair(processes, root, data_dir, 'micro', [],
                        [th.overrides(**{'task.pipeline.num_micro_batches': 4})]),
                  "client 1's task.pipeline.num_micro_batches=4 differs from the chief's 2"),
        'model': (_pair(processes, root, data_dir, 'model', [], [],
                        models=(MODEL, 'image.shapes.SmallConvPipe')),
                  "client 1's --model=image.shapes.SmallConvPipe differs from the chief's "
                  f"{MODEL}"),
        'steps': (_pair(processes, root, data_dir, 'steps', ['--max_steps=3'], []),
                  "client 1's task.train.max_steps=2 differs from the chief's 3"),
        # Both task 0 of the same two addresses in other orders: each would lead a group
        # of its own; the start-up check's deadline ends both.
        'chiefs': (_pair(processes, root, data_dir, 'chiefs', [], [],
                         spec0=[f'--cluster_spec=trainer={a},{b}', '--task=0'],
                         spec1=[f'--cluster_spec=trainer={b},{a}', '--task=0'], wait=20),
                   'did not all join the start-up check within 20 s'),
    }
    _all_refuse(cases, root)


def _all_refuse(cases: dict, root: str) -> None:
    """Every client of every case exits 2 with one error line holding its case's message."""
    for name, (procs, message) in cases.items():
        for proc in procs:
            _, err = proc.communicate(timeout=300)
            lines = [line for line in err.splitlines() if line.startswith('error: ')]
            assert proc.returncode == 2 and len(lines) == 1, (name, err[-3000:])
            assert message in lines[0], (name, lines[0])
    assert os.listdir(root) == []  # no client wrote its logdir


def test_clients_that_differ_in_a_trainer_option_all_refuse(tmp_path, data_dir, processes):
    """Gin's trainer.* and --pipeline_trace_step decide which collectives a step or a save
    runs: clients that differ in one used to deadlock (or one ended early), not refuse."""
    root = str(tmp_path)
    gin = '--gin_bindings=trainer.{}'.format
    sharded = th.overrides(**{'task.train.shard_optimizer_states': True})
    cases = {
        'max_steps': (_pair(processes, root, data_dir, 'steps', [], [gin('max_steps=5')],
                            base=['--job=trainer', gin('save_interval_steps=2')]),
                      "client 1's task.train.max_steps=5 differs from the chief's"),
        'trace': (_pair(processes, root, data_dir, 'trace', ['--pipeline_trace_step=2'], []),
                  "client 1's trainer.pipeline_trace_step=None differs from the chief's 2"),
        'save': (_pair(processes, root, data_dir, 'save', [sharded],
                       [sharded, gin('save_interval_steps=1')]),
                 "client 1's task.train.save_interval_steps=1 differs from the chief's 2"),
    }
    _all_refuse(cases, root)


@pytest.mark.parametrize('fingerprints, message', [
    ([{'task': 0, 'cluster': ['a:1', 'b:2'], 'model': 'm', 'params': {'x': '1'}},
      {'task': 0, 'cluster': ['b:2', 'a:1'], 'model': 'm', 'params': {'x': '1'}}],
     '2 trainer clients run as task 0 (at a:1, b:2)'),
    ([{'task': 1, 'cluster': ['a:1', 'c:3'], 'model': 'm', 'params': {'x': '1'}},
      {'task': 0, 'cluster': ['a:1', 'b:2'], 'model': 'm', 'params': {'x': '1'}}],
     "client 1's cluster a:1,c:3 differs from the chief's a:1,b:2"),
    ([{'task': 0, 'cluster': ['a:1'], 'model': 'm', 'params': {f'k{i}': '1' for i in range(5)}},
      {'task': 1, 'cluster': ['a:1'], 'model': 'm', 'params': {'k0': '2'}}],
     "client 1's k0=2 differs from the chief's 1; client 1's k1=(unset) differs from the "
     "chief's 1; client 1's k2=(unset) differs from the chief's 1; and 2 more params"),
])
def test_disagreements_are_named(fingerprints, message):
    assert message in client_agreement.disagreement(fingerprints)


def test_agreeing_fingerprints_leave_out_data_dirs():
    from trainer import experiment
    params = experiment.load_params(MODEL, '', '', [], [])
    mine = client_agreement.fingerprint(MODEL, params, clients.ClientCluster(('a:1', 'b:2'), 0),
                                        {})
    elsewhere = params.Copy()
    elsewhere.input.train.data_dir = '/elsewhere'
    other = client_agreement.fingerprint(MODEL, elsewhere,
                                         clients.ClientCluster(('a:1', 'b:2'), 1), {})
    assert client_agreement.disagreement([mine, other]) is None
    assert 'task.train.learning_rate' in mine['params']


def _fingerprint_with(task: int, **options) -> dict:
    """Client `task`'s fingerprint as trainer/main.py builds it, with these trainer options."""
    from trainer import experiment, runtime_options
    params = experiment.load_params(MODEL, '', '', [], [])
    chosen = runtime_options.RuntimeOptions(**options)
    chosen.apply_to(params)
    return client_agreement.fingerprint(
        MODEL, params, clients.ClientCluster(('a:1', 'b:2'), task), chosen.loop_settings())


def test_every_trainer_option_is_in_the_fingerprint():
    """Each field of RuntimeOptions, those of today and any added later, as the trainer
    will run it: a task.train value it sets is compared as that param. Only the per-client
    options (peak_flops: clients on different hardware report against their own peaks)
    may differ."""
    import dataclasses
    from trainer import runtime_options
    for name in runtime_options.PER_CLIENT_OPTIONS:
        assert client_agreement.disagreement([_fingerprint_with(0),
                                              _fingerprint_with(1, **{name: 97})]) is None
    for field in dataclasses.fields(runtime_options.RuntimeOptions):
        if field.name in runtime_options.PER_CLIENT_OPTIONS:
            continue
        key = (f'task.train.{field.name}' if field.name in runtime_options.TASK_TRAIN_OPTIONS
               else f'trainer.{field.name}')
        problem = client_agreement.disagreement([_fingerprint_with(0),
                                                 _fingerprint_with(1, **{field.name: 97})])
        assert problem is not None and f"client 1's {key}=97 differs" in problem, field.name


# -- Reading TF_CONFIG ---------------------------------------------------------------------

JOBS = {'chief': ['c:1'], 'worker': ['w:1', 'w:2'], 'evaluator': ['e:1']}


@pytest.mark.parametrize('task_type, index, client', [('chief', 0, 0), ('worker', 0, 1),
                                                      ('worker', 1, 2)])
def test_chief_is_client_0_then_the_workers(task_type, index, client):
    got = clients.from_flags(None, None, None, tf_config(JOBS, task_type, index))
    assert (got.addresses, got.task_index) == (('c:1', 'w:1', 'w:2'), client)
    assert got.describe(1) == 'trainer client 1 (worker task 0, w:1)'
    got = clients.from_flags(None, 'trainer', None,
                             tf_config({'worker': ['w:1', 'w:2']}, 'worker', 1))
    assert (got.addresses, got.task_index, got.peers.is_chief) == (('w:1', 'w:2'), 1, False)


def test_the_evaluator_runs_evaler_jobs_and_no_client():
    environ = tf_config(JOBS, 'evaluator', 0)
    assert clients.from_flags(None, None, None, environ) is None
    assert clients.evaluator_job(None, None, environ) == 'evaler_dev'
    assert clients.evaluator_job(None, 'decoder_test', environ) == 'decoder_test'
    assert clients.evaluator_job(None, None, tf_config(JOBS, 'worker', 0)) is None
    with pytest.raises(clients.ClusterError, match='TF_CONFIG says task type "evaluator"'):
        clients.evaluator_job(None, 'trainer', environ)


def test_job_worker_chooses_the_single_client_servers():
    environ = tf_config({'worker': ['w:1', 'w:2']}, 'worker', 1)
    assert clients.from_flags(None, 'worker', None, environ) is None
    served = cluster_lib.from_flags(None, 'worker', None, environ)
    assert (served.task_type, served.task_index) == ('worker', 1)
    assert cluster_lib.from_flags(None, None, None, environ) is None  # clients' TF_CONFIG


@pytest.mark.parametrize('jobs, task_type, index, job, message', [
    ({'ps': ['p:1'], 'worker': ['w:1']}, 'worker', 0, None, "unknown job(s) ['ps']"),
    ({'chief': ['c:1', 'c:2'], 'worker': ['w:1']}, 'worker', 0, None, 'there is one chief'),
    ({'worker': ['w:1']}, 'worker', 1, None, "task index 1 is out of range: job 'worker' has 1"),
    ({'worker': ['w:1']}, 'chief', 0, None, '"task" must be {"type": one of [\'worker\']'),
    ({'evaluator': ['e:1']}, 'evaluator', 0, None, 'no "worker" or "chief" job'),
    ({'worker': ['w:1', 'w:1']}, 'worker', 0, None, 'address w:1 is listed twice'),
    ({'worker': ['w:1']}, 'worker', 0, 'evaler_dev', '"evaluator" task'),
])
def test_bad_tf_config_is_refused_naming_the_fix(jobs, task_type, index, job, message):
    with pytest.raises(clients.ClusterError, match=re.escape(message)):
        clients.from_flags(None, job, None, tf_config(jobs, task_type, index))


# -- The explicit single-client server ----------------------------------------------------

def _listening_on_every_interface(port: int) -> bool:
    """Whether a socket listens on 0.0.0.0:port or [::]:port (from /proc/net/tcp*)."""
    for table, wildcard in (('/proc/net/tcp', '00000000'), ('/proc/net/tcp6', '0' * 32)):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                host, hex_port = local.split(':')
                if state == '0A' and int(hex_port, 16) == port and host == wildcard:
                    return True
    return False


def test_a_worker_server_says_what_it_waits_for_and_that_its_port_is_open(tmp_path):
    address = addresses(1)[0]
    port = int(address.rsplit(':', 1)[1])
    proc = th.popen([sys.executable, '-m', 'trainer', '--job=worker', '--run_locally=cpu',
                     '--num_logical_cpus=1'],
                    {**th.env(), **tf_config({'worker': [address]}, 'worker', 0)},
                    subprocess.DEVNULL, subprocess.PIPE, cwd=str(tmp_path))
    try:
        deadline = time.time() + 120
        while not cluster_lib.accepts_connections(address) and time.time() < deadline:
            assert proc.poll() is None
            time.sleep(0.2)
        assert _listening_on_every_interface(port)
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-3000:]
    assert f'worker task 0 serving at {address} for the single-client form: it trains ' \
           'nothing itself and waits' in err
    assert f'worker task 0 listens on port {port} of every network interface' in err
