"""tfpipe.keras starts the optimizer's update only once every gradient is summed.

On logical CPUs, which share one allocator, an update that starts while earlier
cells still run their backward stacks its temporaries on their working sets, and
the fit's peak then depends on the threads' timing (tfpipe/keras.py,
`_once_all_summed`; the predicted peak, tests/test_memory_prediction.py).
"""
import keras
import numpy as np
import tensorflow as tf

import tfpipe.keras as tk


def test_no_update_op_reads_a_gradient_before_every_gradient_is_summed():
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation='relu'),
                              keras.layers.Dense(16, activation='relu'), keras.layers.Dense(3)])
    pipe = tk.pipeline(model, balance=[2, 1], num_micro_batches=2)
    pipe.compile(optimizer=keras.optimizers.Adam(0.01),
                 loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = tf.constant(np.ones((8, 6), np.float32))
    y = tf.constant(np.zeros(8, np.int64))
    pipe.optimizer.build(pipe.trainable_variables)
    graph = tf.function(pipe.train_step).get_concrete_function((x, y)).graph

    gates = [op for op in graph.get_operations()
             if 'all_gradients_summed' in op.name and op.type == 'Identity']
    assert len(gates) == len(pipe.trainable_variables) == 6
    summed = {op.inputs[0].op for op in gates}  # each weight's gradient sum
    assert len(summed) == 6
    for gate in gates:
        waits_for = set(gate.control_inputs) | {gate.inputs[0].op}
        assert summed <= waits_for, gate.name  # all six
        assert gate.device == gate.inputs[0].device, gate.name  # on the gradient's device
    for grad in summed:  # nothing but the gates reads a gradient sum
        readers = {c for out in grad.outputs for c in out.consumers()}
        assert readers <= set(gates), (grad.name, sorted(r.name for r in readers - set(gates)))
