"""Test-session setup: 8 logical CPU devices, configured before TensorFlow starts.

Pipelined == unpartitioned must be shown on real multi-device placement, so every
test process splits the host CPU into 8 logical devices. This has to happen before
anything initialises the TensorFlow runtime, hence a conftest at import time.
"""
import os

import pytest

# The kernels the trainer runs with (trainer/main.py `run`), so that this process and
# the trainer processes it starts compute alike on every CPU.
os.environ.setdefault('TF_ENABLE_ONEDNN_OPTS', '1')
import tensorflow as tf  # noqa: E402  (after the variable: TensorFlow reads it once)

# Every trainer the tests start reports MFU over the host's peak, probed once per machine
# (tfpipe/tuning/peak_flops.py): one cache for the whole suite, not one per test's HOME.
os.environ.setdefault('TFPIPE_CACHE_DIR', os.path.join(
    os.environ.get('TMPDIR', '/tmp'), f'tfpipe-tests-cache-{os.getuid()}'))

NUM_LOGICAL_CPUS = 8

_cpus = tf.config.list_physical_devices('CPU')
tf.config.set_logical_device_configuration(
    _cpus[0], [tf.config.LogicalDeviceConfiguration()] * NUM_LOGICAL_CPUS)


@pytest.fixture(scope='session')
def data_dir(tmp_path_factory):
    """tfpipe's generated datasets, built once per test session (a few seconds)."""
    from tfpipe import datasets
    path = str(tmp_path_factory.mktemp('tfds'))
    datasets.prepare('tfpipe_shapes', path)
    datasets.prepare('tfpipe_reverse', path)
    return path


# Trainer runs that several test modules start from, each run once per session
# (a trainer process costs ~10 s on 2 cores). Tests copy them before writing.

@pytest.fixture(scope='session')
def trained_2_steps(tmp_path_factory, data_dir):
    """SmallConvPipe trained 2 steps, checkpoint at step 2."""
    from tests import trainer_helpers as th
    return th.train_once(tmp_path_factory.mktemp('trained_2_steps'), data_dir,
                         *th.fast_flags(2, 2))


@pytest.fixture(scope='session')
def trained_4_steps(tmp_path_factory, data_dir):
    """SmallConvPipe trained 4 steps, checkpoints at steps 2 and 4, loss logged each step."""
    from tests import trainer_helpers as th
    return th.train_once(tmp_path_factory.mktemp('trained_4_steps'), data_dir,
                         *th.fast_flags(4, 2))


@pytest.fixture(scope='session')
def trained_4_steps_two_replicas(tmp_path_factory, data_dir):
    """As trained_4_steps with R=2 replicas x K=2 cells (M=2 each) on 4 logical CPUs."""
    from tests import trainer_helpers as th
    return th.train_once(tmp_path_factory.mktemp('trained_4_steps_r2'), data_dir,
                         *th.fast_flags(4, 2),
                         th.overrides(**{'task.pipeline.num_replicas': 2}))


