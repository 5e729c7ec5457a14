"""English to German on WMT'14 (needs the tfds data in --tfds_data_dir), byte level."""
from model_registry import RegisterSingleTaskModel
from tfpipe.bodies import TRANSFORMER_TIES, transformer_body
from tfpipe import inputs, lr_schedules, optimizers
from tfpipe.base_model_params import TfdsModelParams
from tfpipe.pipeline.pipelining_layer import PipeliningLayer
from tfpipe.tasks.seq2seq import Seq2SeqTask

BYTE_VOCAB = 258  # UTF-8 bytes + PAD + EOS (see tfpipe.inputs)
MAX_LENGTH = 128


@RegisterSingleTaskModel
class TransformerPipe(TfdsModelParams):
    """12 Transformer blocks as K=4 cells, M=8, linear warmup + rsqrt decay; the softmax
    is tied to the input embedding across the pipeline."""

    BATCH_SIZE = 64

    def InputParams(self, tfds_split, training):
        return inputs.TfdsInput.Params().Set(
            dataset='wmt14_translate/de-en', split=tfds_split, batch_size=self.BATCH_SIZE,
            preprocess='seq2seq_text', source_key='en', target_key='de',
            max_length=MAX_LENGTH, shuffle_buffer=100000 if training else 0, repeat=training)

    def Task(self):
        p = Seq2SeqTask.Params().Set(vocab_size=BYTE_VOCAB, pad_id=0, eos_id=1)
        p.pipeline = PipeliningLayer.Params().Set(
            name='pipe', body=transformer_body(BYTE_VOCAB, 2 * MAX_LENGTH, 512, 2048, 8, 12,
                                               dropout_keep_prob=0.9, tied_softmax=True),
            num_cells=4, num_micro_batches=8, recompute='always',
            tied_weights=dict(TRANSFORMER_TIES))
        p.train.Set(max_steps=300000, learning_rate=0.001, clip_gradient_norm_to_value=1.0,
                    save_interval_steps=2000, summary_interval_steps=100)
        p.train.optimizer = optimizers.Adam.Params()
        p.train.lr_schedule = lr_schedules.LinearWarmupRsqrtDecay.Params().Set(
            value=1.0, warmup_steps=4000)
        return p
