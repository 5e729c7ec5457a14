"""SmallConvPipe with odd-sized variables: the sharded-slot tests' model.

Loaded by the trainer as `--model=tests.odd_sizes_model.SmallConvOddPipe`. Sharded
optimizer slots cut each flattened variable into R parts of ceil(n/R) elements, and only
a variable that R does not divide has a short last part, padded for the all-gather and cut
off again (tfpipe/pipeline/sharded_optimizer.py). Every variable of SmallConvPipe has an
even size, so two clients never exercise that padding; conv0's 7 filters make its kernel
(3*3*3*7 = 189) and bias (7) odd, and 3 clients divide neither.
"""
from model_registry import RegisterSingleTaskModel
from params.image.shapes import SmallConvPipe


@RegisterSingleTaskModel
class SmallConvOddPipe(SmallConvPipe):
    """conv0 (7 filters), pool0, conv1 | pool1, logits: K=2, M=2."""

    def Task(self):
        p = super().Task()
        body = list(p.pipeline.body)
        body[0] = body[0].Copy().Set(filter_shape=(3, 3, 3, 7))
        body[2] = body[2].Copy().Set(filter_shape=(3, 3, 7, 16))
        p.pipeline.body = body
        return p