@pytest.fixture(scope='session')
def reverse_trained(tmp_path_factory, data_dir):
    """mt.reverse.TransformerPipe (th.REVERSE_OVERRIDES: K=2, M=2) trained 2 steps,
    checkpoint at step 2, with its decoder on test in the same process (a Transformer's
    start-up costs seconds) decoding that checkpoint. tests/test_trainer.py reads the
    decoder's output; tests/test_export.py exports the checkpoint."""
    from tests import trainer_helpers as th
    logdir = str(tmp_path_factory.mktemp('reverse') / 'run')
    result = th.run(th.REVERSE, logdir, data_dir, '--job=trainer,decoder_test',
                    '--max_steps=2', '--gin_bindings=trainer.save_interval_steps=2',
                    '--gin_bindings=trainer.eval_poll_max_seconds=1',
                    th.overrides(**th.REVERSE_OVERRIDES), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return th.TrainedRun(logdir, result.stderr)


@pytest.fixture(scope='session')
def lm_trained(tmp_path_factory):
    """lm.pystdlib.TinyTransformerLM (K=2, M=2) trained LM_STEPS (150, half its default
    300: its dev log-perplexity is then 2.61, past tests/test_lm_trainer.py's bound of the
    unigram's 3.10 - 0.3) on the standard library, with its evaler on dev and decoder on
    test in the same process. tests/test_lm_trainer.py reads it; tests/test_export_lm.py
    exports a copy."""
    from tests import trainer_helpers as th
    logdir = str(tmp_path_factory.mktemp('lm') / 'run')
    result = th.run('lm.pystdlib.TinyTransformerLM', logdir,
                    str(tmp_path_factory.mktemp('unused_tfds')),
                    '--job=trainer,evaler_dev,decoder_test', f'--max_steps={th.LM_STEPS}',
                    '--gin_bindings=trainer.eval_poll_max_seconds=1', timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return th.TrainedRun(logdir, result.stderr)


def pytest_sessionfinish(session):
    """Stops this process's trainer fork server (tests/trainer_forkserver.py) by its PID."""
    import sys
    helpers = sys.modules.get('tests.trainer_helpers')
    if helpers is not None:
        helpers.stop_forkserver()


@pytest.fixture(scope='module')
def processes():
    """Every process a module's tests start (trainer_helpers.Processes), stopped by PID."""
    from tests import trainer_helpers as th
    procs = th.Processes()
    try:
        yield procs
    finally:
        procs.stop_all()


@pytest.fixture(scope='session')
def clients_r2_exact(tmp_path_factory, data_dir):
    """The one-process run that 2-client runs must equal: tests.clients_model.SmallConvBNPipe
    with R=2 replicas (fill_drain, M=2 each) on 4 logical CPUs, 4 steps (checkpoints at 2 and
    4, loss logged each step), oneDNN off (TF_ENABLE_ONEDNN_OPTS=0: docs/clients.md)."""
    from tests import trainer_helpers as th
    logdir = str(tmp_path_factory.mktemp('clients_r2_exact') / 'run')
    result = th.run('tests.clients_model.SmallConvBNPipe', logdir, data_dir,
                    *th.fast_flags(4, 2), th.overrides(**{'task.pipeline.num_replicas': 2,
                                                          'task.pipeline.schedule': 'fill_drain'}),
                    environ={'TF_ENABLE_ONEDNN_OPTS': '0'})
    assert result.returncode == 0, result.stderr[-3000:]
    return th.TrainedRun(logdir, result.stderr)


# -- Scheduling for `pytest -n 2` (pytest-xdist) ------------------------------------------
#
# xdist's default (`--dist load`) hands tests out one by one in file order. A module whose
# tests share a module fixture that starts trainer processes then often has its tests on
# both workers, and each worker runs the fixture (a minute of CPU for test_clients.py);
# and a long module that comes last leaves the other worker idle at the end. With the
# default distribution, this scheduler keeps the modules of MODULE_GROUPS together (one
# work unit per group, on one worker) and hands out the longest units first, so that the
# two workers finish together; every other test is its own unit, as with `--dist load`.
# An explicit --dist other than load is left to xdist.

# Modules whose tests share module (or session) fixtures, by group; a test ID (without its
# parameters) puts that one test in a group. LONGEST_FIRST orders by CPU seconds
# measured at load 19 (2 cores): clients_exact ~190, clients ~180, lm ~120 (150 steps, at
# load 12), clients_sharded ~50, a registered model's check_pipeline ~25, test_kill_9 ~25;
# the other units by their count of trainer processes (each ~8 s of CPU).
MODULE_GROUPS = {
    'tests/test_clients.py': 'clients',
    'tests/test_launcher.py': 'launcher',
    # Both use the one-process R=2 reference run (session fixture clients_r2_exact).
    'tests/test_tf_config_clients.py': 'clients_exact',
    'tests/test_clients_input.py': 'clients_exact',
    'tests/test_clients_sharded_optimizer.py': 'clients_sharded',
    'tests/test_cluster_trainer.py': 'cluster_trainer',
    # Both use the LM's run (session fixture lm_trained).
    'tests/test_lm_trainer.py': 'lm',
    'tests/test_export_lm.py': 'lm',
    'tests/test_logdir_experiment.py': 'logdir_experiment',
    # Both use the Transformer's run (session fixture reverse_trained).
    'tests/test_export.py': 'export',
    'tests/test_trainer.py::test_transformer_trains_and_decodes': 'export',
    'tests/test_own_models.py': 'own_models',
    'tests/test_ray.py': 'ray',
    'tests/test_slurm.py': 'slurm',
    'tests/test_docs.py': 'docs',
    'tests/test_trainer_bad_input.py': 'trainer_bad_input',
    'tests/test_eval_every_example.py': 'eval_every_example',
    'tests/test_keras_pipeline.py': 'keras_pipeline',
    'tests/test_lm_generation.py': 'lm_generation',
    'tests/test_pipeline_timeline.py': 'pipeline_timeline',
    # Each shares its traced steps between its tests (a trace is most of a test's time).
    'tests/test_tensor_parallel.py': 'tensor_parallel',
    'tests/test_tensor_parallel_adafactor.py': 'tensor_parallel_adafactor',
    'tests/test_tensor_parallel_lm.py': 'tensor_parallel_lm',
    'tests/test_tensor_parallel_optimizers.py': 'tensor_parallel_optimizers',
    'tests/test_tensor_parallel_ties.py': 'tensor_parallel_ties',
    # Each shares one module fixture: a 4-step MoE LM trainer run with its evaler and
    # decoder (~160 s), and one chain of stage-changing resumes (~130 s).
    'tests/test_moe_lm.py': 'moe_lm',
    'tests/test_sharded_resume.py': 'sharded_resume',
    # Both read the LM trained at T=2 (module fixture lm_jobs).
    'tests/test_trainer_tensor_parallel.py::test_lm_trains_and_exports_at_t2': 'tp_lm_jobs',
    'tests/test_trainer_tensor_parallel.py::'
    'test_lm_evaler_and_decoder_at_t2_equal_t1_on_the_same_checkpoint': 'tp_lm_jobs',
}
# Work units (groups, or test ID prefixes of single long tests) to start first, longest
# first; the rest follow in file order.
LONGEST_FIRST = [
    'clients_exact', 'clients', 'launcher', 'lm', 'moe_lm', 'clients_sharded',
    'sharded_resume', 'tensor_parallel',
    'tensor_parallel_adafactor', 'tensor_parallel_lm',
    'cluster_trainer', 'export', 'logdir_experiment',
    'tests/test_check_pipeline.py::test_check_pipeline_passes_on_registered_models',
    'tests/test_trainer_replicas.py', 'tests/test_trainer.py::test_kill_9',
    'tests/test_trainer.py::test_train_then_evaler', 'own_models', 'ray', 'docs',
    'trainer_bad_input', 'slurm',
    # Single tests of 12-45 s wall each (2026-11-27): file order ran them last, and the
    # last two (test_trainer_tensor_parallel's, 22 s each) left one worker alone for 37 s.
    'tests/test_memory_prediction.py', 'keras_pipeline', 'tp_lm_jobs',
    'tests/test_trainer_tensor_parallel.py',
    'tests/test_trainer_schedules.py', 'tests/test_pipeline_memory.py', 'tests/test_threads.py',
    'tests/test_tensor_parallel_16.py',
    'tests/test_inputs_and_tasks.py::test_seq2seq_', 'pipeline_timeline', 'lm_generation',
]


def _rank(unit: str) -> int:
    """A group's place in LONGEST_FIRST, or a test's by its ID's prefix there."""
    return next((i for i, first in enumerate(LONGEST_FIRST)
                 if unit == first or first.startswith('tests/') and unit.startswith(first)),
                len(LONGEST_FIRST))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue('dist') != 'load':
        return None
    from xdist.scheduler import LoadScopeScheduling

    class GroupedLongestFirst(LoadScopeScheduling):
        """xdist's scope scheduling with MODULE_GROUPS as the scopes (other tests: one
        each), the units ordered by LONGEST_FIRST, then by file order."""

        def _split_scope(self, nodeid: str) -> str:
            return (MODULE_GROUPS.get(nodeid.split('[', 1)[0])
                    or MODULE_GROUPS.get(nodeid.split('::', 1)[0], nodeid))

        def _assign_work_unit(self, node) -> None:
            if not getattr(self, '_ordered', False):  # the first call: the queue is complete
                position = {nodeid: i for i, nodeid in enumerate(self.collection)}
                units = sorted(self.workqueue.items(), key=lambda unit: (
                    _rank(unit[0]), position[next(iter(unit[1]))]))
                self.workqueue.clear()
                self.workqueue.update(units)
                self._ordered = True
            super()._assign_work_unit(node)

    return GroupedLongestFirst(config, log)
