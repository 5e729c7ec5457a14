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
"""
from model_registry import RegisterSingleTaskModel
from params.image.shapes import SmallConvPipe
from tfpipe import layers, lr_schedules, optimizers


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
