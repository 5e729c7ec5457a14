"""Model and hardware FLOPs per step, the cached peak, and the progress line's figures."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import tensorflow as tf

from tfpipe import inputs, layers
from tfpipe.bodies import transformer_lm_body
from tests import trainer_helpers as th
from tfpipe.tuning import flops, peak_flops
from trainer.throughput import Throughput

B, T, V = 4, 32, inputs.BYTE_VOCAB_SIZE
D, H, L = 64, 256, 3


def _lm_shapes():
    ids = tf.TensorShape([B, T])
    return {'x': ids, 'segment_ids': ids, 'positions': ids}


def test_a_transformer_lm_step_is_palms_6n_plus_12lhqt_per_token():
    """PaLM appendix B: 6N + 12 L H Q T per token, N the parameters that multiply
    (blocks and the tied softmax; a lookup multiplies nothing), H Q = d."""
    body = transformer_lm_body(V, T, D, H, num_heads=4, num_blocks=L)
    step = flops.step_flops(body, balance=[len(body)], recompute='never',
                            input_shapes=_lm_shapes())
    block_weights = 4 * D * D + 2 * D * H
    palm = (6 * (L * block_weights + D * V) + 12 * L * D * T) * B * T
    # FPropMeta also counts LayerNorms, residual adds and lookups: 1.3% at width 64,
    # about 0.1% at GPT-2's 768.
    assert palm <= step.model <= 1.02 * palm
    assert step.hardware == step.model


def test_a_mixture_of_experts_counts_its_active_experts_as_model_flops():
    """The MoE LM (block1: 8 experts of half the dense width, top-2) needs the dense LM's
    model FLOPs plus its router's: the dispatch and combine einsums and the experts'
    empty capacity slots are hardware FLOPs only."""
    import model_registry
    dense, moe = (model_registry.get_params(f'lm.pystdlib.Tiny{kind}TransformerLM')
                  .task.pipeline.body for kind in ('', 'MoE'))
    steps = [flops.step_flops(body, [len(body)], 'never', _lm_shapes())
             for body in (dense, moe)]
    block = [p for p in moe if 'num_experts' in p][0]
    router = 2 * B * T * block.model_dim * block.num_experts
    assert steps[1].model == steps[0].model + 3 * router
    assert steps[0].hardware == steps[0].model
    assert steps[1].hardware > 1.2 * steps[1].model  # what the implementation adds


@pytest.mark.parametrize('recompute, balance, recomputed_cells', [
    ('always', [3, 3], [0, 1]), ('except_last', [3, 3], [0]), ('never', [3, 3], []),
    ('except_last', [2, 4], [0])])
def test_hardware_flops_add_one_forward_of_each_recomputing_cell(recompute, balance,
                                                                 recomputed_cells):
    widths = [8, 16, 32, 16, 8, 4, 2]
    body = [layers.Dense.Params().Set(name=f'fc{i}', input_dim=widths[i],
                                      output_dim=widths[i + 1]) for i in range(6)]
    step = flops.step_flops(body, balance, recompute, tf.TensorShape([10, 8]))
    forward = [2 * 10 * widths[i] * widths[i + 1] for i in range(6)]
    assert step.model == 3 * sum(forward)
    starts = [0, balance[0]]
    again = sum(sum(forward[starts[k]:starts[k] + balance[k]]) for k in recomputed_cells)
    assert step.hardware == step.model + again


def test_a_layer_without_its_flops_is_named():
    class Opaque(layers.Dense):
        @classmethod
        def FPropMeta(cls, p, x_shape):
            return super(layers.Dense, cls).FPropMeta(p, x_shape)

    body = [Opaque.Params().Set(name='opaque', input_dim=4, output_dim=4)]
    with pytest.raises(NotImplementedError, match='Opaque'):
        flops.step_flops(body, [1], 'always', tf.TensorShape([2, 4]))


def test_the_progress_line_gives_the_rate_in_its_unit_and_both_utilisations():
    step = flops.StepFlops(model=1e9, hardware=4e9 / 3)
    lm = Throughput('tokens', 2048, step, peak=1e10)
    assert lm.line(2.0) == '4096 tokens/s  MFU 20.0%  HFU 26.7%'
    assert lm.scalars(2.0) == pytest.approx({'tokens_per_sec': 4096, 'mfu': 0.2,
                                             'hfu': 0.2 + 0.2 / 3})
    unknown = Throughput('examples', 16, None, None)
    assert unknown.line(0.5) == '8.0 examples/s'
    assert unknown.scalars(0.5) == {'examples_per_sec': 8.0}


def test_the_peak_is_measured_once_and_then_read_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(peak_flops, 'host_load', lambda: 0.1)
    path = str(tmp_path / 'peak_flops.json')
    first = peak_flops.cached_peak('CPU', tf.float32, path)
    assert first.measured_now and first.flops > 1e8  # any CPU running TensorFlow does that
    again = peak_flops.cached_peak('CPU', tf.float32, path)
    assert (again.flops, again.measured_now, again.load) == (first.flops, False, 0.1)
    with open(path) as f:
        assert json.load(f) == {peak_flops.machine_key('CPU', tf.float32): {
            'flops': first.flops, 'load': 0.1}}


def test_a_peak_probed_on_a_busy_host_is_probed_again_when_it_is_quieter(tmp_path,
                                                                         monkeypatch):
    path = tmp_path / 'peak_flops.json'
    key = peak_flops.machine_key('CPU', tf.float32)
    path.write_text(json.dumps({key: {'flops': 1.0, 'load': 6.0}}))  # 1 FLOP/s, busy
    monkeypatch.setattr(peak_flops, 'host_load', lambda: 4.0)  # not half as busy
    assert peak_flops.cached_peak('CPU', tf.float32, str(path)) == peak_flops.Peak(
        1.0, False, 6.0)
    monkeypatch.setattr(peak_flops, 'host_load', lambda: 2.5)
    quieter = peak_flops.cached_peak('CPU', tf.float32, str(path))
    assert quieter.measured_now and quieter.flops > 1e8 and quieter.load == 2.5
    # A quiet entry is kept whatever the load now, and the highest figure wins.
    path.write_text(json.dumps({key: {'flops': 1e15, 'load': 0.2}}))
    monkeypatch.setattr(peak_flops, 'host_load', lambda: 0.0)
    assert peak_flops.cached_peak('CPU', tf.float32, str(path)).flops == 1e15


def test_a_cached_peak_is_per_dtype_and_a_corrupt_cache_is_measured_again(tmp_path):
    path = tmp_path / 'peak_flops.json'
    key = peak_flops.machine_key('CPU', tf.float32)
    assert peak_flops.machine_key('CPU', tf.bfloat16) != key
    path.write_text('{"half a file')
    peak = peak_flops.cached_peak('CPU', tf.float32, str(path))
    assert peak.measured_now
    assert json.loads(path.read_text())[key]['flops'] == peak.flops


def test_the_cache_lives_under_tfpipe_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv(peak_flops.CACHE_ENV, str(tmp_path))
    assert peak_flops.cache_path() == str(tmp_path / 'peak_flops.json')
    monkeypatch.delenv(peak_flops.CACHE_ENV)
    monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path / 'xdg'))
    assert peak_flops.cache_path() == str(tmp_path / 'xdg' / 'tfpipe' / 'peak_flops.json')


def test_a_given_peak_wins_over_the_probe_and_a_bad_one_is_refused(tmp_path, monkeypatch):
    import tfpipe
    from trainer import runtime_options, throughput
    monkeypatch.setenv(peak_flops.CACHE_ENV, str(tmp_path))
    body = [layers.Dense.Params().Set(name=f'fc{i}', input_dim=8, output_dim=8)
            for i in range(4)]
    pipe = tfpipe.PipeliningLayer.Params().Set(name='pipe', body=body, balance=[2, 2],
                                               num_micro_batches=2).Instantiate()
    x = tf.zeros([6, 8])
    got = throughput.measure_for(pipe, x, 'examples', 6, 5e9, 'CPU', 2)
    assert got.peak == 5e9
    assert got.step_flops == flops.step_flops(body, [2, 2], 'always', tf.TensorShape([6, 8]))
    assert not (tmp_path / 'peak_flops.json').exists()  # nothing probed
    with pytest.raises(ValueError, match=r'trainer.peak_flops=0 must be a positive number '
                                         r'of FLOP/s'):
        runtime_options.RuntimeOptions(peak_flops=0)


PROBE_LEAVES_THE_PEAK = r'''
import sys
import tfpipe  # before TensorFlow: the BFC allocator, which keeps statistics
import tensorflow as tf
from tfpipe import memory_stats
from tfpipe.tuning import peak_flops
held = tf.ones([4 * 2 ** 20])  # 16 MiB the run holds
before = memory_stats.peak_bytes(['/CPU:0'])['CPU:0']
assert peak_flops.cached_peak('CPU', tf.float32, sys.argv[1]).measured_now
after = memory_stats.peak_bytes(['/CPU:0'])['CPU:0']
peak_flops.measure('/CPU:0', tf.float32, parallel=2)  # the same probe, counted
counted = int(tf.config.experimental.get_memory_info('CPU:0')['peak'])
print(before, after, counted)
'''


def test_the_probe_is_not_the_runs_measured_peak(tmp_path):
    """The trainer probes the peak FLOP/s in its own process; its matrices (64 MiB on 2
    cores) must not become the peak its progress lines report, nor hide the run's."""
    done = subprocess.run([sys.executable, '-c', PROBE_LEAVES_THE_PEAK,
                           str(tmp_path / 'peak.json')], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, PYTHONPATH=th.REPO,
                                                       TF_CPU_ALLOCATOR_USE_BFC='true'))
    assert done.returncode == 0, done.stderr[-2000:]
    before, after, counted = map(int, done.stdout.split()[-3:])
    mib = 2 ** 20
    # After the probe: the run's peak, and a few bytes the probe's function keeps.
    assert 16 * mib <= before <= after < before + mib, (before, after)
    assert counted > after + 32 * mib, (after, counted)  # the probe, had it been counted


