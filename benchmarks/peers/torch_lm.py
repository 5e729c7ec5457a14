"""torch.distributed.pipelining's side of peers_lm_benchmark.py, run with the torch venv's Python.

The same GPT-2-small-shaped byte LM as tfpipe's (lm_shape.py): pre-LayerNorm blocks
(attention by F.scaled_dot_product_attention, causal; relu feed-forward), the embedding
scaled by sqrt(width), learned positions, a final LayerNorm and a softmax layer with a
bias. Two differences, both in torch's favour and each under 0.3% of the FLOPs: the
softmax has its own weight (tying it to the first stage's embedding would need a
gradient exchange between stages, which tfpipe does), and the rows are random bytes
without packing (tfpipe's attention masks the packed documents' boundaries).

As torch_pipe.py runs it: one process per stage over gloo, ScheduleGPipe with the mean
cross-entropy on the last stage, recompute by torch.utils.checkpoint around each stage's
layers, Adam per stage; a step ends when every stage is done (a barrier).
"""
from __future__ import annotations

import math

import lm_shape
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch_pipe import run_configs


class Block(nn.Module):
    """x + Attention(LN(x)), then x + FFN(LN(x)): tfpipe's TransformerBlock."""

    def __init__(self):
        super().__init__()
        d = lm_shape.WIDTH
        self.atten_ln, self.ffn_ln = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.post = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ffn_in, self.ffn_out = nn.Linear(d, lm_shape.HIDDEN), nn.Linear(lm_shape.HIDDEN, d)

    def forward(self, x):
        b, t, d = x.shape
        heads = lm_shape.HEADS
        q, k, v = (z.view(b, t, heads, d // heads).transpose(1, 2)
                   for z in self.qkv(self.atten_ln(x)).split(d, dim=-1))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.post(attended.transpose(1, 2).reshape(b, t, d))
        return x + self.ffn_out(F.relu(self.ffn_in(self.ffn_ln(x))))


class Stage(nn.Module):
    """Stage k of K: the embedding and positions first, its blocks, the head last."""

    def __init__(self, rank: int, cells: int):
        super().__init__()
        self.first, self.last = rank == 0, rank == cells - 1
        if self.first:
            self.embedding = nn.Embedding(lm_shape.VOCAB, lm_shape.WIDTH)
            self.position = nn.Parameter(0.02 * torch.randn(lm_shape.LENGTH, lm_shape.WIDTH))
        self.blocks = nn.Sequential(*[Block() for _ in
                                      range(lm_shape.blocks_per_cell(cells)[rank])])
        if self.last:
            self.final_ln = nn.LayerNorm(lm_shape.WIDTH)
            self.logits = nn.Linear(lm_shape.WIDTH, lm_shape.VOCAB)

    def layers(self, x):
        if self.first:
            x = self.embedding(x) * math.sqrt(lm_shape.WIDTH) + self.position
        x = self.blocks(x)
        return self.logits(self.final_ln(x)) if self.last else x

    def forward(self, x):
        return checkpoint(self.layers, x, use_reentrant=False)


def loss_fn(logits, targets):
    return F.cross_entropy(logits.reshape(-1, lm_shape.VOCAB), targets.reshape(-1))


def lm_stage(rank: int, cells: int):
    """Stage `rank` of the LM: (module, loss, first stage's ids, last's targets, Adam)."""
    torch.manual_seed(rank)
    module = Stage(rank, cells)
    optimizer = torch.optim.Adam(module.parameters(), lr=lm_shape.LEARNING_RATE)
    ids = torch.randint(2, lm_shape.VOCAB, (lm_shape.BATCH, lm_shape.LENGTH))
    targets = torch.randint(2, lm_shape.VOCAB, (lm_shape.BATCH, lm_shape.LENGTH))
    return module, loss_fn, ids, targets, optimizer


if __name__ == '__main__':
    run_configs(lm_stage, __doc__.split('\n\n')[0])
