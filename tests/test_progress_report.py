"""The trainer's progress line and TensorBoard scalars (trainer/progress_report.py) with
a body's auxiliary losses and routing statistics, taken from a real pipelined step."""
import glob
import logging
import os

import numpy as np
import tensorflow as tf

import tfpipe
from tests import model_zoo as mz
from tfpipe import fprop_context, layers
from trainer import progress_report
from trainer.throughput import Progress, Throughput


def step_records():
    """{**metrics, **statistics} of one ForwardBackward of Dense + MoE + Dense, K=2, M=2."""
    body = [layers.Dense.Params().Set(name='fc0', input_dim=6, output_dim=8, activation='tanh'),
            layers.MoEFeedForward.Params().Set(name='moe', model_dim=8, hidden_dim=6,
                                               num_experts=4, capacity_factor=0.5),
            layers.Dense.Params().Set(name='fc2', input_dim=8, output_dim=5)]
    pipe = tfpipe.PipeliningLayer.Params().Set(name='pipe', body=body, balance=[1, 2],
                                               num_micro_batches=2).Instantiate()
    x, y = tf.random.stateless_normal([8, 6], [1, 2]), tf.zeros([8], tf.int32)
    sink = fprop_context.AuxLossSink()
    with fprop_context.training(step=0), fprop_context.scope(aux_losses=sink):
        loss, _ = pipe.ForwardBackward(pipe.theta, x, mz.loss_fn, y)
    return float(loss), {n: v.numpy() for n, v in {**sink.metrics(),
                                                    **sink.statistics()}.items()}


def report(tmp_path, caplog, losses):
    writer = tf.summary.create_file_writer(str(tmp_path))
    progress = Progress(10, 0.0)
    progress.step_done(1, 1.0)
    # absl's own logger: a test that parsed the trainer's flags in this process has set its
    # level from absl's --verbosity default (WARNING), which the root logger's level does
    # not override.
    with caplog.at_level(logging.INFO, logger='absl'):
        progress_report.report(writer, progress, Throughput('examples', 8, None, None), 1, 10,
                               8, losses, 0.5, 0.1)
    writer.flush()
    events = {}
    for path in glob.glob(os.path.join(str(tmp_path), 'events.out.tfevents.*')):
        for event in tf.compat.v1.train.summary_iterator(path):
            for v in event.summary.value:
                events[v.tag] = v
    return [r.getMessage() for r in caplog.records if 'step 1/10' in r.getMessage()][-1], events


def test_line_and_summaries_show_the_aux_losses_and_routing(tmp_path, caplog):
    loss, aux = step_records()
    assert 0 < aux['dropped_fraction'] < 1  # capacity 0.5 drops some choices
    np.testing.assert_allclose(aux['expert_load/pipe/moe'].sum(), 1.0, rtol=1e-6)
    line, events = report(tmp_path, caplog, {'loss': loss, **aux})
    assert line.startswith(f'step 1/10  loss {loss:.4f}  aux_loss {aux["aux_loss"]:.4f}  ')
    for name in ('load_balancing_loss', 'dropped_fraction'):
        assert f'{name} {aux[name]:.4f}' in line
    assert '/pipe/moe' not in line  # per-layer records: TensorBoard only
    for name in ('loss', 'aux_loss', 'dropped_fraction', 'dropped_fraction/pipe/moe',
                 'load_balancing_loss/pipe/moe'):
        assert float(tf.make_ndarray(events[name].tensor)) == float(
            loss if name == 'loss' else aux[name])
    load = events['expert_load/pipe/moe'].metadata.plugin_data.plugin_name
    assert load == 'histograms'


def test_body_without_aux_losses_keeps_the_line(tmp_path, caplog):
    line, events = report(tmp_path, caplog, {'loss': 0.25})
    assert line.startswith('step 1/10  loss 0.2500  lr 0.1  grad_norm 0.5')
    assert 'aux_loss' not in events
