r"""tfpipe trainer binary.

    python -m trainer --model=image.shapes.AmoebaNetPipe --logdir=/tmp/shapes --run_locally=cpu
    python -m trainer --model=image.shapes.AmoebaNetPipe --logdir=/tmp/shapes --job=evaler_dev
    python -m trainer --list_models
    python -m trainer --model=... --logdir=... --job=trainer --task=R \
        --cluster_spec=trainer=HOST:PORT,HOST:PORT   # one trainer client per replica
    TF_CONFIG=... python -m trainer --model=... --logdir=...   # the same, from a cluster manager
    python -m trainer --job=worker --task=0 --cluster_spec=worker=HOST:PORT,HOST:PORT
    python -m trainer --model=... --logdir=... --job=trainer --cluster_spec=worker=HOST:PORT,...
        # the single-client form: one trainer drives cells on the --job=worker servers
    python -m trainer --model=... --logdir=... --local_clients=R   # R clients on this host

With no --job, one process runs the trainer and, in threads, an evaler on dev
and a decoder on test (when the model defines those splits), as Lingvo does
with --run_locally. Bad input (unknown model, typo in an override, impossible
partition, missing data, another model's logdir, unreadable checkpoint) exits
with status 2 and a one-line error, before anything is written to --logdir.
"""
from __future__ import annotations

import dataclasses
import errno
import os
import sys
from typing import Sequence

from absl import app, flags
from absl import logging as absl_logging

# Importing tfpipe (which loads no TensorFlow) sets oneDNN's kernels and the BFC allocator
# (peak bytes per device) before TensorFlow loads (tfpipe/runtime_defaults.py); a variable
# the user set wins.
import tfpipe  # noqa: F401  pylint: disable=unused-import
from trainer import generate_mode, logdir_access  # generate_mode defines its flags
from trainer.exit_codes import EXIT_BAD_INPUT, EXIT_NON_FINITE

FLAGS = flags.FLAGS
flags.DEFINE_string('model', None, 'Registered model: <task>.<dataset>.<ClassName> for '
                    'params/<task>/<dataset>.py, or <module>.<ClassName> for a model of your '
                    'own package, e.g. mypkg.lm.MyLM.')
flags.DEFINE_string('logdir', None, 'Directory of checkpoints, summaries and job outputs.')
flags.DEFINE_string('job', None, 'trainer | evaler_<split> | decoder_<split>, or a comma list; '
                    'default: trainer plus evaler_dev and decoder_test in threads.')
flags.DEFINE_enum('mode', 'sync', ['sync', 'inspect_params', 'inspect_model',
                                   'inspect_pipeline', 'check_pipeline', 'export',
                                   'generate'],
                  'sync: run the jobs; inspect_params: print the params tree; inspect_model: '
                  'the partition, devices, variables and bytes per cell; inspect_pipeline: '
                  'profile the layers and recommend K, balance, M, recompute; check_pipeline: '
                  'one step as configured vs K=1 (exit 1 beyond 1e-5 relative); export: a '
                  'checkpoint as a SavedModel (docs/export.md); generate: continue --prompt '
                  'with the newest checkpoint of a language model (docs/language_models.md).')
flags.DEFINE_string('checkpoint', None, 'export: the checkpoint to export, e.g. ckpt-300 or '
                    '<logdir>/train/ckpt-300; default: the newest.')
flags.DEFINE_string('export_dir', None, 'export: where to write the SavedModel; default: '
                    '<logdir>/export/<step>.')
flags.DEFINE_bool('overwrite', False, 'export: replace an --export_dir that is not empty.')
flags.DEFINE_enum('export_placement', 'one_device', ['one_device', 'pipelined'],
                  'export: one_device runs the body as one cell with no device names (the '
                  'loader places it); pipelined keeps the K cells on their devices.')
flags.DEFINE_enum('run_locally', None, ['cpu', 'gpu'], 'Devices of this process; default: gpu '
                  'when GPUs are visible, else cpu (logical CPUs).')
