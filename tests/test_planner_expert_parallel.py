"""The planner's expert-parallel axis: P (a divisor of R and of every E) beside K, M and T.

A member holds 1/P of each MoE layer's experts (and the exchange's buffers), and pays two
all-to-alls per MoE layer per micro-batch forward and backward. The body is the expert-
parallel pipeline tests' (fc0, an MoE layer of E=4 experts, fc2; float64), built once."""
import math

import pytest
import tensorflow as tf

from tests.test_expert_parallel_pipeline import pipeline
from tfpipe import optimizers
from tfpipe.pipeline.cell import recompute_flags
from tfpipe.tuning import calibration, expert_parallel_memory, planner, simulator
from tfpipe.tuning.profile import Affine, LayerProfile, slot_bytes_of

ADAM = optimizers.Adam.Params()
R, BATCH = 4, 16  # replicas; each replica's batch
E, D, CAPACITY_FACTOR, TOP_K = 4, 8, 2.0, 2  # the MoE layer of tests.test_expert_parallel_pipeline


@pytest.fixture(scope='module')
def body():
    """(P=1 pipeline of R replicas, its profiles with Adam's slots, its ExpertLayers)."""
    pipe = pipeline(1, R, 1)
    profiles = [LayerProfile(layer.params.name, Affine(1e-4, 1e-5), Affine(2e-4, 2e-5),
                             float(sum(v.shape.num_elements() * 8
                                       for v in layer.trainable_variables)),
                             slot_bytes_of(ADAM, layer.trainable_variables), 48.0, 64.0)
                for layer in pipe.replica_cells[0][0].layers]
    sample = tf.zeros([BATCH, 6], tf.float64)
    return pipe, profiles, expert_parallel_memory.expert_layers(pipe, ADAM, sample, R)


def _buffer(micro):
    """One all-to-all buffer of the MoE layer by hand: E x C x D float64 values."""
    return E * math.ceil(CAPACITY_FACTOR * TOP_K * micro / E) * D * 8


def test_the_p_the_replicas_and_experts_allow_and_a_bad_one_is_one_line(body):
    _, profiles, experts = body
    assert experts.degrees() == [1, 2, 4]
    assert experts.fractions[0] == (0.0, 0.0) and experts.fractions[2] == (0.0, 0.0)
    assert 0.5 < experts.fractions[1][0] < 1  # the experts; the router stays whole
    assert list(experts.buffers(4)) == [0.0, _buffer(4), 0.0]
    device = planner.DeviceProfile(simulator.DeviceModel())
    with pytest.raises(ValueError, match=r'expert_parallel=3 does not divide num_replicas=4'):
        planner.search(profiles, BATCH, 1, device, experts=experts, expert_parallel=[3])
    eight = expert_parallel_memory.ExpertLayers(8, (4,), experts.fractions, experts.buffers)
    with pytest.raises(ValueError, match=r'num_experts=4 is not divisible by expert_parallel=8'):
        planner.search(profiles, BATCH, 1, device, experts=eight, expert_parallel=[8])


def test_a_budget_only_p2_fits_picks_p2_at_the_memory_expert_parallel_memory_predicts(body):
    _, profiles, experts = body
    free = planner.search(profiles, BATCH, 1, planner.DeviceProfile(simulator.DeviceModel()),
                          experts=experts)
    least = {p: min(max(c.peak_bytes) for c in free if c.expert_parallel == p)
             for p in (1, 2, 4)}
    assert least[4] < least[2] < least[1]
    budget = (least[2] + least[1]) / 2
    configs = planner.search(profiles, BATCH, 1,
                             planner.DeviceProfile(simulator.DeviceModel(), budget),
                             experts=experts)
    best = planner.best_fitting(configs, budget)
    assert best.expert_parallel >= 2
    assert not any(c.fits for c in configs if c.expert_parallel == 1)
    # The same configuration from a built member of P: its experts' variables
    # (member_profiles) and its all-to-all buffers (all_to_all_bytes) on one cell.
    member = pipeline(best.expert_parallel, R, 1)
    micro = BATCH // best.num_micro_batches
    alone = simulator.simulate(
        planner.SCHEDULES[best.schedule](1, best.num_micro_batches),
        calibration.cell_costs(expert_parallel_memory.member_profiles(member, profiles, ADAM),
                               best.balance, best.num_micro_batches, BATCH, best.recompute))
    exchange = expert_parallel_memory.all_to_all_bytes(member.params, best.balance,
                                                       tf.TensorShape([micro, 6]))
    assert exchange == [expert_parallel_memory.EXCHANGE_BUFFERS * _buffer(micro)]
    assert best.peak_bytes == pytest.approx([alone.peak_bytes[0] + exchange[0]], rel=1e-12)
    assert best.overrides()['task.pipeline.expert_parallel'] == best.expert_parallel
    assert f'P={best.expert_parallel}' in best.describe()
    assert ' P ' in planner.format_table(configs).splitlines()[0]