def test_a_run_faster_than_the_peak_raises_it_and_caches_the_rate(tmp_path, monkeypatch):
    """A peak probed on a busy host reads low (here: MFU 114%, HFU 152%); a run computing
    faster proves it, so its rate becomes the peak (HFU 100%) and the cache learns it."""
    monkeypatch.setattr(peak_flops, 'host_load', lambda: 0.9)
    path = str(tmp_path / 'peak.json')
    key = peak_flops.machine_key('CPU', tf.float32)
    with open(path, 'w') as f:
        json.dump({key: {'flops': 1e10, 'load': 1.7}}, f)
    seen = []
    step = flops.StepFlops(model=1.5e10, hardware=2e10)
    run = Throughput('tokens', 2048, step, peak=1e10, record=seen.append)
    assert run.scalars(0.25) == pytest.approx({'tokens_per_sec': 512, 'mfu': 0.375,
                                               'hfu': 0.5})  # under the peak: unchanged
    assert run.scalars(1.0) == pytest.approx({'tokens_per_sec': 2048, 'mfu': 0.75,
                                              'hfu': 1.0})
    assert run.peak == 2e10 and seen == [2e10]
    assert run.line(0.5) == '1024 tokens/s  MFU 37.5%  HFU 50.0%'  # over the raised peak
    peak_flops.raise_cached(2e10, 'CPU', tf.float32, path)
    peak_flops.raise_cached(1.5e10, 'CPU', tf.float32, path)  # lower: kept out
    with open(path) as f:
        assert json.load(f) == {key: {'flops': 2e10, 'load': 1.7}}  # the probe's load kept
