"""tfpipe layers: every class here has `Params()` and functional `FProp(theta, ...)`."""
from tfpipe.layers.amoeba import AmoebaCell
from tfpipe.layers.attention import MultiHeadAttention, PackedTransformerBlock, TransformerBlock
from tfpipe.layers.composite import DropSkips, Pop, Residual, Sequential, Stash
from tfpipe.layers.conv import Conv2D, Flatten, GlobalAvgPool, Pooling2D
from tfpipe.layers.dense import Dense, Projection
from tfpipe.layers.dropout import Dropout
from tfpipe.layers.embedding import Embedding, PackedPositionEmbedding, PositionEmbedding
from tfpipe.layers.mixture_of_experts import MoEFeedForward
from tfpipe.layers.moe_block import PackedMoETransformerBlock
from tfpipe.layers.normalization import BatchNorm, LayerNorm
from tfpipe.layers.vocab_parallel import VocabLogits

__all__ = ['AmoebaCell', 'BatchNorm', 'Conv2D', 'Dense', 'DropSkips', 'Dropout', 'Embedding',
           'Flatten', 'GlobalAvgPool', 'LayerNorm', 'MoEFeedForward', 'MultiHeadAttention',
           'PackedMoETransformerBlock', 'PackedPositionEmbedding', 'PackedTransformerBlock',
           'Pooling2D', 'Pop',
           'PositionEmbedding', 'Projection', 'Residual', 'Sequential', 'Stash',
           'TransformerBlock', 'VocabLogits']