flags.DEFINE_integer('num_logical_cpus', 8, 'Logical CPU devices with --run_locally=cpu.')
flags.DEFINE_string('params_override', '', "Comma list of key=value, e.g. "
                    "task.train.max_steps=100,input.train.batch_size=16.")
flags.DEFINE_string('params_file_override', '', 'A params.txt-style file of overrides.')
flags.DEFINE_multi_string('gin_file', [], 'Gin files (trainer.* runtime knobs, model.overrides).')
flags.DEFINE_multi_string('gin_bindings', [], 'Gin bindings, e.g. trainer.save_interval_steps=50.')
flags.DEFINE_integer('max_steps', None, 'Overrides task.train.max_steps.')
flags.DEFINE_string('tfds_data_dir', None, 'tensorflow-datasets data dir (default: '
                    '~/tensorflow_datasets); tfpipe generates its own datasets there.')
flags.DEFINE_bool('list_models', False, 'Print the registered models (of params/ and of '
                  'installed packages\' tfpipe.models entry points) and exit.')
flags.DEFINE_string('cluster_spec', None, 'trainer=HOST:PORT,HOST:PORT: one trainer client '
                    'per replica (docs/clients.md); or worker=HOST:PORT,HOST:PORT[@chief='
                    'HOST:PORT]: the --job=worker servers one trainer drives (and its own '
                    'address). Default: TF_CONFIG, whose chief/worker tasks are trainer '
                    'clients (servers with --job=worker).')
flags.DEFINE_enum('cluster_resolver', None, ['slurm', 'tf_config'],
                  'Where the trainer clients come from (docs/clients.md): slurm: one client '
                  'per task of the srun step, addresses from Slurm (with --port_base); '
                  'tf_config: this process is a task of TF_CONFIG\'s cluster (Ray Train, '
                  'TFJob, Vertex AI, SageMaker), and without TF_CONFIG it exits 2 instead of '
                  'training alone.')
flags.DEFINE_integer('port_base', 2222, 'With --cluster_resolver=slurm: the i-th task on a '
                     'node serves at port --port_base+i.')
flags.DEFINE_integer('task', None, 'With --job=worker: this worker\'s index in --cluster_spec; '
                     'with --job=trainer and a trainer cluster: this client\'s index.')
flags.DEFINE_integer('local_clients', None, 'Start this many trainer clients on this host, '
                     'each with its share of the cores (or GPUs) and --num_logical_cpus '
                     'logical CPUs, and supervise them (trainer/launcher.py, docs/clients.md).')
flags.DEFINE_integer('max_restarts', 0, 'With --local_clients: how often to restart every '
                     'client from the last checkpoint after one dies.')
flags.DEFINE_float('cluster_wait_seconds', 60.0, 'How long the trainer waits for every worker '
                   '(or every other trainer client) to accept connections, and trainer clients '
                   'for each other at the start-up check, before it gives up.')
flags.DEFINE_integer('pipeline_trace_step', None, 'Record the measured timeline of this '
                     'training step (1 = the first): train/pipeline_trace-<step>.json (Chrome '
                     'trace format) and .png, and the bubble per device in the log and '
                     'TensorBoard.')
flags.DEFINE_integer('intra_op_threads', None, 'TensorFlow intra-op threads; default: '
                     'tfpipe\'s measured best on logical CPUs; 0: TensorFlow\'s default.')
flags.DEFINE_integer('inter_op_threads', None, 'TensorFlow inter-op threads; default: '
                     'tfpipe\'s measured best on logical CPUs; 0: TensorFlow\'s default.')
flags.DEFINE_integer('num_devices', None, 'inspect_pipeline: devices to plan for (K <= D); '
                     'default: the devices of this process.')
flags.DEFINE_string('device_memory', None, 'inspect_pipeline: bytes per device, e.g. 16GiB.')
flags.DEFINE_string('device_profile', '', 'inspect_pipeline: plan for other devices, e.g. '
                    'speed=8,memory=16GiB,bandwidth=10e9[,parallelism=N].')
