"""AmoebaNet on CIFAR-10 (needs the tfds data in --tfds_data_dir)."""
from model_registry import RegisterSingleTaskModel
from tfpipe.bodies import amoebanet_body
from tfpipe import inputs, lr_schedules, optimizers
from tfpipe.base_model_params import TfdsModelParams
from tfpipe.pipeline.pipelining_layer import PipeliningLayer
from tfpipe.tasks.classifier import ImageClassifier


@RegisterSingleTaskModel
class AmoebaNetD(TfdsModelParams):
    """AmoebaNet-D-style body, 6 cells per stage, K=4, M=8, RMSProp as in GPipe."""

    BATCH_SIZE = 128

    TFDS_SPLITS = {'train': 'train', 'test': 'test'}  # CIFAR-10 has no validation split

    def InputParams(self, tfds_split, training):
        return inputs.TfdsInput.Params().Set(
            dataset='cifar10', split=tfds_split, batch_size=self.BATCH_SIZE,
            preprocess='image_classification', shuffle_buffer=10000 if training else 0,
            repeat=training)

    def Task(self):
        p = ImageClassifier.Params().Set(num_classes=10)
        p.pipeline = PipeliningLayer.Params().Set(
            name='pipe', body=amoebanet_body(10, filters=64, cells_per_stage=6), num_cells=4,
            partition_by='flops', input_shape=[self.BATCH_SIZE, 32, 32, 3],
            num_micro_batches=8, recompute='always')
        p.train.Set(max_steps=50000, learning_rate=0.05, clip_gradient_norm_to_value=5.0,
                    save_interval_steps=1000, summary_interval_steps=100)
        p.train.optimizer = optimizers.RMSProp.Params()
        p.train.lr_schedule = lr_schedules.Cosine.Params().Set(  # decays over max_steps
            value=1.0, warmup_steps=1000, min_value=0.0)
        p.eval.Set(samples_per_summary=10000, decoder_samples_per_summary=1000)
        return p
