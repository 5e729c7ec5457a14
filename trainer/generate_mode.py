"""--mode=generate: continue one prompt with the newest checkpoint of a logdir.

    python -m trainer --model=lm.pystdlib.TransformerLM --logdir=/tmp/lm \
        --mode=generate --prompt='def main(' --num_new_tokens=64

Prints one JSON line: the prompt, the continuation (up to the first end-of-document;
the prompt is encoded and the output decoded with the model's own `tokenizer` and
`detokenizer`, UTF-8 bytes by default), its token ids and their log-probabilities, with the
same generator the decoder job uses. Reads the logdir, never writes to it.
"""
from __future__ import annotations

import json
import os

from absl import flags

flags.DEFINE_string('prompt', '', '--mode=generate: the text to continue (a document start '
                    'is put before it).')
flags.DEFINE_integer('num_new_tokens', 64, '--mode=generate: tokens to generate.')
flags.DEFINE_float('temperature', 0.0, '--mode=generate: 0 greedy, else sample at this '
                   'temperature.')
flags.DEFINE_integer('top_k', 0, '--mode=generate: sample from the k most likely tokens '
                     '(0: all).')
flags.DEFINE_integer('seed', 0, '--mode=generate: seed of the sampled tokens.')
FLAGS = flags.FLAGS


def generate(params, logdir: str) -> dict:
    """The record of FLAGS.prompt continued by the newest checkpoint in logdir/train."""
    import tensorflow as tf
    from tfpipe import checkpoints, export, generation, inputs
    from tfpipe.lm_inputs import EOD_ID
    from tfpipe.tasks import lm
    from trainer import train_job
    sampling = generation.Sampling(FLAGS.temperature, FLAGS.top_k, FLAGS.seed)  # checks first
    task = export.decoding_task_params(params.task).Instantiate()
    if not isinstance(task, lm.LanguageModel):
        raise ValueError(f'--mode=generate continues text with a language model; this '
                         f'model\'s task is a {type(task).__name__}: pick an lm.* model')
    train_dir = train_job.train_dir_of(logdir)
    path = checkpoints.latest(train_dir) if os.path.isdir(train_dir) else None
    if path is None:
        raise ValueError(f'--mode=generate: no checkpoint in {train_dir}: train the model '
                         'first, or point --logdir at a logdir that has one')
    # The model's own vocabulary (its training input's), resolved before the restore.
    tokenize, detokenize = inputs.tokenizer(params.input.train), inputs.detokenizer(
        params.input.train)
    checkpoints.restore(checkpoints.make(task.VariablesByPath()), path, partial=True)
    prompt_ids = tf.cast(tokenize(tf.constant(FLAGS.prompt)), tf.int32)
    prompt = tf.concat([[EOD_ID], prompt_ids], 0)[None, :]
    ids, log_probs = task.generator.generate(task.theta['pipe'], prompt, FLAGS.num_new_tokens,
                                             sampling)
    record = lm.continuation(ids[0].numpy(), log_probs[0].numpy(), detokenize)
    return {'prompt': FLAGS.prompt, 'step': checkpoints.step_of(path), **record}


def run(params, logdir: str) -> int:
    print(json.dumps(generate(params, logdir)))
    return 0
