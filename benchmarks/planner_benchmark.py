"""Planner figures: predicted vs measured steps, side by side in one run, and Table 2's shape.

    python benchmarks/planner_benchmark.py                  # both sections (~10 min on 2 cores)
    python benchmarks/planner_benchmark.py --section=predict --quick
    python benchmarks/planner_benchmark.py --section=pick --data_dir=/tmp/tfds

Sections (the thread-pool default is measured by threads_benchmark.py):
- predict: for the models in params/ whose data is generated here and a Dense stack, the
  planner's predicted step time vs the measured trainer step, over a grid of (K, M) plus the
  recommendation (rounds interleaved across configurations), the fraction within 25%, and
  the recommendation vs the fastest measured configuration. The planner is calibrated as
  inspect_pipeline does: on measured steps of the model's configured pipeline, of the same
  with twice the micro-batches, of the same on one device and of that under the other
  recompute policy;
- pick: inspect_pipeline run 3 times on AmoebaNetPipe (it measures its best predicted
  configurations before recommending), then its picks and a held-out grid (K=1 M=1 no
  recompute, K=2 M=4, K=2 M=2, K=4 M=4) measured side by side: pick/best ratios, how many
  distinct picks, and inspect_pipeline's time;
- tensor: an MLP of Megatron pairs (ParallelMLP) on 4 logical CPUs as K=4,T=1 vs K=2,T=2 vs
  K=1,T=4: the planner's predicted step (calibrated as inspect_pipeline does) and per-device
  peak beside the measured median step, rounds interleaved;
- table2: the shape of GPipe's Table 2 (normalised throughput over K and M) simulated from
  profiled AmoebaNet and Transformer bodies under an accelerator device profile.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

PREDICT_MODELS = ('image.shapes.SmallConvPipe', 'image.shapes.AmoebaNetPipe',
                  'mt.reverse.TransformerPipe', 'dense_stack')
GRID = ((1, 1), (1, 4), (2, 2), (2, 4), (2, 8), (4, 4), (4, 8))
TOLERANCE = 0.25


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--section', choices=('all', 'predict', 'pick', 'tensor', 'table2'),
                    default='all')
    ap.add_argument('--quick', action='store_true', help='fewer steps and rounds')
    ap.add_argument('--models', default=','.join(PREDICT_MODELS),
                    help='comma list for the predict section')
    ap.add_argument('--data_dir', default=os.path.expanduser('~/tensorflow_datasets'))
    return ap.parse_args()


# -- threads -------------------------------------------------------------------------------

# -- predict -------------------------------------------------------------------------------

def model_params(name: str, data_dir: str):
    from tfpipe import layers
    from trainer import experiment
    if name != 'dense_stack':
        params = experiment.load_params(name)
        params.input.train.data_dir = data_dir
        return params
    # The benchmark stack: 16 x Dense(256) on flattened 16x16x3 images, batch 256, configured
    # as K=2, M=4 (the configuration the planner is calibrated on).
    params = experiment.load_params('image.shapes.SmallConvPipe')
    body = [layers.Flatten.Params().Set(name='flat'),
            layers.Dense.Params().Set(name='fc0', input_dim=768, output_dim=256,
                                      activation='relu')]
    body += [layers.Dense.Params().Set(name=f'fc{i}', input_dim=256, output_dim=256,
                                       activation='relu') for i in range(1, 16)]
    body += [layers.Dense.Params().Set(name='logits', input_dim=256, output_dim=4)]
    params.task.pipeline.Set(body=body, balance=None, num_cells=2, partition_by='params',
                             input_shape=None, num_micro_batches=4)
    params.input.train.Set(batch_size=256, data_dir=data_dir)
    return params


def predict_section(args) -> None:
    import tensorflow as tf
    from tfpipe.tuning import planner, planning
    from tfpipe.tuning.calibration import MeasuredRun
    from trainer import inspect_modes, plan_mode

    rounds, steps = (3, 3) if args.quick else (5, 6)
    intra = tf.config.threading.get_intra_op_parallelism_threads()
    device = planner.DeviceProfile(planner.simulator.DeviceModel(
        parallelism=planner.local_parallelism(intra)))
    print(f'\n## predict: planner vs measured trainer step (ms), local device model '
          f'parallelism={device.model.parallelism:g}, intra_op_threads={intra}; {rounds} '
          f'interleaved rounds of {steps} steps per configuration, each round also recording '
          'steps of the model\'s own configuration, which calibrate the predictions; fastest '
          'and median step over all rounds')
    ratios, to_median = [], []  # predicted over each configuration's fastest / median step
    for name in args.models.split(','):
        params = model_params(name, args.data_dir)
        task = params.task.Instantiate()
        batch_size = params.input.train.batch_size
        profiles = inspect_modes.profile_model(params, task, 32)
        owns = planning.calibration_configs(plan_mode.configured_pipeline(task), profiles,
                                            batch_size)
        with plan_mode.StepMeasurer(params) as measure:
            # The recommendation comes from a calibration as inspect_pipeline makes it.
            first = planning.fit_calibration(
                profiles, [measure(c, planning.CALIBRATION_STEPS, True) for c in owns],
                batch_size, device.model.parallelism)
            configs = planner.search(profiles, batch_size, 4, device, calibration=first)
            best = configs[0]
            grid = {(k, m, 'always') for k, m in GRID if k <= len(profiles)}
            grid.add((best.num_cells, best.num_micro_batches, best.recompute))
            chosen = {}
            for c in configs:
                key = (c.num_cells, c.num_micro_batches, c.recompute)
                if key in grid and c.schedule == best.schedule and key not in chosen:
                    chosen[key] = c
            measured = {key: [] for key in chosen}  # seconds of every step
            recorded = [([], []) for _ in owns]
            loads = []
            for r in range(rounds):
                keys = list(chosen)
                keys = keys[r % len(keys):] + keys[:r % len(keys)]  # rotate the order
                for c, (lines, walls) in zip(owns, recorded):
                    got = measure(c, steps, True)
                    lines += got.timelines
                    walls += got.step_seconds
                for key in keys:
                    measured[key] += measure(chosen[key], steps, False).step_seconds
                loads.append(os.getloadavg()[0])
        cal = planning.fit_calibration(
            profiles, [MeasuredRun(c.balance, c.num_micro_batches, lines, walls, c.schedule,
                                   c.recompute) for c, (lines, walls) in zip(owns, recorded)],
            batch_size, device.model.parallelism)
        print(f'{name}: {cal.describe()}')
        print(f'{"model":<28} {"K":>2} {"M":>2} {"recompute":<11} {"predicted":>9} '
              f'{"fastest":>9} {"pred/fast":>9} {"median":>9} {"pred/med":>9}  (load average '
              f'{min(loads):.1f}-{max(loads):.1f})')
        for key in sorted(chosen):
            c = chosen[key]
            predicted = cal.step_overhead + float(planner.simulate(
                profiles, c.balance, c.num_micro_batches, batch_size,
                c.recompute, c.schedule, device.model, cal).step_time)
            fast, med = min(measured[key]), statistics.median(measured[key])
            ratios.append(predicted / fast)
            to_median.append(predicted / med)
            mark = ' <- recommended' if c is best else ''
            print(f'{name:<28} {key[0]:>2} {key[1]:>2} {key[2]:<11} {1e3 * predicted:>9.2f} '
                  f'{1e3 * fast:>9.2f} {predicted / fast:>9.2f} {1e3 * med:>9.2f} '
                  f'{predicted / med:>9.2f}{mark}')
        fastest = {key: min(v) for key, v in measured.items()}
        quickest = min(fastest, key=fastest.get)
        best_key = (best.num_cells, best.num_micro_batches, best.recompute)
        print(f'{name:<28} recommended/fastest measured: '
              f'{fastest[best_key] / fastest[quickest]:.2f}x (fastest {quickest})')
    for label, values in (('fastest', ratios), ('median', to_median)):
        within = sum(abs(r - 1) <= TOLERANCE for r in values)
        print(f'predicted/{label} measured over all models: {min(values):.2f}-'
              f'{max(values):.2f}, {within}/{len(values)} within {TOLERANCE:.0%}')


# -- pick ----------------------------------------------------------------------------------

PICK_MODEL = 'image.shapes.AmoebaNetPipe'
# Held out: never among the planner's inputs. (K, M, recompute) of the default model.
HELD_OUT = ((1, 1, 'never'), (2, 4, 'always'), (2, 2, 'always'), (4, 4, 'always'))


def run_inspect_pipeline(data_dir: str, logdir: str) -> tuple[dict, float]:
    """One `--mode=inspect_pipeline` of PICK_MODEL in a subprocess: (JSON report, seconds)."""
    import json
    import subprocess
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get('PYTHONPATH', ''))
    begin = time.perf_counter()
    out = subprocess.run([sys.executable, '-m', 'trainer', f'--model={PICK_MODEL}',
                          '--mode=inspect_pipeline', f'--logdir={logdir}',
                          f'--tfds_data_dir={data_dir}'], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=1800)
    seconds = time.perf_counter() - begin
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    with open(os.path.join(logdir, 'inspect_pipeline.json')) as f:
        return json.load(f), seconds


def pick_section(args) -> None:
    from tfpipe.tuning import planning
    from tfpipe.tuning.planner import Config
    from trainer import experiment, plan_mode

    runs, rounds, steps = 3, (3 if args.quick else 6), 5
    print(f'\n## pick: inspect_pipeline on {PICK_MODEL} {runs} times, then its picks and the '
          f'held-out grid measured side by side ({rounds} interleaved rounds of {steps} steps; '
          'median step)')
    picks, extra, whole = [], [], []
    for i in range(runs):
        report, seconds = run_inspect_pipeline(args.data_dir, tempfile.mkdtemp())
        best = report['best']
        key = (best['num_cells'], best['num_micro_batches'], best['recompute'])
        steps_measured = sum(len(m['step_seconds']) for m in report['measured'])
        candidates = ', '.join(f"K={c['num_cells']} M={c['num_micro_batches']} {c['recompute']}"
                               for c in (m['config'] for m in report['measured']))
        print(f'run {i + 1}: picked K={key[0]} M={key[1]} {key[2]} {best["schedule"]} '
              f'(balance {best["balance"]}) of {candidates}; inspect_pipeline took '
              f'{seconds:.0f} s, of which measuring the candidates '
              f'{report["measuring_seconds"]:.0f} s ({steps_measured} steps; load '
              f'{os.getloadavg()[0]:.1f})')
        picks.append((key, best))
        extra.append(report['measuring_seconds'])
        whole.append(seconds)
    configs = {('grid',) + key: Config(key[0], None, key[1], key[2], 'fill_drain')
               for key in HELD_OUT}  # balance None: the model's own partition
    for key, best in picks:
        configs.setdefault(('pick',) + key, Config(*(best[k] for k in (
            'num_cells', 'balance', 'num_micro_batches', 'recompute', 'schedule'))))
    params = experiment.load_params(PICK_MODEL)
    params.input.train.data_dir = args.data_dir
    names = list(configs)
    loads = [os.getloadavg()[0]]
    with plan_mode.StepMeasurer(params) as measure:
        measured = planning.interleaved(measure, [configs[n] for n in names], rounds, steps)
    loads.append(os.getloadavg()[0])
    median = {name: statistics.median(v) for name, v in zip(names, measured)}
    best_grid = min(median[('grid',) + key] for key in HELD_OUT)
    print(f'{"":<6} {"K":>2} {"M":>2} {"recompute":<11} {"median ms":>9} {"/best grid":>10}  '
          f'(load average {min(loads):.1f}-{max(loads):.1f})')
    for name in names:
        print(f'{name[0]:<6} {name[1]:>2} {name[2]:>2} {name[3]:<11} '
              f'{1e3 * median[name]:>9.2f} {median[name] / best_grid:>10.2f}')
    ratios = [median[('pick',) + key] / best_grid for key, _ in picks]
    print(f'pick/best of the held-out grid in {runs} runs: '
          + ', '.join(f'{r:.2f}' for r in ratios)
          + f'; {len({key for key, _ in picks})} distinct pick(s); inspect_pipeline '
          f'{min(whole):.0f}-{max(whole):.0f} s per run, of which measuring the candidates '
          f'{min(extra):.0f}-{max(extra):.0f} s')


# -- tensor --------------------------------------------------------------------------------

TENSOR_GRID = ((4, 1), (2, 2), (1, 4))  # (K, T) on 4 devices


def tensor_params(data_dir: str, width: int = 256, blocks: int = 4):
    """Flatten, Dense to `width`, `blocks` ParallelMLP pairs (hidden 4 x width), logits;
    batch 64, M=4: every block splits over T."""
    from tfpipe import layers
    from tfpipe.layers.tensor_parallel_dense import ParallelMLP
    from trainer import experiment
    params = experiment.load_params('image.shapes.SmallConvPipe')
    body = [layers.Flatten.Params().Set(name='flat'),
            layers.Dense.Params().Set(name='fc_in', input_dim=768, output_dim=width,
                                      activation='relu')]
    body += [ParallelMLP.Params().Set(name=f'mlp{i}', input_dim=width, hidden_dim=4 * width)
             for i in range(blocks)]
    body += [layers.Dense.Params().Set(name='logits', input_dim=width, output_dim=4)]
    params.task.pipeline.Set(body=body, balance=None, num_cells=4, partition_by='params',
                             input_shape=None, num_micro_batches=4, recompute='never')
    params.input.train.Set(batch_size=64, data_dir=data_dir)
    return params


def tensor_section(args) -> None:
    import tensorflow as tf
    from tfpipe.tuning import planner, planning, tensor_split
    from trainer import inspect_modes, plan_mode

    rounds, steps = (3, 3) if args.quick else (6, 5)
    params = tensor_params(args.data_dir)
    task = params.task.Instantiate()
    batch = params.input.train.batch_size
    intra = tf.config.threading.get_intra_op_parallelism_threads()
    device = planner.DeviceProfile(planner.simulator.DeviceModel(
        parallelism=planner.local_parallelism(intra)))
    degrees = tensor_split.tensor_parallel_degrees(params.task.pipeline, 4)
    profiles = inspect_modes.profile_model(params, task, 4)
    print(f'\n## tensor: {len(profiles)} layers ({sum(p.all_reduces for p in profiles)} '
          f'split pairs), batch {batch}, M=4, recompute never, on 4 logical CPUs; T allowed: '
          f'{degrees}; {rounds} interleaved rounds of {steps} steps; median step')
    configured = plan_mode.configured_pipeline(task)
    with plan_mode.StepMeasurer(params) as measure:
        cal = planning.fit_calibration(
            profiles, [measure(c, planning.CALIBRATION_STEPS, True)
                       for c in planning.calibration_configs(configured, profiles, batch)],
            batch, device.model.parallelism)
        configs = planner.search(profiles, batch, 4, device, micro_batches=[4],
                                 recompute=['never'], schedules=['fill_drain'],
                                 calibration=cal, tensor_parallel=degrees)
        grid = [next(c for c in configs if (c.num_cells, c.tensor_parallel) == kt)
                for kt in TENSOR_GRID]
        loads = [os.getloadavg()[0]]
        measured = planning.interleaved(measure, grid, rounds, steps)
        loads.append(os.getloadavg()[0])
    print(cal.describe())
    print(f'{"K":>2} {"T":>2} {"balance":<14} {"predicted ms":>12} {"median ms":>10} '
          f'{"fastest ms":>10} {"pred/med":>8} {"peak MiB/device":>15} {"all-reduced MB/step":>19}  (load '
          f'{min(loads):.1f}-{max(loads):.1f})')
    fastest = min(statistics.median(m) for m in measured)
    for c, m in zip(grid, measured):
        med = statistics.median(m)
        costs = planner.cell_costs(profiles, c.balance, 4, batch, 'never', cal,
                                   c.tensor_parallel)
        # Per step: M micro-batches x (forward + backward) of every cell's all-reduces.
        reduced = 2 * 4 * sum(cell.collective_bytes for cell in costs) if c.tensor_parallel > 1 \
            else 0.0
        print(f'{c.num_cells:>2} {c.tensor_parallel:>2} {str(c.balance):<14} '
              f'{1e3 * c.step_time:>12.2f} {1e3 * med:>10.2f} {1e3 * min(m):>10.2f} '
              f'{c.step_time / med:>8.2f} '
              f'{max(c.peak_bytes) / 2**20:>15.2f} {reduced / 1e6:>19.3f}'
              + ('  <- fastest measured' if med == fastest else '')
              + ('  <- predicted best' if c is min(grid, key=lambda g: g.step_time) else ''))


# -- table2 --------------------------------------------------------------------------------

PAPER_TABLE2 = {
    'AmoebaNet-D': {(2, 1): 1.0, (2, 4): 1.07, (2, 32): 1.21, (4, 1): 1.13, (4, 4): 1.26,
                    (4, 32): 1.84, (8, 1): 1.38, (8, 4): 1.72, (8, 32): 3.48},
    'Transformer': {(2, 1): 1.0, (2, 4): 1.7, (2, 32): 1.8, (4, 1): 1.07, (4, 4): 3.2,
                    (4, 32): 3.4, (8, 1): 1.3, (8, 4): 4.8, (8, 32): 6.3},
}


def table2_section(args) -> None:
    import tensorflow as tf
    from tfpipe.bodies import amoebanet_body, transformer_body
    from tfpipe.tuning import planner, profile

    batch, size, blocks, dim = (32, 16, 4, 64) if args.quick else (64, 32, 16, 128)
    bodies = {
        'AmoebaNet-D': (amoebanet_body(10, filters=16, cells_per_stage=2),
                        tf.random.stateless_normal([batch, size, size, 3], [0, 0])),
        'Transformer': (transformer_body(256, 64, dim, 4 * dim, 4, blocks),
                        tf.zeros([batch, 64], tf.int32)),
    }
    # Assumed accelerators: each device computes like one logical CPU of this host running
    # alone, devices are independent (parallelism: one per device), and neighbouring devices
    # exchange activations at 1 GB/s.
    device = planner.parse_device_profile('speed=1,bandwidth=1e9')
    ks, ms = (2, 4, 8), (1, 4, 32)
    # Layers are profiled at batch 1 and `batch`; the table is simulated for a mini-batch of
    # 8 x batch (M=32 gives micro-batches of batch / 4), extrapolating the per-example cost.
    print('\n## table2: normalised throughput (K=2, M=1 = 1), fill-drain, recompute always, '
          f'mini-batch {8 * batch}; simulated | GPipe paper (TPUv3)')
    for name, (body, sample) in bodies.items():
        profiles = profile.profile_body(body, sample, '/CPU:0', [1, batch])
        table = planner.throughput_table(profiles, 8 * batch, device, ks, ms)
        print(f'{name} ({len(profiles)} layers)   ' + '  '.join(f'M={m:<12}' for m in ms))
        for k in ks:
            cells = '  '.join(f'{table[(k, m)]:5.2f} | {PAPER_TABLE2[name][(k, m)]:<5.2f}'
                              for m in ms)
            print(f'  K={k}                ' + cells)


def main() -> int:
    args = parse_args()
    import tfpipe
    tfpipe.configure_logical_cpus(8)
    if args.section in ('all', 'predict'):
        predict_section(args)
    if args.section in ('all', 'pick'):
        pick_section(args)
    if args.section in ('all', 'tensor'):
        tensor_section(args)
    if args.section in ('all', 'table2'):
        table2_section(args)
    return 0


if __name__ == '__main__':
    sys.exit(main())
