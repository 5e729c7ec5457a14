"""Standard pipelinable bodies: lists of layer params for a PipeliningLayer.

The GPipe paper's two workloads, sized by arguments: an AmoebaNet-style image
network and a decoder-only Transformer (also over packed documents, for
language models).
"""
from __future__ import annotations

from tfpipe import layers
from tfpipe.hyperparams import Params


def amoebanet_body(num_classes: int, image_channels: int = 3, filters: int = 16,
                   cells_per_stage: int = 1, num_stages: int = 3) -> list[Params]:
    """Stem conv, then per stage `cells_per_stage` normal cells and a reduction
    cell doubling the filters (none after the last stage), then pooling and logits."""
    body = [layers.Conv2D.Params().Set(name='stem', filter_shape=(3, 3, image_channels, filters),
                                       use_bias=False),
            layers.BatchNorm.Params().Set(name='stem_bn', dim=filters)]
    prev, cur, index = filters, filters, 0
    for stage in range(num_stages):
        for _ in range(cells_per_stage):
            body.append(layers.AmoebaCell.Params().Set(
                name=f'cell{index}', input_channels=cur, prev_channels=prev, filters=cur))
            prev, index = cur, index + 1
        if stage + 1 < num_stages:
            body.append(layers.AmoebaCell.Params().Set(
                name=f'cell{index}', input_channels=cur, prev_channels=prev, filters=2 * cur,
                reduction=True))
            prev, cur, index = cur, 2 * cur, index + 1
    body += [layers.DropSkips.Params().Set(name='drop_skips'),
             layers.GlobalAvgPool.Params().Set(name='pool'),
             layers.Dense.Params().Set(name='logits', input_dim=cur, output_dim=num_classes)]
    return body


# The pipeline's `tied_weights` for a `transformer_body(..., tied_softmax=True)`: the
# softmax projection reads the input embedding, as in Lingvo's and Vaswani et al.'s models.
TRANSFORMER_TIES = {'logits/w': 'embedding/emb'}


def transformer_body(vocab_size: int, max_length: int, model_dim: int, hidden_dim: int,
                     num_heads: int, num_blocks: int, dropout_keep_prob: float = 1.0,
                     tied_softmax: bool = False) -> list[Params]:
    """Embedding + positions, `num_blocks` causal blocks, final LayerNorm, logits.

    Under a pipeline with tensor_parallel=T > 1 the same params build Megatron's
    forms: the embedding and the logits split the vocabulary, each block its heads
    and feed-forward hidden layer (docs/tensor_parallel.md); the logits then come
    out as T vocabulary shards (layers.VocabLogits).

    tied_softmax: lay the logits' weight out like the embedding table
    ([vocab, model_dim]) so the pipeline can tie them with TRANSFORMER_TIES.
    """
    body = [layers.Embedding.Params().Set(name='embedding', vocab_size=vocab_size,
                                          embedding_dim=model_dim, scale_sqrt_depth=True),
            layers.PositionEmbedding.Params().Set(name='position', max_length=max_length,
                                                  embedding_dim=model_dim)]
    body += [layers.TransformerBlock.Params().Set(
        name=f'block{i}', model_dim=model_dim, hidden_dim=hidden_dim, num_heads=num_heads,
        causal=True, residual_dropout_keep_prob=dropout_keep_prob) for i in range(num_blocks)]
    body += [layers.LayerNorm.Params().Set(name='final_ln', dim=model_dim),
             layers.VocabLogits.Params().Set(name='logits', input_dim=model_dim,
                                             vocab_size=vocab_size,
                                             weight_layout='oi' if tied_softmax else 'io')]
    return body


def transformer_lm_body(vocab_size: int, max_length: int, model_dim: int, hidden_dim: int,
                        num_heads: int, num_blocks: int, dropout_keep_prob: float = 1.0,
                        tied_softmax: bool = True) -> list[Params]:
    """`transformer_body` over packed sequences, for `tfpipe.tasks.lm.LanguageModel`.

    The activation carries segment ids and positions beside the embeddings (see
    layers.PackedTransformerBlock) until `unpack` drops them before the final
    LayerNorm. Tied by default: pass TRANSFORMER_TIES as the pipeline's tied_weights.
    """
    body = transformer_body(vocab_size, max_length, model_dim, hidden_dim, num_heads,
                            num_blocks, dropout_keep_prob, tied_softmax)
    body[1] = layers.PackedPositionEmbedding.Params().Set(
        name='position', max_length=max_length, embedding_dim=model_dim)
    body[2:2 + num_blocks] = [layers.PackedTransformerBlock.Params().Set(
        name=f'block{i}', model_dim=model_dim, hidden_dim=hidden_dim, num_heads=num_heads,
        residual_dropout_keep_prob=dropout_keep_prob) for i in range(num_blocks)]
    body.insert(2 + num_blocks, layers.DropSkips.Params().Set(name='unpack'))
    return body
