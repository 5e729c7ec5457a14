"""GPT-2 small's shape over bytes, the model peers_lm_benchmark.py times in each system.

lm.pystdlib.GPT2SmallShapedLM's sizes (params/lm/pystdlib.py), written out here because
the torch worker runs in the torch venv, which has no tfpipe: 12 pre-LayerNorm blocks of
width 768 (12 heads, feed-forward 3072, relu), learned positions, a byte vocabulary,
rows of 256 bytes, batch 8, Adam. Cells hold the registered model's balance at K=4
(embedding, positions and 3 blocks; 3; 3; 3 and the final LayerNorm and softmax).
"""
WIDTH, HIDDEN, HEADS, BLOCKS = 768, 3072, 12, 12
VOCAB, LENGTH, BATCH = 258, 256, 8  # tfpipe.tokenizers.BYTE_VOCAB_SIZE
LEARNING_RATE = 1e-3


def blocks_per_cell(cells: int) -> list[int]:
    """Blocks in each of K cells, as even as BLOCKS allows (earlier cells take the extra)."""
    base, extra = divmod(BLOCKS, cells)
    return [base + (k < extra) for k in range(cells)]