flags.DEFINE_float('plan_seconds', None, 'inspect_pipeline: measure configurations only while '
                   'the plan, profiling included, ends within this many seconds (0: the '
                   'profile alone decides); default: measure them all (minutes at GPT-2 size).')



class UsageError(ValueError):
    pass


def _configure_devices() -> None:
    """Logical CPUs must exist before TensorFlow initialises, so this runs first."""
    import tensorflow as tf
    kind = FLAGS.run_locally or ('gpu' if tf.config.list_physical_devices('GPU') else 'cpu')
    if kind == 'gpu' and not tf.config.list_physical_devices('GPU'):
        raise UsageError('--run_locally=gpu but TensorFlow sees no GPU on this machine: use '
                         '--run_locally=cpu, or install tfpipe with the gpu extra on a machine '
                         'whose GPUs nvidia-smi lists')
    if kind == 'cpu':
        if FLAGS.num_logical_cpus < 1:
            raise UsageError(f'--num_logical_cpus={FLAGS.num_logical_cpus} must be >= 1: '
                             'give at least one logical CPU per pipeline cell')
        tf.config.set_visible_devices([], 'GPU')  # cells go to logical CPUs even beside a GPU
        tfpipe.configure_logical_cpus(FLAGS.num_logical_cpus, FLAGS.intra_op_threads,
                                      FLAGS.inter_op_threads)
    else:
        tfpipe.configure_threads(FLAGS.intra_op_threads or 0, FLAGS.inter_op_threads or 0)


def _parse_jobs(job_flag: str | None) -> list[str]:
    if job_flag is None:
        return ['trainer', 'evaler_dev', 'decoder_test']
    if job_flag == 'worker':
        return ['worker']
    jobs = [j.strip() for j in job_flag.split(',') if j.strip()]
    if len(set(jobs)) != len(jobs):
        raise UsageError(f'--job={job_flag} names a job twice: list each job once')
    for job in jobs:
        if job != 'trainer' and not job.startswith(('evaler_', 'decoder_')):
            raise UsageError(f'unknown --job {job!r}: use trainer, evaler_<split>, '
                             'decoder_<split> (splits: train, dev, test) or worker alone')
    return jobs


def _data_dir() -> str:
    return FLAGS.tfds_data_dir or os.path.expanduser('~/tensorflow_datasets')


def _set_data_dir(params) -> None:
    """Points every tfds input without a data_dir at --tfds_data_dir (or the tfds default).

    Inputs that read no tfds data (DatasetInput) have no data_dir.
    """
    data_dir = _data_dir()
    logdir_access.check_directory(data_dir, '--tfds_data_dir', writable=False)
    for _, input_params in params.input.IterParams():
        if input_params is not None and 'data_dir' in input_params \
                and input_params.data_dir is None:
            input_params.data_dir = data_dir


def _run_inspect_mode(params) -> int:
    """inspect_model / check_pipeline (trainer/inspect_modes.py) / inspect_pipeline
    (trainer/plan_mode.py)."""
    import tensorflow as tf
    from tfpipe.tuning import planner
    from trainer import inspect_modes, plan_mode
    if FLAGS.mode == 'inspect_model':
        inspect_modes.inspect_model(params)
        return 0
    if FLAGS.mode == 'check_pipeline':
        code, report = inspect_modes.check_pipeline(params)
        print(report)
        return code
    memory = None if FLAGS.device_memory is None else planner.parse_bytes(FLAGS.device_memory)
    num_devices = FLAGS.num_devices or len(tf.config.list_logical_devices('GPU')
                                           or tf.config.list_logical_devices('CPU'))
    if num_devices < 1:
        raise UsageError(f'--num_devices={num_devices}: plan for at least one device')
    if FLAGS.plan_seconds is not None and FLAGS.plan_seconds < 0:
        raise UsageError(f'--plan_seconds={FLAGS.plan_seconds:g}: give a budget of at least 0 '
                         'seconds, or leave it out to measure every candidate')
    plan_mode.inspect_pipeline(params, num_devices, memory, FLAGS.device_profile,
                               tf.config.threading.get_intra_op_parallelism_threads(),
                               FLAGS.logdir, FLAGS.plan_seconds)
    return 0


