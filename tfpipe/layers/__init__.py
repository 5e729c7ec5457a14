"""tfpipe layers: every class here has `Params()` and functional `FProp(theta, ...)`."""
from tfpipe.layers.attention import MultiHeadAttention, TransformerBlock
from tfpipe.layers.composite import Pop, Residual, Sequential, Stash
from tfpipe.layers.conv import Conv2D, Flatten, GlobalAvgPool, Pooling2D
from tfpipe.layers.dense import Dense, Projection
from tfpipe.layers.dropout import Dropout
from tfpipe.layers.embedding import Embedding
from tfpipe.layers.normalization import BatchNorm, LayerNorm

__all__ = ['BatchNorm', 'Conv2D', 'Dense', 'Dropout', 'Embedding', 'Flatten', 'GlobalAvgPool',
           'LayerNorm', 'MultiHeadAttention', 'Pooling2D', 'Pop', 'Projection', 'Residual',
           'Sequential', 'Stash', 'TransformerBlock']