def test_with_room_the_time_model_counts_the_exchange_and_picks_p1(body):
    _, profiles, experts = body
    bandwidth, latency = 1e6, 1e-5
    device = planner.DeviceProfile(simulator.DeviceModel(bandwidth=bandwidth, latency=latency))
    configs = planner.search(profiles, BATCH, 1, device, experts=experts,
                             schedules=['fill_drain'])
    assert configs[0].expert_parallel == 1
    by_shape = {(c.num_micro_batches, c.recompute, c.expert_parallel): c for c in configs}
    checked = 0
    for (m, policy, p), config in by_shape.items():
        if p == 1:
            continue
        # One cell: the step is its tasks in a row, so P adds exactly its exchanges: two
        # all-to-alls of the MoE layer's buffer per forward, backward and recompute, each
        # a latency and the (P-1)/P of the buffer other members take over the link.
        runs = m * (2 + sum(recompute_flags(policy, 1)))
        one = 2 * latency + (p - 1) / p * 2 * _buffer(BATCH / m) / bandwidth
        extra = config.step_time - by_shape[(m, policy, 1)].step_time
        assert extra == pytest.approx(runs * one, rel=1e-9)
        checked += 1
    assert checked == 2 * len({c.num_micro_batches for c in configs}) * 3  # P in {2,4} x M x policies
    # On free links P costs nothing but its buffers: ties go to P=1.
    free = planner.search(profiles, BATCH, 1, planner.DeviceProfile(simulator.DeviceModel()),
                          experts=experts)
    assert free[0].expert_parallel == 1
    assert 'expert_parallel' not in free[0].overrides()
    assert planner.search(profiles, BATCH, 1, planner.DeviceProfile(simulator.DeviceModel()),
                          experts=experts, set_expert_parallel=True)[0].overrides()[
        'task.pipeline.expert_parallel'] == 1


def _table_before_p(configs, limit=8):
    """format_table as it was before P (main at the time), for configurations of P=1."""
    tensor = any(c.tensor_parallel != 1 for c in configs)
    lines = [f'{"K":>2} {"T  " if tensor else ""}{"M":>3} {"recompute":<11} {"schedule":<10} '
             f'{"step ms":>8} {"bubble":>6} {"peak MiB/device":<24} fits  balance']
    for c in configs[:limit]:
        peaks = '/'.join(f'{p / 2**20:.0f}' for p in c.peak_bytes)
        t = f'{c.tensor_parallel:<2} ' if tensor else ''
        lines.append(f'{c.num_cells:>2} {t}{c.num_micro_batches:>3} {c.recompute:<11} '
                     f'{c.schedule:<10} {1e3 * c.step_time:>8.2f} {c.bubble:>6.2f} '
                     f'{peaks:<24} {"yes" if c.fits else "NO":<5} {c.balance}')
    return '\n'.join(lines)


@pytest.mark.parametrize('tensor_parallel', [(1,), (1, 2)])
def test_a_body_without_experts_plans_and_prints_as_before(body, tensor_parallel):
    _, profiles, experts = body
    plain = [LayerProfile(p.name, p.forward, p.backward, p.param_bytes, p.slot_bytes,
                          p.input_bytes_per_example, p.output_bytes_per_example,
                          split_fraction=0.5, all_reduces=1) for p in profiles]
    device = planner.DeviceProfile(simulator.DeviceModel(bandwidth=1e8), 2**20)
    configs = planner.search(plain, BATCH, 4, device, tensor_parallel=tensor_parallel)
    assert {c.expert_parallel for c in configs} == {1}
    # The pre-P Config (no P fields given) of each search result, and its table.
    before = [planner.Config(c.num_cells, c.balance, c.num_micro_batches, c.recompute,
                             c.schedule, c.step_time, c.bubble, c.peak_bytes, c.fits,
                             c.tensor_parallel, c.set_tensor_parallel) for c in configs]
    assert planner.format_table(configs) == _table_before_p(before)
    assert planner.format_table(configs, limit=100) == _table_before_p(before, limit=100)
    assert [c.describe() for c in configs] == [c.describe() for c in before]
    assert all('expert_parallel' not in c.overrides() for c in configs)
    # An MoE body planned with P=1 only (R=1) prints no P column either.
    alone = expert_parallel_memory.ExpertLayers(1, (E,), experts.fractions, experts.buffers)
    one = planner.search(profiles, BATCH, 2, device, experts=alone)
    assert alone.degrees() == [1] and ' P ' not in planner.format_table(one).splitlines()[0]


