"""``tfpipe_reverse``: translate a token sequence into its reverse, made locally.

Why it exists: sequence-to-sequence pipelines (Transformer encoder/decoder cells
under GPipe) need a task that a small model provably learns — reversal needs
attention over the whole source, so it exercises the model — with no network,
no vocabulary file and no tokeniser. Sources are 4..12 tokens drawn uniformly
from the content ids; the target is the source reversed, followed by EOS.

Id conventions (shared with ``tfpipe.inputs`` and its byte tokeniser):

* ``PAD_ID = 0`` pads batches to a static length; it never appears in the data.
* ``EOS_ID = 1`` ends every target; sources carry no EOS.
* ``2 .. VOCAB_SIZE - 1`` are content tokens.
"""
from __future__ import annotations

from typing import Dict, Iterator, List, Tuple

import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds

__all__ = ['EOS_ID', 'FIRST_TOKEN_ID', 'MAX_SOURCE_LENGTH', 'MIN_SOURCE_LENGTH', 'PAD_ID',
           'SPLIT_SIZES', 'VOCAB_SIZE', 'ReverseBuilder', 'generate']

PAD_ID = 0
EOS_ID = 1
FIRST_TOKEN_ID = 2
VOCAB_SIZE = 32
MIN_SOURCE_LENGTH, MAX_SOURCE_LENGTH = 4, 12
SPLIT_SIZES = {'train': 20000, 'validation': 1000, 'test': 1000}
# One seed per split: adding examples to one split never changes another.
_SPLIT_SEEDS = {'train': 1001, 'validation': 2001, 'test': 3001}


def generate(num_examples: int, seed: int) -> List[Tuple[np.ndarray, np.ndarray]]:
    """Returns ``num_examples`` (src, tgt) int32 pairs, tgt = reversed(src) + [EOS]."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(MIN_SOURCE_LENGTH, MAX_SOURCE_LENGTH + 1, size=num_examples)
    pairs = []
    for length in lengths:
        src = rng.integers(FIRST_TOKEN_ID, VOCAB_SIZE, size=length).astype(np.int32)
        tgt = np.concatenate([src[::-1], [EOS_ID]]).astype(np.int32)
        pairs.append((src, tgt))
    return pairs


class ReverseBuilder(tfds.core.GeneratorBasedBuilder):
    """tfds builder of ``tfpipe_reverse``; ``download_and_prepare`` downloads nothing."""

    name = 'tfpipe_reverse'
    VERSION = tfds.core.Version('1.0.0')
    RELEASE_NOTES = {'1.0.0': 'Initial release.'}

    def _info(self) -> tfds.core.DatasetInfo:
        return self.dataset_info_from_configs(
            description=__doc__.split('\n\n', 1)[0],
            features=tfds.features.FeaturesDict({
                'src': tfds.features.Tensor(shape=(None,), dtype=tf.int32),
                'tgt': tfds.features.Tensor(shape=(None,), dtype=tf.int32),
            }),
            supervised_keys=('src', 'tgt'),
        )

    def _split_generators(self, dl_manager: tfds.download.DownloadManager
                          ) -> Dict[str, Iterator[Tuple[int, dict]]]:
        del dl_manager  # everything is generated locally
        return {split: self._generate_examples(n, _SPLIT_SEEDS[split])
                for split, n in SPLIT_SIZES.items()}

    def _generate_examples(self, num_examples: int, seed: int
                           ) -> Iterator[Tuple[int, dict]]:
        for i, (src, tgt) in enumerate(generate(num_examples, seed)):
            yield i, {'src': src, 'tgt': tgt}