def main(argv) -> int:
    """The binary in named steps: each mode returns its exit status."""
    del argv
    from tfpipe import clients
    from tfpipe import cluster as cluster_lib
    if FLAGS.list_models:
        return _list_models()
    client_cluster = (_cluster_manager_clients() or
                      clients.from_flags(FLAGS.cluster_spec, FLAGS.job, FLAGS.task, os.environ))
    if client_cluster is not None:
        return _run_client(client_cluster)
    cluster = cluster_lib.from_flags(FLAGS.cluster_spec, FLAGS.job, FLAGS.task, os.environ)
    if cluster is not None and cluster.task_type == cluster_lib.WORKER:
        return _serve_worker(cluster)
    _check_required_flags()
    jobs = _parse_jobs(clients.evaluator_job(FLAGS.cluster_spec, FLAGS.job, os.environ)
                       or FLAGS.job)
    if FLAGS.mode == 'sync':
        logdir_access.check_directory(FLAGS.logdir, '--logdir')
    _configure_devices()
    # Jobs that read a logdir build the model its trainer recorded; a trainer checks that
    # it resumes the same model (trainer/experiment.py).
    params, options = _load_params_and_options(
        from_logdir=FLAGS.mode != 'sync' or 'trainer' not in jobs)
    if FLAGS.mode == 'inspect_params':
        print(params.ToText())
        return 0
    if FLAGS.mode == 'export':
        return _export(params)
    if cluster is not None:
        if FLAGS.mode == 'sync' and 'trainer' in jobs:
            _check_sharding(params, params.task.pipeline.num_replicas)
        cluster_lib.connect(cluster, FLAGS.cluster_wait_seconds)
    if FLAGS.mode == 'generate':
        return generate_mode.run(params, FLAGS.logdir)
    if FLAGS.mode != 'sync':
        return _run_inspect_mode(params)
    return _run_jobs(params, options, jobs, cluster)


def _cluster_manager_clients():
    """--cluster_resolver: the clients of a Slurm step (else None), or a TF_CONFIG required."""
    from tfpipe.cluster import ClusterError
    resolver = FLAGS.cluster_resolver
    if resolver == 'slurm':
        if FLAGS.cluster_spec or FLAGS.task is not None:
            raise ClusterError('--cluster_resolver=slurm takes the cluster and the task from '
                               'Slurm: drop --cluster_spec and --task')
        from tfpipe import slurm
        return slurm.client_cluster(FLAGS.port_base)
    if resolver == 'tf_config':
        if FLAGS.cluster_spec:
            raise ClusterError('--cluster_resolver=tf_config reads the cluster from TF_CONFIG: '
                               'drop --cluster_spec')
        if not os.environ.get('TF_CONFIG'):
            raise ClusterError('--cluster_resolver=tf_config but TF_CONFIG is not set: start '
                               'this process as a task of its cluster (Ray Train\'s '
                               'TensorflowTrainer, a TFJob, Vertex AI or SageMaker set it), or '
                               'drop the flag to train in one process')
    return None


def _export(params) -> int:
    from trainer import export_mode
    path = export_mode.run(params, FLAGS.logdir, FLAGS.model, FLAGS.checkpoint,
                           FLAGS.export_dir, FLAGS.export_placement, FLAGS.overwrite)
    print(f'exported SavedModel to {path}')
    return 0


