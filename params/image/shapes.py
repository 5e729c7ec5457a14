"""Image classification of generated geometric shapes (no download)."""
from model_registry import RegisterSingleTaskModel
from tfpipe.bodies import amoebanet_body
from tfpipe import inputs, layers, lr_schedules, optimizers
from tfpipe.base_model_params import TfdsModelParams
from tfpipe.datasets import shapes
from tfpipe.layers.tensor_parallel_dense import (ColumnParallelDense, ParallelMLP,
                                                 RowParallelDense)
from tfpipe.pipeline.pipelining_layer import PipeliningLayer
from tfpipe.tasks.classifier import ImageClassifier


@RegisterSingleTaskModel
class AmoebaNetPipe(TfdsModelParams):
    """A small AmoebaNet on tfpipe_shapes: K=4 cells, M=4 micro-batches, recompute."""

    BATCH_SIZE = 32

    def InputParams(self, tfds_split, training):
        return inputs.TfdsInput.Params().Set(
            dataset='tfpipe_shapes', split=tfds_split, batch_size=self.BATCH_SIZE,
            preprocess='image_classification', shuffle_buffer=2048 if training else 0,
            repeat=training)

    def Task(self):
        p = ImageClassifier.Params().Set(num_classes=len(shapes.CLASS_NAMES))
        p.pipeline = PipeliningLayer.Params().Set(
            name='pipe', body=amoebanet_body(len(shapes.CLASS_NAMES)), num_cells=4,
            partition_by='flops', input_shape=[self.BATCH_SIZE, shapes.IMAGE_SIZE,
                                               shapes.IMAGE_SIZE, shapes.NUM_CHANNELS],
            num_micro_batches=4, recompute='always')
        p.train.Set(max_steps=1000, learning_rate=0.003, save_interval_steps=250,
                    summary_interval_steps=50)
        p.train.optimizer = optimizers.Adam.Params()
        p.train.lr_schedule = lr_schedules.Cosine.Params().Set(  # decays over max_steps
            value=1.0, warmup_steps=50, min_value=0.0)
        p.eval.Set(samples_per_summary=1024, decoder_samples_per_summary=256)
        return p


@RegisterSingleTaskModel
class SmallConvPipe(AmoebaNetPipe):
    """A plain conv net on tfpipe_shapes, K=2, M=2: the fastest model to try things on."""

    BATCH_SIZE = 16

    def Task(self):
        p = super().Task()
        body = [
            layers.Conv2D.Params().Set(name='conv0', filter_shape=(3, 3, 3, 8),
                                       activation='relu'),
            layers.Pooling2D.Params().Set(name='pool0'),
            layers.Conv2D.Params().Set(name='conv1', filter_shape=(3, 3, 8, 16),
                                       activation='relu'),
            layers.GlobalAvgPool.Params().Set(name='pool1'),
            layers.Dense.Params().Set(name='logits', input_dim=16,
                                      output_dim=len(shapes.CLASS_NAMES)),
        ]
        p.pipeline = PipeliningLayer.Params().Set(name='pipe', body=body, balance=[3, 2],
                                                  num_micro_batches=2, recompute='always')
        p.train.Set(max_steps=200, learning_rate=0.01, save_interval_steps=50)
        p.eval.Set(samples_per_summary=256, decoder_samples_per_summary=64)
        return p


@RegisterSingleTaskModel
class TensorParallelMLP(SmallConvPipe):
    """An MLP of Megatron's tensor-parallel layers on tfpipe_shapes, K=2, M=2.

    T=1 by default (2 devices); `--params_override=task.pipeline.tensor_parallel=2` splits
    each cell over 2 devices (4 in all), the same model and checkpoints (docs/tensor_parallel.md).
    """

    HIDDEN = 256

    def Task(self):
        p = super().Task()
        pixels = shapes.IMAGE_SIZE * shapes.IMAGE_SIZE * shapes.NUM_CHANNELS
        width = 64
        body = [
            layers.Flatten.Params().Set(name='flatten'),
            ColumnParallelDense.Params().Set(name='embed', input_dim=pixels, output_dim=width,
                                             activation='relu'),
            ParallelMLP.Params().Set(name='mlp0', input_dim=width, hidden_dim=self.HIDDEN,
                                     keep_prob=0.9),
            layers.LayerNorm.Params().Set(name='norm', dim=width),
            ParallelMLP.Params().Set(name='mlp1', input_dim=width, hidden_dim=self.HIDDEN,
                                     keep_prob=0.9),
            RowParallelDense.Params().Set(name='logits', input_dim=width,
                                          output_dim=len(shapes.CLASS_NAMES)),
        ]
        p.pipeline = PipeliningLayer.Params().Set(name='pipe', body=body, balance=[3, 3],
                                                  num_micro_batches=2, recompute='always')
        p.train.Set(learning_rate=0.003)
        return p
