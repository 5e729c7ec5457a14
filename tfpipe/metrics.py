"""Metrics computed on the host from decoder output: corpus BLEU."""
from __future__ import annotations

import collections
import math
from typing import Sequence


def _ngrams(tokens: Sequence, n: int) -> collections.Counter:
    return collections.Counter(tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1))


def corpus_bleu(references: Sequence[Sequence], hypotheses: Sequence[Sequence],
                max_order: int = 4) -> float:
    """Papineni et al. corpus BLEU (0..100) on token sequences, with brevity penalty.

    Unsmoothed: a corpus with no match of some order scores 0.
    """
    if len(references) != len(hypotheses):
        raise ValueError(f'{len(references)} references but {len(hypotheses)} hypotheses')
    matches = [0] * max_order
    possible = [0] * max_order
    ref_len = hyp_len = 0
    for ref, hyp in zip(references, hypotheses):
        ref_len += len(ref)
        hyp_len += len(hyp)
        for n in range(1, max_order + 1):
            overlap = _ngrams(ref, n) & _ngrams(hyp, n)
            matches[n - 1] += sum(overlap.values())
            possible[n - 1] += max(0, len(hyp) - n + 1)
    if min(matches) == 0:
        return 0.0
    log_precision = sum(math.log(m / p) for m, p in zip(matches, possible)) / max_order
    brevity = 1.0 if hyp_len > ref_len else math.exp(1 - ref_len / hyp_len)
    return 100.0 * brevity * math.exp(log_precision)
