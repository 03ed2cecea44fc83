"""bsloss equals the reference implementation bert_score 0.3.13 (batch_size=1, where bert_score
has no padding artifact) on all 1,500 STS-B dev pairs with the embedded model at layer 6."""

from __future__ import annotations

import pytest
import torch

bert_score = pytest.importorskip("bert_score")

import bsloss  # noqa: E402
from bsloss.baseline import shipped_baseline_path  # noqa: E402
from bsloss.scorer.default import DEFAULT_MODEL_NAME, embedded_model_path  # noqa: E402

TOLERANCE = 1e-5


def _reference_scorer(**kwargs):
    return bert_score.BERTScorer(
        model_type=embedded_model_path(), num_layers=6, batch_size=1, **kwargs
    )


def _assert_equal(ours, theirs):
    for name, a, b in zip("PRF", ours, theirs, strict=True):
        assert a.shape == b.shape
        gap = (a - b.float()).abs().max().item()
        assert gap <= TOLERANCE, f"{name}: max |bsloss - bert_score| = {gap:.2e}"


@pytest.fixture(scope="module", autouse=True)
def _encode_each_sentence_once():
    """bert_score at batch_size=1 runs its model once per distinct sentence, and each test of
    this module runs it again on the same 3,000 sentences (most of the module's time). Without
    padding a sentence's hidden states depend on its token ids alone, so its model call is
    remembered across tests; everything else bert_score does (tokenising, idf weights, greedy
    matching, several references, rescaling) runs as it is. Only batch_size=1 calls are kept:
    padded rows stay computed, their artifact is what a test here checks."""
    encode = bert_score.utils.bert_encode
    seen: dict[tuple, torch.Tensor] = {}

    def remembered(model, x, attention_mask, all_layers=False):
        if x.shape[0] != 1 or not bool(attention_mask.all()):
            return encode(model, x, attention_mask=attention_mask, all_layers=all_layers)
        key = (model.config.name_or_path, len(model.encoder.layer), all_layers, *x[0].tolist())
        if key not in seen:
            seen[key] = encode(model, x, attention_mask=attention_mask, all_layers=all_layers)
        return seen[key].clone()

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(bert_score.utils, "bert_encode", remembered)
        yield


@pytest.fixture(scope="module")
def pairs(stsb_dev):
    return [s1 for _, s1, _ in stsb_dev], [s2 for _, _, s2 in stsb_dev]


@pytest.fixture(scope="module")
def plain_reference(pairs):
    """bert_score's plain scores at batch_size=1, computed once: two tests compare with them."""
    return _reference_scorer().score(*pairs, batch_size=1)


def test_plain(pairs, plain_reference):
    cands, refs = pairs
    _assert_equal(bsloss.BERTScorer(num_layers=6).score(cands, refs), plain_reference)


def test_idf_from_references(pairs):
    cands, refs = pairs
    theirs = _reference_scorer(idf=True, idf_sents=refs).score(cands, refs, batch_size=1)
    _assert_equal(bsloss.BERTScorer(num_layers=6, idf=refs).score(cands, refs), theirs)
    # idf=True computes the same weights from each call's references, as bert_score.score does.
    _assert_equal(bsloss.BERTScorer(num_layers=6, idf=True).score(cands, refs), theirs)


def test_rescaled(pairs):
    cands, refs = pairs
    baseline = str(shipped_baseline_path(DEFAULT_MODEL_NAME))
    theirs = _reference_scorer(rescale_with_baseline=True, lang="en", baseline_path=baseline).score(
        cands, refs, batch_size=1
    )
    ours = bsloss.BERTScorer(num_layers=6, rescale_with_baseline=True).score(cands, refs)
    _assert_equal(ours, theirs)


def test_multiple_references(pairs):
    cands, refs = pairs
    n = len(cands)
    # Two or three references per candidate: its own, an unrelated one, sometimes a third.
    groups = [
        [refs[i], cands[(i + 1) % n]] + ([refs[(i + 7) % n]] if i % 3 == 0 else [])
        for i in range(n)
    ]
    theirs = _reference_scorer().score(cands, groups, batch_size=1)
    ours = bsloss.BERTScorer(num_layers=6).score(cands, groups)
    _assert_equal(ours, theirs)
    # The max is taken independently for P, R and F: not all three from one reference.
    single = bsloss.BERTScorer(num_layers=6).score(cands, refs)
    assert torch.all(ours[2] >= single[2] - 1e-6)  # batch composition moves scores by <1e-6


def test_bert_score_batch_artifact_is_not_reproduced(pairs, plain_reference):
    """bert_score with batch_size > 1 multiplies padded similarity cells by 0, which clamps a
    token's max at 0; bsloss masks padded cells out and so agrees with batch_size=1."""
    cands, refs = pairs
    padded = _reference_scorer().score(cands, refs, batch_size=64)
    exact = plain_reference
    ours = bsloss.BERTScorer(num_layers=6, batch_size=64).score(cands, refs)
    changed = (padded[2] - exact[2]).abs() > 1e-4
    assert changed.sum() > 0, "expected bert_score's padding artifact on STS-B dev"
    assert (ours[2] - exact[2]).abs().max() <= TOLERANCE


def test_an_idf_dict_is_used_as_given(pairs):
    """bert_score.score(idf=<dict>) weighs every token, the special ones included, by the dict
    (its default for a defaultdict); bsloss forced [CLS] and [SEP] to 0, and F moved by up to
    0.16 for a defaultdict(lambda: 1.0) (audit h34)."""
    from collections import defaultdict

    cands, refs = (side[:200] for side in pairs)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(embedded_model_path())
    rare = tokenizer.convert_tokens_to_ids(["cat", "man", "woman", "dog"])
    hand_made = defaultdict(lambda: 1.0, {token: 2.5 for token in rare})
    counted = bert_score.utils.get_idf_dict(refs, tokenizer, nthreads=1)
    counted[tokenizer.cls_token_id], counted[tokenizer.sep_token_id] = 0.3, 0.7
    for idf in (hand_made, counted):
        theirs = bert_score.score(
            cands, refs, model_type=embedded_model_path(), num_layers=6, batch_size=1, idf=idf
        )
        _assert_equal(bsloss.score(cands, refs, num_layers=6, idf=idf), theirs)
