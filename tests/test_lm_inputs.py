"""Language-model input: documents packed into rows, the pystdlib corpus, bad corpora."""
import os
import re

import numpy as np
import pytest
import tensorflow as tf

from tfpipe import inputs, lm_inputs, params_text
from tfpipe.datasets import pystdlib
from tests import lm_corpus

LENGTH = 24
# The corpora and the tokenizer here live in `tests`, as a model's own package does, which
# the trainer trusts for its examples_fn and tokenizer (tfpipe.params_text).
params_text.trust_package('tests')


def lm_input(**kw):
    kw = {'examples_fn': 'tests.lm_corpus.documents', 'max_length': LENGTH, **kw}
    return inputs.DatasetInput.Params().Set(preprocess='lm', batch_size=4, **kw)


def all_rows(split='dev'):
    """Every row of the split once (EvalDataset), real examples only."""
    batches = list(lm_input(split=split).Instantiate().EvalDataset(10 ** 6))
    real = np.concatenate([b['weight'].numpy() for b in batches]) > 0
    return {k: np.concatenate([b[k].numpy() for b in batches])[real]
            for k in ('inputs', 'targets', 'segment_ids', 'positions')}


def test_rows_hold_every_document_once_in_order_as_input_target_pairs():
    rows = all_rows()
    texts = [t for t in lm_corpus.texts('dev') if t]  # empty documents are skipped
    assert rows['inputs'].shape[1] == LENGTH
    # Cut the stream of pairs at each segment start: pieces of documents, in order.
    pieces, flat = [], {k: v.reshape(-1) for k, v in rows.items()}
    for i in range(flat['inputs'].size):
        if flat['segment_ids'][i] == 0:
            continue
        if flat['positions'][i] == 0:
            pieces.append(([], []))
        pieces[-1][0].append(flat['inputs'][i])
        pieces[-1][1].append(flat['targets'][i])
    documents = []
    for ins, outs in pieces:
        if ins[0] == lm_inputs.EOD_ID:  # a document starts; else the piece continues one
            documents.append(([], []))
        documents[-1][0].extend(ins)
        documents[-1][1].extend(outs)
    assert len(documents) == len(texts)
    for (ins, outs), text in zip(documents, texts):
        ids = inputs.byte_tokenize(text).numpy().tolist()
        assert ins == [lm_inputs.EOD_ID] + ids and outs == ids + [lm_inputs.EOD_ID]


def test_segments_count_up_positions_restart_and_only_the_last_row_pads():
    rows = all_rows()
    for seg, pos in zip(rows['segment_ids'], rows['positions']):
        real = seg > 0
        assert seg[0] == 1 and (np.diff(seg[real]) >= 0).all()
        starts = np.flatnonzero(np.diff(np.concatenate([[0], seg])) != 0)
        for start, end in zip(starts, list(starts[1:]) + [real.sum()]):
            np.testing.assert_array_equal(pos[start:end], np.arange(end - start))
    padded = [i for i, seg in enumerate(rows['segment_ids']) if (seg == 0).any()]
    assert padded in ([], [len(rows['segment_ids']) - 1])


def test_input_position_checkpoint_resumes_at_the_next_batch(tmp_path):
    p = lm_input(split='train', shuffle_buffer=32, repeat=True)
    it = p.Instantiate().Iterator()
    next(it)
    path = tf.train.Checkpoint(iterator=it).save(str(tmp_path / 'it'))
    expected = [next(it)['inputs'].numpy() for _ in range(3)]
    fresh = p.Instantiate().Iterator()
    tf.train.Checkpoint(iterator=fresh).restore(path).assert_consumed()
    for e in expected:
        np.testing.assert_array_equal(next(fresh)['inputs'].numpy(), e)