def _run_client(client_cluster) -> int:
    """One of several trainer clients (tfpipe/clients.py): replica `--task` of R.

    Everything that can refuse bad input runs before the collective runtime
    starts and before the chief's logdir is written; then all clients compare
    their params and cluster (tfpipe/client_agreement.py) and refuse together
    if they differ. Non-chief clients never write to their --logdir.
    """
    from tfpipe import client_agreement, clients
    from trainer import job_runner, train_job
    _check_required_flags()
    if FLAGS.mode != 'sync':
        raise UsageError(f'--mode={FLAGS.mode} with a cluster of trainer clients: inspect the '
                         'model in one process (drop --cluster_spec and TF_CONFIG)')
    if client_cluster.task_index == 0:
        logdir_access.check_directory(FLAGS.logdir, '--logdir')
    _configure_devices()
    params, options = _load_params_and_options()
    clients.check_num_replicas(params.task.pipeline.num_replicas, client_cluster.count)
    _check_sharding(params, client_cluster.count)
    expert_parallel = _check_experts_across_clients(params, client_cluster.count)
    params.task.pipeline.num_replicas = 1  # this process holds one replica of R
    options.apply_to(params)  # the fingerprint holds what the trainer will run
    agreed = client_agreement.fingerprint(FLAGS.model, params, client_cluster,
                                          options.loop_settings())
    # Its replica holds its E/P experts; its own steps know only that replica (Peers has P).
    params.task.pipeline.expert_parallel = 1
    peers = dataclasses.replace(clients.start(client_cluster, FLAGS.cluster_wait_seconds),
                                expert_parallel=expert_parallel)
    client_agreement.check(client_cluster, agreed, FLAGS.cluster_wait_seconds)
    if peers.is_chief:
        built = job_runner.build_jobs(params, options, ['trainer'], FLAGS.logdir, FLAGS.model,
                                      default_jobs=False, peers=peers)
        locks = job_runner.claim_job_dirs(built, FLAGS.logdir, FLAGS.model, params)
    else:
        trainer = train_job.Trainer(params, train_job.train_dir_of(FLAGS.logdir), options,
                                    peers)
        built, locks = job_runner.BuiltJobs([('trainer', trainer)]), []
    code = job_runner.run_jobs(built, client_cluster)
    for lock in locks:
        lock.release()
    return code


def _check_sharding(params, count: int) -> None:
    """Refuses a bad task.train.sharding over `count` replicas (one per trainer client
    across clients; tfpipe/pipeline/sharding.py)
    before the cluster starts: the trainer checks it again when it builds its optimizer,
    but that is after the clients (or the workers) connect, so a client would first wait
    for all the others and a missing one would hide the real error behind a time-out."""
    from tfpipe.pipeline import sharding
    sharding.stage_of(params.task.train, count)


def _check_experts_across_clients(params, count: int) -> int:
    """P across `count` trainer clients (consecutive clients form its expert groups),
    checked before the cluster starts: P divides the clients and every MoE layer's
    experts, and the global batch cuts into equal micro-batches (all-to-all chunks are
    equal). Without this a client would fail only after its peers connected."""
    from tfpipe.pipeline import expert_parallel, microbatch
    pipeline = params.task.pipeline
    p = expert_parallel.check_expert_parallel(pipeline.expert_parallel, count, 'task.pipeline')
    for key, _, value in (line.partition(' : ') for line in params.task.ToText().splitlines()):
        if key.endswith('.num_experts') and value.strip().isdigit():
            expert_parallel.check_num_experts(int(value), p, f'task.{key.rsplit(".", 1)[0]}')
    batch = params.input.train.batch_size
    expert_parallel.check_even(microbatch.micro_batch_sizes(
        batch, pipeline.num_micro_batches * count), p, 'task.pipeline')
    return p


def _list_models() -> int:
    import model_registry
    print('\n'.join(model_registry.list_models()))
    return 0


def _serve_worker(cluster) -> int:
    from trainer import worker_job
    return worker_job.serve(cluster, FLAGS.run_locally, FLAGS.num_logical_cpus,
                            FLAGS.intra_op_threads, FLAGS.inter_op_threads)


def _check_required_flags() -> None:
    if not FLAGS.model:
        raise UsageError('--model is required: pick one of --list_models')
    if FLAGS.mode in ('sync', 'export', 'generate') and not FLAGS.logdir:
        raise UsageError('--logdir is required: the directory for checkpoints and summaries')


