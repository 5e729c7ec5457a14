"""Byte-level language models of the Python standard library's source (no download)."""
from model_registry import RegisterSingleTaskModel
from tfpipe import inputs, layers, lr_schedules, optimizers
from tfpipe.base_model_params import TfdsModelParams
from tfpipe.bodies import TRANSFORMER_TIES, transformer_lm_body
from tfpipe.hyperparams import Params
from tfpipe.pipeline.pipelining_layer import PipeliningLayer
from tfpipe.tasks.lm import LanguageModel


@RegisterSingleTaskModel
class TransformerLM(TfdsModelParams):
    """4 causal blocks of width 64 as K=2 cells, M=4 micro-batches, rows of 128 bytes,
    softmax tied to the embedding; sized so its default run takes minutes on 2 cores."""

    BATCH_SIZE = 16
    SEQUENCE_LENGTH = 128
    # model_dim, hidden_dim, num_heads, num_blocks
    SIZES = (64, 256, 4, 4)
    BALANCE = [4, 5]
    MAX_STEPS = 1000
    TFDS_SPLITS = {'train': 'train', 'dev': 'dev', 'test': 'test'}  # pystdlib's split names

    def InputParams(self, split, training):
        return inputs.DatasetInput.Params().Set(
            examples_fn='tfpipe.datasets.pystdlib.documents', split=split, preprocess='lm',
            batch_size=self.BATCH_SIZE, max_length=self.SEQUENCE_LENGTH,
            shuffle_buffer=4096 if training else 0, repeat=training)

    def Task(self):
        p = LanguageModel.Params().Set(vocab_size=inputs.BYTE_VOCAB_SIZE)
        model_dim, hidden_dim, num_heads, num_blocks = self.SIZES
        p.pipeline = PipeliningLayer.Params().Set(
            name='pipe', body=transformer_lm_body(inputs.BYTE_VOCAB_SIZE, self.SEQUENCE_LENGTH,
                                                  model_dim, hidden_dim, num_heads, num_blocks),
            balance=self.BALANCE, num_micro_batches=4, recompute='always',
            tied_weights=dict(TRANSFORMER_TIES))
        p.train.Set(max_steps=self.MAX_STEPS, learning_rate=0.003,
                    clip_gradient_norm_to_value=1.0, save_interval_steps=500,
                    summary_interval_steps=50)
        p.train.optimizer = optimizers.Adam.Params()
        p.train.lr_schedule = lr_schedules.LinearWarmupRsqrtDecay.Params().Set(
            value=1.0, warmup_steps=200)
        p.eval.Set(samples_per_summary=1024, decoder_samples_per_summary=8)
        p.decoder.Set(prompt_length=64, num_new_tokens=64)
        return p


@RegisterSingleTaskModel
class TinyTransformerLM(TransformerLM):
    """2 blocks of width 32 on rows of 64 bytes, K=2, M=2: the fastest LM to try things on."""

    BATCH_SIZE = 16
    SEQUENCE_LENGTH = 64
    SIZES = (32, 128, 2, 2)
    BALANCE = [3, 4]
    MAX_STEPS = 300

    def Task(self):
        p = super().Task()
        p.pipeline.num_micro_batches = 2
        p.train.Set(learning_rate=0.01, save_interval_steps=100)
        p.train.lr_schedule.warmup_steps = 50
        p.eval.Set(samples_per_summary=256, decoder_samples_per_summary=4)
        p.decoder.Set(prompt_length=16, num_new_tokens=16)
        return p


@RegisterSingleTaskModel
class GPT2SmallShapedLM(TransformerLM):
    """GPT-2 small's shape (12 blocks of width 768, 12 heads, feed-forward 3072) over
    bytes: 85.4M parameters (GPT-2's 124M less most of its 50k-token embedding), rows of 256
    bytes, batch 8 as K=4 cells of 3 blocks, M=4, recompute always. The size tfpipe
    exists for: about 1.4 GB of weights and Adam slots, a step of about 1.1 TFLOP. Its
    default is a short run (20 steps, minutes on 2 cores), to measure and to try
    layouts on; raise --max_steps to train it."""

    BATCH_SIZE = 8
    SEQUENCE_LENGTH = 256
    SIZES = (768, 3072, 12, 12)
    BALANCE = [5, 3, 3, 6]  # embedding, positions and 3 blocks; 3; 3; 3 and the head
    MAX_STEPS = 20

    def Task(self):
        p = super().Task()
        p.train.Set(learning_rate=0.001, save_interval_steps=10, summary_interval_steps=2)
        p.train.lr_schedule.warmup_steps = 10
        p.eval.Set(samples_per_summary=64, decoder_samples_per_summary=2)
        p.decoder.Set(prompt_length=32, num_new_tokens=32)
        return p


@RegisterSingleTaskModel
class GPT2MediumShapedLM(GPT2SmallShapedLM):
    """GPT-2 medium's shape (24 blocks of width 1024, 16 heads, feed-forward 4096) over
    bytes: 303M parameters, K=4 cells of 6 blocks; otherwise as GPT2SmallShapedLM."""

    SIZES = (1024, 4096, 16, 24)
    BALANCE = [8, 6, 6, 9]


def moe_feed_forwards(task: Params, num_experts: int = 8) -> Params:
    """`task` with every other block (block1, block3, ...) a PackedMoETransformerBlock of
    `num_experts` experts, top-2, each expert half the dense hidden width: a token's two
    experts cost the dense feed-forward's FLOPs (GShard, Switch Transformer).

    Evaluation and decoding never drop a token: eval_capacity_factor = E / top_k gives
    every expert a slot for every token of the call (C = S), in the evaler's FProp and
    in each KV-cached generation step alike. Training keeps GShard's capacity factor 2.
    """
    body = task.pipeline.body
    for i, block in enumerate(body):
        if block.name.startswith('block') and int(block.name[len('block'):]) % 2 == 1:
            body[i] = layers.PackedMoETransformerBlock.Params().Set(
                name=block.name, model_dim=block.model_dim, hidden_dim=block.hidden_dim // 2,
                num_heads=block.num_heads,
                residual_dropout_keep_prob=block.residual_dropout_keep_prob,
                num_experts=num_experts, top_k=2, eval_capacity_factor=num_experts / 2)
    return task


@RegisterSingleTaskModel
class MoETransformerLM(TransformerLM):
    """TransformerLM with blocks 1 and 3 mixtures of 8 experts (top-2, each expert 128
    wide): the dense model's active FLOPs per token, 4x its feed-forward weights there."""

    def Task(self):
        return moe_feed_forwards(super().Task())


@RegisterSingleTaskModel
class TinyMoETransformerLM(TinyTransformerLM):
    """TinyTransformerLM with block1 a mixture of 8 experts (top-2, each 64 wide): for tests."""

    def Task(self):
        return moe_feed_forwards(super().Task())