def test_the_language_model_s_moe_block_is_what_p_divides_and_exchanges():
    """TinyMoETransformerLM at R=2: its block1 (8 experts) allows P in {1, 2}; only its
    weights shrink with P and only it has all-to-all buffers."""
    from trainer import experiment
    params = experiment.load_params('lm.pystdlib.TinyMoETransformerLM',
                                    'task.pipeline.num_replicas=2')
    task = params.task.Instantiate()
    batch = next(iter(params.input.train.Instantiate().Dataset()))
    experts = expert_parallel_memory.expert_layers(task.pipe, params.task.train.optimizer,
                                                   task.PipelineInputs(batch), 2)
    names = [p.name for p in params.task.pipeline.body]
    assert experts.degrees() == [1, 2] and experts.num_experts == (8,)
    assert [n for n, f in zip(names, experts.fractions) if f[0] > 0] == ['block1']
    assert [n for n, b in zip(names, experts.buffers(2)) if b > 0] == ['block1']
    plain = experiment.load_params('lm.pystdlib.TinyTransformerLM',
                                   'task.pipeline.num_replicas=2')
    assert expert_parallel_memory.expert_layers(plain.task.Instantiate().pipe, None,
                                                task.PipelineInputs(batch), 2) is None


def test_the_trainer_measures_a_p2_model_s_configuration_as_one_replica_at_p1():
    """The model runs R=2, P=2; the planner's measuring function runs one replica, which
    cannot hold half the experts alone: it measures the configuration at P=1."""
    from trainer import experiment, plan_mode
    params = experiment.load_params('lm.pystdlib.TinyMoETransformerLM',
                                    'task.pipeline.num_replicas=2,'
                                    'task.pipeline.expert_parallel=2')
    task = params.task.Instantiate()
    configured = plan_mode.configured_pipeline(task)
    assert (configured.expert_parallel, configured.overrides()['task.pipeline.expert_parallel']
            ) == (2, 2)
    with plan_mode.StepMeasurer(params) as measure:
        run = measure(configured, 1, False)
        pipe = next(iter(measure._runs.values())).trainer.task.pipe  # noqa: SLF001
    assert run.balance == list(task.pipe.balance) and run.step_seconds[0] > 0
    assert (pipe.num_replicas, pipe.params.expert_parallel) == (1, 1)


def test_every_stage_at_p2_holds_the_slots_and_weights_the_trainer_holds(body):
    """At P=2 of R=4 the planner offers every stage. From stage 1 on a member holds 1/R of
    P=1's slots (its E/P experts' slots over the R/P replicas holding them, the rest over
    R), as the trainer's ShardedOptimizer does; at stage 3 likewise 1/R of P=1's weights
    beside the gathered cell, as its WeightShards hold them."""
    from tfpipe.pipeline.sharded_optimizer import ShardedOptimizer
    _, profiles, experts = body
    configs = planner.search(profiles, BATCH, 1, planner.DeviceProfile(simulator.DeviceModel()),
                             experts=experts, expert_parallel=[2], replicas=R,
                             micro_batches=(2,), recompute=('always',), schedules=('1f1b',))
    by_stage = {c.sharding: c for c in configs}
    assert set(by_stage) == {'none', 'optimizer_states', 'gradients', 'weights'}
    parts = sum(p.param_bytes for p in profiles) / R
    assert max(by_stage['weights'].peak_bytes) - max(by_stage['gradients'].peak_bytes) == \
        pytest.approx(parts, rel=1e-12)
    sharded = pipeline(2, R, 1)
    sharded.ShardWeights()
    assert sharded.weight_shards.Bytes()[0] == pytest.approx(parts, rel=0.02)  # padded parts
    unsharded = sum(p.slot_bytes for p in expert_parallel_memory.cut(profiles,
                                                                     experts.fractions, 2))
    held = sum(p.slot_bytes for p in profiles) / R
    saved = max(by_stage['none'].peak_bytes) - max(by_stage['optimizer_states'].peak_bytes)
    assert saved == pytest.approx(unsharded - held, rel=1e-12)
    pipe = pipeline(2, R, 1)
    variables = [{path: v for path, v in copy.items() if v.trainable}
                 for copy in pipe.ReplicaVariablesByPath()]
    got, whole = ShardedOptimizer(ADAM, variables, expert_parallel=2).SlotBytes()
    assert whole == pytest.approx(unsharded, rel=1e-12)
    assert got == pytest.approx(held, rel=0.02)  # parts padded where R/P or R do not divide