def _check_trace_step(max_steps: int | None) -> None:
    """--pipeline_trace_step names a training step: 1.., and at most `max_steps` when known
    (trainer/train_job.py checks it against the params' max_steps as well)."""
    step = FLAGS.pipeline_trace_step
    if step < 1:
        raise UsageError(f'--pipeline_trace_step={step} must be a step >= 1 (1 is the first '
                         'training step)')
    if max_steps and step > max_steps:
        raise UsageError(f'--pipeline_trace_step={step} is beyond max_steps={max_steps}: '
                         f'pick a step in 1..{max_steps}')


def _check_flags_before_tensorflow() -> None:
    """The flag checks of a one-process run that need no TensorFlow, before it is imported.

    Importing TensorFlow costs ~3 s of CPU; a typo in --job or a --logdir that is a file
    is refused in a fraction of that. `main` repeats these checks on every path (a
    cluster's processes check theirs there), so this only moves refusals earlier.
    """
    if (FLAGS.list_models or FLAGS.cluster_spec or FLAGS.cluster_resolver
            or FLAGS.job == 'worker' or os.environ.get('TF_CONFIG')):
        return
    _check_required_flags()
    jobs = _parse_jobs(FLAGS.job)
    if FLAGS.mode == 'sync':
        logdir_access.check_directory(FLAGS.logdir, '--logdir')
        if FLAGS.pipeline_trace_step is not None and 'trainer' in jobs:
            _check_trace_step(FLAGS.max_steps)
    logdir_access.check_directory(_data_dir(), '--tfds_data_dir', writable=False)


def _load_params_and_options(from_logdir: bool = False):
    """The model's params with every override applied, and the runtime options of the flags.

    `from_logdir`: the params --logdir's trainer recorded, with this command's job keys on top.
    """
    import tensorflow_datasets as tfds
    tfds.disable_progress_bar()
    from trainer import experiment, runtime_options
    params = experiment.load_params(FLAGS.model, FLAGS.params_override,
                                    FLAGS.params_file_override, FLAGS.gin_file,
                                    FLAGS.gin_bindings)
    options = runtime_options.RuntimeOptions()
    if FLAGS.max_steps is not None:
        params.task.train.max_steps = FLAGS.max_steps
        options.max_steps = FLAGS.max_steps
    if FLAGS.pipeline_trace_step is not None:
        _check_trace_step(max_steps=None)
        options.pipeline_trace_step = FLAGS.pipeline_trace_step
    if from_logdir:
        named = experiment.override_keys(FLAGS.params_override, FLAGS.params_file_override)
        named += list(experiment.gin_model_overrides())
        if FLAGS.max_steps is not None:
            named.append('task.train.max_steps')
        params = experiment.params_for_logdir(params, FLAGS.logdir, FLAGS.model, named)
    _set_data_dir(params)
    return params, options


def _run_jobs(params, options, jobs: list[str], cluster) -> int:
    """--mode=sync: build every job (validating all), claim their dirs, then run them."""
    from trainer import job_runner
    logdir = FLAGS.logdir
    # A TF_CONFIG evaluator's evaler_dev is its one job: refused, not skipped, without a dev split.
    built = job_runner.build_jobs(params, options, jobs, logdir, FLAGS.model,
                                  default_jobs=FLAGS.job is None and 'trainer' in jobs)
    # The first write to the logdir. The locks are held while the jobs run: one live job
    # per job dir (a lock lives in its open file, which garbage collection would close).
    locks = job_runner.claim_job_dirs(built, logdir, FLAGS.model, params)
    code = job_runner.run_jobs(built, cluster)
    for lock in locks:
        lock.release()
    return code


