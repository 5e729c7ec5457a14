"""Translate token sequences into their reverse (generated data, no download)."""
from model_registry import RegisterSingleTaskModel
from tfpipe.bodies import TRANSFORMER_TIES, transformer_body
from tfpipe import inputs, lr_schedules, optimizers
from tfpipe.base_model_params import TfdsModelParams
from tfpipe.datasets import reverse
from tfpipe.pipeline.pipelining_layer import PipeliningLayer
from tfpipe.tasks.seq2seq import Seq2SeqTask

MAX_LENGTH = reverse.MAX_SOURCE_LENGTH + 1  # room for EOS


@RegisterSingleTaskModel
class TransformerPipe(TfdsModelParams):
    """4 causal Transformer blocks as K=2 cells, M=4 micro-batches; the softmax
    (cell 1) is tied to the input embedding (cell 0)."""

    BATCH_SIZE = 32

    def InputParams(self, tfds_split, training):
        return inputs.TfdsInput.Params().Set(
            dataset='tfpipe_reverse', split=tfds_split, batch_size=self.BATCH_SIZE,
            preprocess='seq2seq', max_length=MAX_LENGTH, shuffle_buffer=4096 if training else 0,
            repeat=training)

    def Task(self):
        p = Seq2SeqTask.Params().Set(vocab_size=reverse.VOCAB_SIZE, pad_id=reverse.PAD_ID,
                                     eos_id=reverse.EOS_ID)
        p.pipeline = PipeliningLayer.Params().Set(
            name='pipe', body=transformer_body(reverse.VOCAB_SIZE, 2 * MAX_LENGTH, 64, 128, 4, 4,
                                               tied_softmax=True),
            balance=[4, 4], num_micro_batches=4, recompute='always',
            tied_weights=dict(TRANSFORMER_TIES))
        p.train.Set(max_steps=1500, learning_rate=0.003, clip_gradient_norm_to_value=1.0,
                    save_interval_steps=250, summary_interval_steps=50)
        p.train.optimizer = optimizers.Adam.Params()
        p.train.lr_schedule = lr_schedules.LinearWarmupRsqrtDecay.Params().Set(
            value=1.0, warmup_steps=200)
        p.eval.Set(samples_per_summary=1000, decoder_samples_per_summary=128)
        return p
