"""``tfpipe_shapes``: small RGB images of one geometric shape each, made locally.

Why it exists: image-classification pipelines (conv stacks split into GPipe
cells) need a data set that is real enough to be *learnable* — so a loss curve
means something — yet needs no network, generates in seconds and is identical on
every machine. Each image holds one filled shape (circle, square, triangle or
cross) at a random position and size, in a random colour, over a noisy random
background. Shape and background colours are drawn from disjoint brightness
bands so the outline is always visible; everything else is nuisance the model
must learn to ignore.

Every split comes from its own fixed numpy seed, so the data is bit-identical
wherever it is built, and the splits never share a random stream.
"""
from __future__ import annotations

from typing import Dict, Iterator, Tuple

import numpy as np
import tensorflow_datasets as tfds

__all__ = ['CLASS_NAMES', 'IMAGE_SIZE', 'NUM_CHANNELS', 'SPLIT_SIZES', 'ShapesBuilder',
           'draw_shape', 'generate']

IMAGE_SIZE = 16
NUM_CHANNELS = 3
CLASS_NAMES = ('circle', 'square', 'triangle', 'cross')
SPLIT_SIZES = {'train': 8192, 'validation': 1024, 'test': 1024}
# One seed per split: adding examples to one split never changes another.
_SPLIT_SEEDS = {'train': 1000, 'validation': 2000, 'test': 3000}
_MIN_HALF, _MAX_HALF = 3, 6  # half-extent of a shape in pixels (shape is 7..13 wide)
_NOISE_STD = 12.0


def draw_shape(label: int, cy: float, cx: float, half: float, size: int = IMAGE_SIZE
               ) -> np.ndarray:
    """Boolean [size, size] mask of class ``label`` centred at (cy, cx).

    Masks are computed analytically on pixel centres, so shapes look the same at
    every position (no drawing library, no anti-aliasing differences).
    """
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32)
    dy, dx = yy - cy, xx - cx
    name = CLASS_NAMES[label]
    if name == 'circle':
        return dy * dy + dx * dx <= half * half
    if name == 'square':
        # Slightly smaller than the bounding box so its area is close to the circle's:
        # size alone must not give the class away.
        h = half * 0.85
        return (np.abs(dy) <= h) & (np.abs(dx) <= h)
    if name == 'triangle':
        # Apex up, base down: inside when below the apex and within the widening sides.
        t = (dy + half) / (2.0 * half)  # 0 at the apex row, 1 at the base row
        return (t >= 0.0) & (t <= 1.0) & (np.abs(dx) <= t * half)
    if name == 'cross':
        arm = max(1.0, half / 3.0)
        return (((np.abs(dy) <= arm) & (np.abs(dx) <= half))
                | ((np.abs(dx) <= arm) & (np.abs(dy) <= half)))
    raise ValueError(f'unknown shape class {label}')


def generate(num_examples: int, seed: int) -> Tuple[np.ndarray, np.ndarray]:
    """Returns (images uint8 [N, H, W, 3], labels int64 [N]) from one numpy seed.

    Labels cycle through the classes before shuffling so every split is exactly
    balanced (a classifier's accuracy can be read against 1/num_classes).
    """
    rng = np.random.default_rng(seed)
    labels = rng.permutation(np.arange(num_examples) % len(CLASS_NAMES))
    images = np.empty((num_examples, IMAGE_SIZE, IMAGE_SIZE, NUM_CHANNELS), np.uint8)
    for i, label in enumerate(labels):
        half = rng.uniform(_MIN_HALF, _MAX_HALF)
        # Keep the whole shape inside the image.
        cy, cx = rng.uniform(half - 0.5, IMAGE_SIZE - half - 0.5, size=2)
        mask = draw_shape(int(label), cy, cx, half)
        background = rng.uniform(0, 100, size=NUM_CHANNELS)
        foreground = rng.uniform(155, 255, size=NUM_CHANNELS)
        if rng.random() < 0.5:  # dark shape on a light background half of the time
            background, foreground = 255 - background, 255 - foreground
        image = np.where(mask[..., None], foreground, background)
        image = image + rng.normal(0.0, _NOISE_STD, size=image.shape)
        images[i] = np.clip(np.rint(image), 0, 255).astype(np.uint8)
    return images, labels.astype(np.int64)


class ShapesBuilder(tfds.core.GeneratorBasedBuilder):
    """tfds builder of ``tfpipe_shapes``; ``download_and_prepare`` downloads nothing."""

    name = 'tfpipe_shapes'
    VERSION = tfds.core.Version('1.0.0')
    RELEASE_NOTES = {'1.0.0': 'Initial release.'}

    def _info(self) -> tfds.core.DatasetInfo:
        return self.dataset_info_from_configs(
            description=__doc__.split('\n\n', 1)[0],
            features=tfds.features.FeaturesDict({
                'image': tfds.features.Image(
                    shape=(IMAGE_SIZE, IMAGE_SIZE, NUM_CHANNELS)),
                'label': tfds.features.ClassLabel(names=list(CLASS_NAMES)),
            }),
            supervised_keys=('image', 'label'),
        )

    def _split_generators(self, dl_manager: tfds.download.DownloadManager
                          ) -> Dict[str, Iterator[Tuple[int, dict]]]:
        del dl_manager  # everything is generated locally
        return {split: self._generate_examples(n, _SPLIT_SEEDS[split])
                for split, n in SPLIT_SIZES.items()}

    def _generate_examples(self, num_examples: int, seed: int
                           ) -> Iterator[Tuple[int, dict]]:
        images, labels = generate(num_examples, seed)
        for i in range(num_examples):
            yield i, {'image': images[i], 'label': int(labels[i])}