def _main_with_errors(argv) -> int:
    """main's exit status, with validation errors as one line (absl.app exits with it)."""
    from trainer import launcher  # imports no TensorFlow: the launcher process stays small
    if launcher.requested(FLAGS):
        return launcher.run(FLAGS, os.environ)
    try:
        _check_flags_before_tensorflow()
    except ValueError as e:  # UsageError and logdir_access's refusals: one line each
        print(f'error: {e}', file=sys.stderr)
        return EXIT_BAD_INPUT
    from tfpipe import checkpoints
    from tfpipe.cluster import WorkerUnavailableError
    from tfpipe.hyperparams import ParamsError
    from trainer import train_job
    try:
        return main(argv)
    except (ValueError, ParamsError, checkpoints.CheckpointError) as e:
        # Validation errors: bad flags, params, data or checkpoints. Anything else is
        # a bug and keeps its traceback.
        print(f'error: {checkpoints.one_line(str(e)) or type(e).__name__}', file=sys.stderr)
        return EXIT_BAD_INPUT
    except train_job.NonFiniteLossError as e:
        print(f'error: {e}', file=sys.stderr)
        return EXIT_NON_FINITE
    except WorkerUnavailableError as e:
        print(f'error: {e}', file=sys.stderr)
        return 1
    except OSError as e:
        if e.errno not in _STORAGE_ERRORS:
            raise
        print(f'error: {e.strerror} while writing {e.filename or "the logdir"}: '
              f'{_STORAGE_ERRORS[e.errno]}; checkpoints already written are intact',
              file=sys.stderr)
        return EXIT_BAD_INPUT


# A full or read-only disk is the machine's state, not a bug: one line and the fix.
_STORAGE_ERRORS = {errno.ENOSPC: 'free some space or point --logdir elsewhere',
                   errno.EDQUOT: 'raise the quota or point --logdir elsewhere',
                   errno.EROFS: 'point --logdir at a writable file system',
                   errno.EACCES: 'make --logdir writable for this user or choose another'}


# absl's help flags, by the modules whose flags each prints: None is every module.
_HELP_FLAGS = {'help': ('trainer.',), '?': ('trainer.',), 'helpshort': ('trainer.',),
               'helpfull': None}


def _help_text(argv: Sequence[str]) -> str | None:
    """The usage and flags a help flag in `argv` asks for; None without one.

    Answered here, not by absl: absl exits 1 after printing help (a script that
    checks `--helpfull` would see a failure), prints its own usage line instead of
    this module's, and `trainer.run` parses flags without absl.app, which knows no
    help flags at all.
    """
    for arg in argv:
        if arg == '--':
            break
        modules = _HELP_FLAGS.get(arg.lstrip('-'), False) if arg.startswith('-') else False
        if modules is not False:
            shown = [module for module in FLAGS.flags_by_module_dict()
                     if modules is None or module.startswith(modules)]
            more = '' if modules is None else '\n\n(--helpfull lists every flag)'
            return (f'{__doc__.strip()}\n\nflags:\n' +
                    '\n'.join(FLAGS.module_help(m).strip('\n') for m in shown) + more)
    return None


def run() -> None:
    """Console-script entry point (tfpipe-trainer) and `python -m trainer`."""
    help_text = _help_text(sys.argv[1:])
    if help_text is not None:
        print(help_text)
        sys.exit(0)
    app.run(_main_with_errors)


_ran_in_process = False


def run_in_process(argv: Sequence[str]) -> int:
    """`trainer.run`: the binary as a call that returns its exit status.

    For a process that a cluster manager owns and runs Python in (a Ray Train
    worker's `train_loop_per_worker`), where sys.exit would end the worker and
    sys.argv is not ours. Once per process: the flags, the logical devices and the
    collective runtime are process-wide and TensorFlow cannot set them up twice.
    """
    global _ran_in_process
    if _ran_in_process:
        print('error: trainer.run was already called in this process: TensorFlow\'s devices '
              'and cluster are set up once per process; run each training in a new process',
              file=sys.stderr)
        return EXIT_BAD_INPUT
    _ran_in_process = True  # TensorFlow's defaults were set by importing tfpipe (above)
    help_text = _help_text(argv)
    if help_text is not None:
        print(help_text)
        return 0
    try:
        rest = FLAGS(['trainer', *argv])
    except flags.Error as e:
        print(f'error: {e}: see python -m trainer --helpfull', file=sys.stderr)
        return EXIT_BAD_INPUT
    absl_logging.use_absl_handler()
    return _main_with_errors(rest)
