"""Continuing prompts with a pipelined language model, greedy or sampled.

Cached (the default): each `PackedTransformerBlock` keeps the keys and values of
every position it has seen in a cache created on its cell's device (in a
tensor-parallel cell, one cache per device, of that device's heads), and each
step runs the cells in order on the new token only (`ExtendStep`), so n new
tokens cost n calls of each layer. Uncached (for checking and benchmarks): each
step runs the pipeline's forward over the whole context again. Both pick
tokens with the same function from the last position's logits, so they agree
to float rounding (tests/test_lm_generation.py: tokens equal, log-probs within
1e-5).

Sampling is reproducible: token i of a continuation is drawn with the
stateless seed (seed, i), so the same seed gives the same continuation.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import tensorflow as tf

from tfpipe import fprop_context
from tfpipe.base_layer import apply_layer, cast_floats
from tfpipe.layers.attention import PackedTransformerBlock
from tfpipe.layers import vocab_parallel
from tfpipe.layers.embedding import PackedPositionEmbedding
from tfpipe.pipeline.pipelining_layer import PipeliningLayer

__all__ = ['Sampling', 'Generator']

_FLOAT32_TINY = 1.1754943508222875e-38  # np.finfo(np.float32).tiny


@dataclasses.dataclass(frozen=True)
class Sampling:
    """temperature 0: greedy (argmax); else sample softmax(logits / temperature),
    from the top_k most likely tokens only when top_k > 0."""
    temperature: float = 0.0
    top_k: int = 0
    seed: int = 0

    def __post_init__(self):
        if not math.isfinite(self.temperature) or self.temperature < 0 or self.top_k < 0:
            raise ValueError(f'temperature={self.temperature} and top_k={self.top_k} must be '
                             'finite and >= 0 (temperature 0: greedy; top_k 0: every token)')
        if 0 < self.temperature < _FLOAT32_TINY:  # the kernels flush it to 0: logits / 0
            raise ValueError(f'temperature={self.temperature} is below float32\'s smallest '
                             f'normal number ({_FLOAT32_TINY:.3g}): use 0 for greedy, or a '
                             'larger temperature')


def _choose(logits: tf.Tensor, sampling: Sampling,
            index: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """Token `index` of the continuation [b] int32, and its log-probability under the model
    (temperature 1, all tokens)."""
    logits = tf.cast(logits, tf.float32)
    if sampling.temperature == 0:
        token = tf.argmax(logits, -1, output_type=tf.int32)
    else:
        # Shifted so the largest is 0: a tiny temperature sends the others to -inf (greedy
        # in the limit), never the largest to +inf, which would draw no valid token.
        scaled = (logits - tf.reduce_max(logits, -1, keepdims=True)) / sampling.temperature
        if sampling.top_k:  # ranked on the logits: a huge temperature flushes scaled to 0
            kth = tf.math.top_k(logits, min(sampling.top_k, logits.shape[-1])).values[:, -1:]
            scaled = tf.where(logits < kth, tf.constant(-math.inf, scaled.dtype), scaled)
        token = tf.cast(tf.random.stateless_categorical(
            scaled, 1, seed=tf.stack([tf.constant(sampling.seed, tf.int64),
                                      tf.cast(index, tf.int64)]))[:, 0], tf.int32)
    log_probs = tf.nn.log_softmax(logits)
    return token, tf.gather(log_probs, token, batch_dims=1)


class Generator:
    """Generates continuations with the cells of `pipe` (its body from `transformer_lm_body`)."""

    def __init__(self, pipe: PipeliningLayer):
        positions = [layer for cell in pipe.cells for layer in cell.layers
                     if isinstance(layer, PackedPositionEmbedding)]
        if not positions:
            raise ValueError(f'{pipe.path}: generation needs a body from '
                             'bodies.transformer_lm_body (no PackedPositionEmbedding found)')
        self.pipe = pipe
        self.context = positions[0].params.max_length
        # One call per token: the step, the choice and (uncached) the write of the token.
        self._step = tf.function(self._cached_step, autograph=False)
        self._full = tf.function(self._uncached_step, autograph=False)

    def check_lengths(self, prompt_length: int, num_new: int) -> None:
        if prompt_length < 1 or num_new < 1:
            raise ValueError(f'prompt length {prompt_length} and new tokens {num_new} must be '
                             '>= 1: give a non-empty prompt and ask for at least one token')
        if prompt_length + num_new > self.context:
            raise ValueError(f'a prompt of {prompt_length} tokens plus {num_new} new ones '
                             f'exceeds the context of {self.context} positions: shorten the '
                             'prompt or ask for fewer tokens')

    def generate(self, theta: dict, prompt: tf.Tensor, num_new: int,
                 sampling: Sampling = Sampling(), cached: bool = True
                 ) -> tuple[tf.Tensor, tf.Tensor]:
        """(tokens [b, num_new] int32, their log-probs [b, num_new]) after prompt [b, p] int32.

        `theta` is the pipeline's (task.theta['pipe']). Runs eagerly or inside a
        tf.function (the decoder's): each step is one call of a traced function.
        """
        prompt = tf.convert_to_tensor(prompt, tf.int32)
        self.check_lengths(prompt.shape[1], num_new)
        with fprop_context.evaluation():
            if cached:
                return self._run_cached(theta, prompt, num_new, sampling)
            return self._run_uncached(theta, prompt, num_new, sampling)

    def init_caches(self, batch: int) -> list[dict]:
        """Per cell, {block name: empty key/value cache}, each on its cell's device."""
        caches = []
        for cell in self.pipe.cells:
            with tf.device(cell.device):
                caches.append({
                    layer.params.name: layer.InitCache(batch, self.context,
                                                       _compute_dtype(layer, cell.fprop_dtype))
                    for layer in cell.layers if isinstance(layer, PackedTransformerBlock)})
        return caches

    def _run_cached(self, theta, prompt, num_new, sampling):
        caches = self.init_caches(prompt.shape[0])
        ids, start, tokens, log_probs = prompt, 0, [], []
        for i in range(num_new):
            token, log_prob, caches = self._step(theta, ids, tf.constant(start), caches,
                                                 sampling, tf.constant(i))
            tokens.append(token)
            log_probs.append(log_prob)
            ids, start = token[:, None], start + ids.shape[1]
        return tf.stack(tokens, 1), tf.stack(log_probs, 1)

    def generate_in_graph(self, theta: dict, prompt: tf.Tensor, num_new: tf.Tensor
                          ) -> tuple[tf.Tensor, tf.Tensor]:
        """Greedy `generate` for a traced function whose batch, prompt length and
        `num_new` are tensors (a SavedModel's signature): the cached steps run in a
        tf.while_loop, so the graph does not grow with the number of tokens.

        The caller checks `prompt length + num_new <= context` (in the graph: an op
        that fails the request); the tokens equal `generate`'s (same steps, same choice).
        """
        greedy = Sampling()
        caches = self.init_caches(tf.shape(prompt)[0])
        token, log_prob, caches = self._cached_step(theta, prompt, tf.constant(0), caches,
                                                    greedy, tf.constant(0))
        tokens = tf.TensorArray(tf.int32, size=num_new).write(0, token)
        log_probs = tf.TensorArray(log_prob.dtype, size=num_new).write(0, log_prob)
        start = tf.shape(prompt)[1] - 1  # the position of new token i is start + i

        def step(i, token, caches, tokens, log_probs):
            token, log_prob, caches = self._cached_step(theta, token[:, None], start + i,
                                                        caches, greedy, i)
            return i + 1, token, caches, tokens.write(i, token), log_probs.write(i, log_prob)
        _, _, _, tokens, log_probs = tf.while_loop(
            lambda i, *_: i < num_new, step, (tf.constant(1), token, caches, tokens, log_probs))
        return tf.transpose(tokens.stack()), tf.transpose(log_probs.stack())

    def _cached_step(self, theta: dict, ids: tf.Tensor, start: tf.Tensor, caches: list[dict],
                     sampling: Sampling, index: tf.Tensor):
        """The new `ids` [b, n] at positions start.. through every cell against the caches;
        (the next token, its log-prob, the updated caches)."""
        b, n = tf.shape(ids)[0], tf.shape(ids)[1]  # dynamic in a served SavedModel
        act = {'x': ids, 'segment_ids': tf.ones_like(ids),
               'positions': tf.tile((start + tf.range(n))[None, :], [b, 1])}
        new_caches = []
        with fprop_context.evaluation():
            for cell, cache in zip(self.pipe.cells, caches):
                cell_theta = cell.read_theta(theta)
                new_cache = {}
                with tf.device(cell.device):
                    for layer in cell.layers:
                        name = layer.params.name
                        if name in cache:
                            act, new_cache[name] = _extend(layer, cell_theta[name], act,
                                                           cache[name], cell.fprop_dtype)
                        else:
                            act = apply_layer(layer, cell_theta[name], act, cell.fprop_dtype)
                new_caches.append(new_cache)
        return (*_choose(_last_position(act), sampling, index), new_caches)

    def _run_uncached(self, theta, prompt, num_new, sampling):
        b, length = prompt.shape
        ids = tf.concat([prompt, tf.zeros([b, self.context - length], tf.int32)], 1)
        tokens, log_probs = [], []
        for i in range(num_new):
            token, log_prob, ids = self._full(theta, ids, tf.constant(length + i - 1), sampling,
                                              tf.constant(i))
            tokens.append(token)
            log_probs.append(log_prob)
        return tf.stack(tokens, 1), tf.stack(log_probs, 1)

    def _uncached_step(self, theta: dict, ids: tf.Tensor, last: tf.Tensor, sampling: Sampling,
                       index: tf.Tensor):
        """A forward over the whole window `ids` [b, context]; (the token after position
        `last`, its log-prob, ids with it written at last + 1)."""
        b, t = ids.shape
        with fprop_context.evaluation():
            logits = self.pipe.FProp(theta, {'x': ids, 'segment_ids': tf.ones_like(ids),
                                             'positions': tf.tile(tf.range(t)[None, :], [b, 1])})
        # Causal: the zeros after the last real position do not change its logits.
        token, log_prob = _choose(tf.gather(vocab_parallel.whole(logits), last, axis=1),
                                  sampling, index)
        slot = tf.one_hot(last + 1, t, dtype=tf.int32)[None, :]
        return token, log_prob, ids * (1 - slot) + token[:, None] * slot


def _last_position(logits) -> tf.Tensor:
    """The logits [b, V] of the last position: of each vocabulary shard first (a
    tensor-parallel softmax, T > 1), then concatenated, so only [b, V] travels."""
    if vocab_parallel.is_split(logits):
        return vocab_parallel.gather([s[:, -1, :] for s in logits])
    return logits[:, -1, :]


def _extend(layer: PackedTransformerBlock, theta: dict, act: dict, cache: dict,
            fprop_dtype: Optional[tf.DType]) -> tuple[dict, dict]:
    """`apply_layer` for a cached step: the same dtype rule, then ExtendStep."""
    dtype = _compute_dtype(layer, fprop_dtype)
    return layer.ExtendStep(cast_floats(theta, dtype), cast_floats(act, dtype), cache)


def _compute_dtype(layer: PackedTransformerBlock, fprop_dtype: Optional[tf.DType]) -> tf.DType:
    """apply_layer's rule: the layer's own fprop_dtype, else its cell's, else its weights'."""
    return layer.params.fprop_dtype or fprop_dtype or layer.params.dtype