def test_unigram_log_perplexity_is_the_entropy_of_real_targets():
    rows = all_rows()
    real = rows['segment_ids'] > 0
    counts = np.bincount(rows['targets'][real])
    probs = counts[counts > 0] / counts.sum()
    batches = lm_input(split='dev').Instantiate().EvalDataset(10 ** 6)
    np.testing.assert_allclose(
        lm_inputs.unigram_log_perplexity(batches, inputs.BYTE_VOCAB_SIZE),
        -(probs * np.log(probs)).sum(), rtol=1e-12)


def test_pystdlib_splits_are_disjoint_deterministic_and_cover_the_library():
    splits = {s: pystdlib.source_files(s) for s in pystdlib.SPLITS}
    assert splits['dev'] == pystdlib.source_files('dev')
    names = [set(files) for files in splits.values()]
    assert not (names[0] & names[1] or names[0] & names[2] or names[1] & names[2])
    assert len(splits['dev']) > 20 and len(splits['train']) > 10 * len(splits['dev'])
    assert all(f.endswith('.py') and os.path.isfile(f) for f in splits['test'])
    assert os.path.join(pystdlib.stdlib_dir(), 'os.py') in names[0] | names[1] | names[2]


@pytest.mark.parametrize('fn, message', [
    ('tests.lm_corpus.empty', 'empty corpus'),
    ('tests.lm_corpus.numbers', "feature 'text' is int32"),
])
def test_bad_corpus_is_refused_with_the_fix(fn, message):
    with pytest.raises(ValueError, match=message):
        lm_input(examples_fn=fn).Instantiate()


def test_lm_needs_a_row_length():
    with pytest.raises(ValueError, match='max_length'):
        lm_input(max_length=0).Instantiate()


def test_a_tokenizer_of_your_own_replaces_bytes():
    p = lm_input(tokenizer='tests.lm_corpus.codepoints', max_length=8)
    p.examples_fn = 'tests.lm_corpus.unicode'
    row = next(iter(p.Instantiate().EvalDataset(1)))
    text = lm_corpus.unicode('dev').get_single_element()['text'].numpy().decode()
    ids = [ord(c) + 2 for c in text]
    assert row['inputs'].numpy()[0].tolist() == [lm_inputs.EOD_ID] + ids[:7]


EVIL = """
import pathlib
pathlib.Path(__file__).with_name('ran').write_text('top level ran')


def tokenize(text):
    return text


def make(split):
    return split
"""


@pytest.mark.parametrize('key, value', [
    ('tokenizer', 'evilpkg.tok.tokenize'),
    ('examples_fn', 'evilpkg.tok.make'),
    ('examples_fn', 'builtins.exec'),  # trusted for its classes; exec(split) would run a param
])
def test_a_function_outside_the_trusted_packages_is_refused_before_its_import(
        tmp_path, monkeypatch, key, value):
    package = tmp_path / 'evilpkg'
    package.mkdir()
    (package / '__init__.py').write_text('')
    (package / 'tok.py').write_text(EVIL)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = value.rpartition('.')[0]
    with pytest.raises(ValueError, match=rf"^{key} '{re.escape(value)}' names module "
                       rf"'{module}', outside the trusted packages .*trust_package"):
        lm_input(**{key: value}).Instantiate()
    assert not (package / 'ran').exists()  # the module's top level never ran


def test_a_tokenizer_of_your_own_needs_its_detokenizer_for_text():
    assert inputs.detokenizer(lm_input()) is inputs.byte_detokenize
    with pytest.raises(ValueError, match=r"tokenizer 'tests.lm_corpus.codepoints' has no "
                       r"detokenizer.*input.train.detokenizer="):
        inputs.detokenizer(lm_input(tokenizer='tests.lm_corpus.codepoints'))
    own = lm_input(tokenizer='tests.own_vocabulary_lm.flipped',
                   detokenizer='tests.own_vocabulary_lm.unflipped')
    ids = inputs.tokenizer(own)(tf.constant('def π')).numpy().tolist()
    assert inputs.detokenizer(own)(ids) == 'def π'
