"""SmallConvPipe with BatchNorm and Dropout: the multi-client tests' model.

Loaded by the trainer as `--model=tests.clients_model.SmallConvBNPipe`. BatchNorm's
moving statistics and Dropout's masks are what a step split over clients could get
wrong (statistics combined across processes, masks by global example index), and
SmallConvPipe has neither; the built-in model with both (AmoebaNetPipe) takes ~40 s to
its first step on this machine.

It trains with SGD with momentum at a constant learning rate: Adam divides each update
by the gradient's own scale, so a cross-client sum off by a factor (halved, or not
summed) would still give the one-process weights; with momentum SGD every update is
linear in the gradient, and the momentum slot is optimizer state that a restart must
restore (tests/test_launcher.py compares it).

`SmallConvNoisePipe` trains on noise images from `noise_shapes`, whose input can be made
to hang in one client (STUCK_INPUT): a peer that is stuck but still answers.
"""
from model_registry import RegisterSingleTaskModel
from params.image.shapes import SmallConvPipe
from tfpipe import inputs, layers, lr_schedules, optimizers
from tfpipe.datasets import shapes


@RegisterSingleTaskModel
class SmallConvBNPipe(SmallConvPipe):
    """conv0, bn0 | conv1, drop, bn1, pool | logits: K=2, M=2."""

    def Task(self):
        p = super().Task()
        body = list(p.pipeline.body)
        body.insert(1, layers.BatchNorm.Params().Set(name='bn0', dim=8, decay=0.9))
        body.insert(4, layers.Dropout.Params().Set(name='drop', keep_prob=0.8))
        body.insert(5, layers.BatchNorm.Params().Set(name='bn1', dim=16, decay=0.9))
        p.pipeline.body = body
        p.pipeline.balance = [3, 5]
        p.train.learning_rate = 0.1
        p.train.optimizer = optimizers.SGD.Params().Set(momentum=0.9)
        p.train.lr_schedule = lr_schedules.Constant.Params()
        return p


# In a client whose environment sets it to 'N:PATH', the training input yields N examples
# and then waits forever to open PATH, a named pipe no one writes (a read hung on a stuck
# disk): that client still answers its peers, so they wait in the next step's collectives.
STUCK_INPUT = 'TFPIPE_TEST_STUCK_INPUT'


def noise_shapes(split: str):
    """tfpipe_shapes-sized noise images labelled by index; see STUCK_INPUT."""
    import os
    import tensorflow as tf
    size, channels, classes = shapes.IMAGE_SIZE, shapes.NUM_CHANNELS, len(shapes.CLASS_NAMES)

    def example(i):
        noise = tf.random.stateless_uniform([size, size, channels], seed=tf.stack([i, i]))
        return {'image': noise, 'label': tf.cast(i % classes, tf.int32)}
    examples = tf.data.Dataset.range(512).map(example)
    if not os.environ.get(STUCK_INPUT):
        return examples
    count, path = os.environ[STUCK_INPUT].split(':', 1)
    never = tf.data.TFRecordDataset(path).map(lambda _: example(tf.constant(0, tf.int64)))
    return examples.take(int(count)).concatenate(never)


@RegisterSingleTaskModel
class SmallConvNoisePipe(SmallConvPipe):
    """SmallConvPipe trained on `noise_shapes`, in order (no shuffle buffer reads ahead)."""

    def Train(self):
        return inputs.DatasetInput.Params().Set(
            examples_fn='tests.clients_model.noise_shapes', split='train',
            batch_size=self.BATCH_SIZE, repeat=True)
