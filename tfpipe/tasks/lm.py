"""Causal language model over a pipelined decoder-only Transformer.

The input is packed rows (tfpipe.lm_inputs: inputs, targets, segment ids and
positions, `preprocess='lm'`); the body is `bodies.transformer_lm_body`, whose
softmax is tied to the input embedding by default. Every real token counts
once: padding (segment 0) and padded eval examples weigh nothing, and no
target crosses a document boundary. The evaler reports log-perplexity,
perplexity and next-token accuracy per token over every example of the split;
the decoder continues prompts from the split, greedy and sampled
(tfpipe.generation, with per-layer key/value caches on the cell devices).
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np
import tensorflow as tf

from tfpipe import generation, inputs
from tfpipe.hyperparams import Params
from tfpipe.layers import vocab_parallel
from tfpipe.lm_inputs import EOD_ID
from tfpipe.tasks.base_task import BaseTask, ServingSignature


def decoding_params() -> Params:
    p = Params()
    p.Define('prompt_length', 32, 'Tokens of each decoded example used as its prompt.')
    p.Define('num_new_tokens', 32, 'Tokens generated after each prompt (greedy and sampled).')
    p.Define('temperature', 0.8, 'Temperature of the sampled continuation (> 0).')
    p.Define('top_k', 40, 'Sample from the k most likely tokens (0: all).')
    p.Define('seed', 1, 'Seed of the sampled continuation: same seed, same text.')
    return p


def continuation(ids, log_probs,
                 detokenize: Callable[[Sequence[int]], str] = inputs.byte_detokenize) -> dict:
    """Generated ids (and their log-probs) up to and including the first end-of-document,
    with their text (`detokenize`d: the model's own vocabulary, bytes by default)."""
    ids = [int(i) for i in ids]
    end = ids.index(EOD_ID) + 1 if EOD_ID in ids else len(ids)
    text_end = end - 1 if EOD_ID in ids else end  # the end-of-document has no text
    return {'continuation': detokenize(ids[:text_end]), 'ids': ids[:end],
            'log_probs': [round(float(v), 5) for v in log_probs[:end]]}


def _scope_device() -> str:
    """The device the enclosing `tf.device` scope names (an op's requested device)."""
    with tf.name_scope('where'):
        return tf.zeros([]).device


def _same_device(a: str | None, b: str | None) -> bool:
    """Do two device names name one device (type and index; job and task where both say)?"""
    if not a or not b:
        return False
    a, b = tf.DeviceSpec.from_string(a), tf.DeviceSpec.from_string(b)
    same = (a.device_type or '').upper() == (b.device_type or '').upper() and \
        (a.device_index or 0) == (b.device_index or 0)
    for field in ('job', 'replica', 'task'):
        x, y = getattr(a, field), getattr(b, field)
        same = same and (x is None or y is None or x == y)
    return same


def _within_context(length: tf.Tensor, context: int, message: str) -> tf.Operation:
    """An op that fails the request when `length` (int32 or int64) exceeds `context`."""
    return tf.debugging.assert_less_equal(tf.cast(length, tf.int64),
                                          tf.constant(context, tf.int64), message=message)


def _in_vocabulary(name: str, ids: tf.Tensor, vocab_size: int) -> tf.Operation:
    """An op that fails the request when an id of `ids` is not in [0, vocab_size); the
    error shows the least and greatest id given."""
    ids = tf.cast(ids, tf.int64)
    return tf.debugging.Assert(
        tf.reduce_all((ids >= 0) & (ids < vocab_size)),
        [f'{name} holds ids outside the vocabulary [0, {vocab_size}): give token ids in that '
         'range; the least and greatest given:', tf.reduce_min(ids), tf.reduce_max(ids)],
        name=f'{name}_in_vocabulary')


def _checked(value: tf.Tensor, checks: list[tf.Operation]) -> tf.Tensor:
    """`value`, available to later ops only once every check has passed: ops that merely
    follow a check in the function may run before it."""
    with tf.control_dependencies(checks):
        return tf.identity(value)


class LanguageModel(BaseTask):
    """batch {'inputs', 'targets', 'segment_ids', 'positions'}: int [B, T] -> logits [B, T, V]."""

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('vocab_size', inputs.BYTE_VOCAB_SIZE, 'Vocabulary; the body ends with this '
                 'width (default: bytes, see tfpipe.inputs.byte_tokenize).')
        p.Define('decoder', decoding_params(), 'What the decoder job generates.')
        return p

    def __init__(self, params, parent=None):
        super().__init__(params, parent)
        self.generator = generation.Generator(self.pipe)

    def CheckInput(self, input_params: Params) -> None:
        p = self.params
        if input_params.preprocess != 'lm':
            raise ValueError(f"{self.path}: input {input_params.name} has preprocess="
                             f"{input_params.preprocess!r}; a LanguageModel reads packed rows: "
                             "set preprocess='lm'")
        if not 1 <= input_params.max_length <= self.generator.context:
            raise ValueError(f'{self.path}: input max_length={input_params.max_length} but the '
                             f'model has {self.generator.context} positions: set the input\'s '
                             'max_length between 1 and that, or raise the body\'s max_length')
        self.generator.check_lengths(p.decoder.prompt_length, p.decoder.num_new_tokens)
        generation.Sampling(p.decoder.temperature, p.decoder.top_k, p.decoder.seed)  # checks

    def PipelineInputs(self, batch):
        return {'x': batch['inputs'], 'segment_ids': batch['segment_ids'],
                'positions': batch['positions']}

    def ThroughputUnit(self, batch):
        """Tokens: every position of the packed rows, padding included (the step
        computes on every one), as Megatron counts them."""
        return 'tokens', int(batch['inputs'].shape[1])

    def PipelineTargets(self, batch):
        return {'targets': batch['targets'], 'segment_ids': batch['segment_ids']}

    def TokenLosses(self, logits, targets) -> tuple[tf.Tensor, tf.Tensor]:
        """(cross-entropy [B, T], weights [B, T]): weight 1 on real tokens, 0 on padding.

        `logits` may be the vocabulary shards of a tensor-parallel softmax (T > 1):
        then the cross-entropy is computed where they are, never gathered
        (layers.VocabLogits.CrossEntropy)."""
        if vocab_parallel.is_split(logits):
            xent = self._Softmax().CrossEntropy(logits, targets['targets'])
        else:
            xent = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=targets['targets'],
                                                                  logits=logits)
        weights = tf.cast(targets['segment_ids'] > 0, xent.dtype)
        return xent * weights, weights

    def _Softmax(self) -> vocab_parallel.VocabLogits:
        """The body's last layer in the replica whose micro-batch is being scored: the
        pipeline calls the loss under the device of that replica's last cell."""
        layers = [cells[-1].layers[-1] for cells in self.pipe.replica_cells]
        if len(layers) > 1:
            here = _scope_device()
            for layer in layers:
                if _same_device(layer.group.home, here):
                    return layer
        return layers[0]

    def PerExampleLoss(self, logits, targets):
        """Mean cross-entropy over each row's real tokens."""
        xent, weights = self.TokenLosses(logits, targets)
        return tf.reduce_sum(xent, 1) / tf.maximum(tf.reduce_sum(weights, 1), 1.0)

    def ComputeLoss(self, theta, logits, batch):
        logits = vocab_parallel.whole(logits)  # the argmax reads every id
        xent, weights = self.TokenLosses(logits, self.PipelineTargets(batch))
        weights *= tf.cast(self.ExampleWeights(batch), weights.dtype)[:, None]
        tokens = tf.reduce_sum(weights)
        hyp = tf.argmax(logits, -1, output_type=batch['targets'].dtype)
        correct = tf.cast(tf.equal(hyp, batch['targets']), weights.dtype) * weights
        log_pplx = tf.math.divide_no_nan(tf.reduce_sum(xent * weights), tokens)
        return {'loss': (log_pplx, tokens), 'log_pplx': (log_pplx, tokens),
                'accuracy': (tf.math.divide_no_nan(tf.reduce_sum(correct), tokens), tokens)}

    def FinalizeMetrics(self, scores):
        # Perplexity of the whole split: exp of its per-token mean, not a mean of exps.
        return {**scores, 'perplexity': math.exp(min(scores['log_pplx'], 700.0))}

    def Decode(self, theta, batch):
        d = self.params.decoder
        prompt = batch['inputs'][:, :d.prompt_length]
        theta = theta['pipe']
        greedy, greedy_lp = self.generator.generate(theta, prompt, d.num_new_tokens)
        sampled, sampled_lp = self.generator.generate(
            theta, prompt, d.num_new_tokens,
            generation.Sampling(temperature=d.temperature, top_k=d.top_k, seed=d.seed))
        end = d.prompt_length + d.num_new_tokens
        return {'prompt': prompt, 'reference': batch['targets'][:, d.prompt_length - 1:end - 1],
                'greedy': greedy, 'greedy_log_probs': greedy_lp, 'sampled': sampled,
                'sampled_log_probs': sampled_lp}

    def ServingSignatures(self, features):
        """Both take a document's tokens without its start: the model saw every
        document as [EOD_ID, t1, t2, ..], so the signatures put EOD_ID in front.

        serving_default: ids int32 [batch, T] (T <= context) -> log_probs float32
        [batch, T], log p(t_i | document start, t_1..t_{i-1}) for every i. Causal, so
        padding after a row's last token changes none of its earlier values.

        generate: prompt int32 [batch, P] (P may be 0) and num_new_tokens int32 []
        (>= 1, P + num_new_tokens <= context) -> ids int32 [batch, num_new_tokens]
        and their log_probs, greedy: the decoder's greedy continuation. The key/value
        caches live in the request's graph; a tf.while_loop runs one cached step per
        token.

        A request beyond the context, or with an id outside the vocabulary, fails
        with the bound named (InvalidArgumentError) before any op reads its inputs:
        an op that merely follows a check in the graph may run first (the output
        array of num_new_tokens=2**31-3 slots aborted the process with bad_alloc),
        the lengths are added in int64 (an int32 sum wraps past the bound), and an
        unchecked id fails in a gather on a CPU but reads zeros on a GPU.
        """
        dtype = features['inputs'].dtype
        context, vocab_size = self.generator.context, self.params.vocab_size

        def with_start(ids):
            return tf.concat([tf.fill([tf.shape(ids)[0], 1], tf.constant(EOD_ID, dtype)), ids], 1)

        def log_probs(ids):
            ids = _checked(ids, [_within_context(tf.shape(ids)[1], context, (
                f'ids longer than the context of {context} tokens: score at most {context} '
                'tokens per row')), _in_vocabulary('ids', ids, vocab_size)])
            inputs = with_start(ids)[:, :-1]
            logits = vocab_parallel.whole(self.ServingPredictions({
                'inputs': inputs, 'segment_ids': tf.ones_like(inputs),
                'positions': tf.broadcast_to(tf.range(tf.shape(inputs)[1]), tf.shape(inputs))}))
            scores = tf.nn.log_softmax(tf.cast(logits, tf.float32))
            return {'log_probs': tf.gather(scores, ids, batch_dims=2)}

        def generate(prompt, num_new_tokens):
            checks = [
                tf.debugging.assert_positive(
                    num_new_tokens, message='num_new_tokens must be >= 1: ask for a token'),
                _within_context(
                    tf.cast(tf.shape(prompt)[1], tf.int64) + tf.cast(num_new_tokens, tf.int64),
                    context, f'prompt length + num_new_tokens exceeds the context of {context} '
                             'tokens: shorten the prompt or ask for fewer tokens'),
                _in_vocabulary('prompt', prompt, vocab_size)]
            prompt, num_new_tokens = _checked(prompt, checks), _checked(num_new_tokens, checks)
            ids, scores = self.generator.generate_in_graph(
                self.pipe.theta, tf.cast(with_start(prompt), tf.int32), num_new_tokens)
            return {'ids': ids, 'log_probs': scores}

        return {'serving_default': ServingSignature(
                    {'ids': tf.TensorSpec([None, None], dtype, name='ids')}, log_probs),
                'generate': ServingSignature(
                    {'prompt': tf.TensorSpec([None, None], dtype, name='prompt'),
                     'num_new_tokens': tf.TensorSpec([], tf.int32, name='num_new_tokens')},
                    generate)}

    def PostProcessDecodeOut(self, decode_out):
        records = []
        for i, prompt in enumerate(decode_out['prompt']):
            records.append({
                'prompt': inputs.byte_detokenize([t for t in prompt.tolist() if t != EOD_ID]),
                'reference': continuation(decode_out['reference'][i], [])['continuation'],
                'greedy': continuation(decode_out['greedy'][i],
                                        decode_out['greedy_log_probs'][i]),
                'sampled': continuation(decode_out['sampled'][i],
                                         decode_out['sampled_log_probs'][i])})
        return records

    def DecodeMetrics(self, records):
        """Mean log-prob per generated token, and how often greedy matches the reference."""
        log_probs = [v for r in records for v in r['greedy']['log_probs']]
        matches = [a == b for r in records
                   for a, b in zip(r['greedy']['continuation'], r['reference'])]
        return {'greedy_mean_log_prob': float(np.mean(log_probs)) if log_probs else 0.0,
                'greedy_char_match': float(np.mean(matches)) if matches else 0.0}
