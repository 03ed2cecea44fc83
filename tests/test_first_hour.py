"""What a new user hits first (issue 24): candidate ids as a tokenizer returns them, multi-process
scoring without a process group, the docs' torchrun script as written, and bert_score's helpers
that a migrating script imports."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_readme import code_blocks

import bsloss

REPO = Path(__file__).resolve().parents[1]
CANDS = ["the cat sat on the mat today", "a dog ran"]
REFS = ["a cat was sitting on the mat", "the dog runs in a park"]


@pytest.fixture(scope="module")
def hard_loss(scorer):
    return bsloss.BERTScoreLoss(encoder=scorer.encoder, matching="hard")


def test_candidate_ids_with_the_tokenizers_special_tokens(scorer, hard_loss):
    """ids from tokenizer(texts), [CLS]/[SEP]/[PAD] included, score as the metric does (they
    are skipped: the loss adds its own), with or without the attention mask."""
    tokenizer = scorer.encoder.tokenizer
    metric_f = scorer.score(CANDS, REFS)[2]
    with_special = tokenizer(CANDS, return_tensors="pt", padding=True)
    bare = tokenizer(CANDS, return_tensors="pt", padding=True, add_special_tokens=False)
    assert with_special["input_ids"][0, 0] == tokenizer.cls_token_id
    for batch in (with_special, bare):
        ids, mask = batch["input_ids"], batch["attention_mask"].bool()
        torch.testing.assert_close(
            hard_loss.score(candidate_ids=ids, candidate_mask=mask, references=REFS).f1,
            metric_f,
            atol=1e-5,
            rtol=0,
        )
    unmasked = hard_loss.score(candidate_ids=with_special["input_ids"], references=REFS).f1
    torch.testing.assert_close(unmasked, metric_f, atol=1e-5, rtol=0)


def test_distributed_without_a_process_group_warns_once(scorer):
    import torch.distributed as dist

    assert not (dist.is_available() and dist.is_initialized())
    distributed = bsloss.BERTScorer(encoder=scorer.encoder, distributed=True)
    with pytest.warns(UserWarning, match=r"torchrun --nproc_per_node N.*init_process_group"):
        F = distributed.score(CANDS, REFS)[2]
    torch.testing.assert_close(F, scorer.score(CANDS, REFS)[2])  # scored locally
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        distributed.score(CANDS, REFS)  # once per scorer
        bsloss.BERTScorer(encoder=scorer.encoder).score(CANDS, REFS)  # not asked for


def docs_block(path: str, marker: str) -> str:
    (block,) = [
        b.code for b in code_blocks(REPO / path) if b.language == "python" and marker in b.code
    ]
    return block


def test_docs_torchrun_script_as_written(tmp_path, scorer):
    """docs/metric.md's multi-process script, run with the command its first line names."""
    script = docs_block("docs/metric.md", "torchrun --nproc_per_node")
    command = re.search(r"started as: (torchrun .*)", script).group(1).split()
    assert command[:3] == ["torchrun", "--nproc_per_node", "2"]
    (tmp_path / command[-1]).write_text(script)
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(REPO),
    }
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", *command[1:]],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # the scores' list (torch 2.8's gloo also prints "[Gloo] Rank 0 is connected ..." lines)
    printed = [line for line in done.stdout.splitlines() if re.fullmatch(r"\[[-+0-9.e, ]*\]", line)]
    assert len(printed) == 1  # rank 0 only
    namespace: dict = {}
    exec(script.split("scorer = ")[0].replace('dist.init_process_group("gloo")', ""), namespace)
    expected = scorer.score(namespace["cands"], namespace["refs"])[2]
    torch.testing.assert_close(torch.tensor(eval(printed[0])), expected, atol=1e-6, rtol=0)
    assert "no torch.distributed process group" not in done.stderr


def test_bert_score_utils_helpers_have_its_signatures_and_values(scorer):
    """``from bsloss.utils import ...`` for what scripts import from bert_score.utils: the same
    parameters (names, order, defaults) and, where bsloss can compute them, the same values."""
    import inspect

    bert_score_utils = pytest.importorskip("bert_score.utils")
    import bsloss.utils as ours

    for name in ("sent_encode", "get_idf_dict", "get_hash", "get_tokenizer", "get_model"):
        theirs = inspect.signature(getattr(bert_score_utils, name)).parameters
        mine = inspect.signature(getattr(ours, name)).parameters
        assert [(p.name, p.default) for p in mine.values()] == [
            (p.name, p.default) for p in theirs.values()
        ], name
    tokenizer = scorer.encoder.tokenizer
    sentences = ["a cat sat on the mat", "a dog ran", " the cat ", ""]
    for sent in sentences[:-1]:
        assert ours.sent_encode(tokenizer, sent) == bert_score_utils.sent_encode(tokenizer, sent)
    # bert_score's empty sentence calls a method transformers 5 removed: [CLS] [SEP] here
    assert ours.sent_encode(tokenizer, "") == [tokenizer.cls_token_id, tokenizer.sep_token_id]
    mine, theirs = (
        ours.get_idf_dict(sentences[:-1], tokenizer),
        bert_score_utils.get_idf_dict(sentences[:-1], tokenizer, nthreads=0),
    )
    assert dict(mine) == pytest.approx(dict(theirs)) and mine[12345] == theirs[12345]
    for lang in ("en", "zh", "tr", "en-sci", "de", "fr"):
        assert ours.lang2model[lang] == bert_score_utils.lang2model[lang]
    shared = set(ours.model2layers) & set(bert_score_utils.model2layers)
    assert {"roberta-large", "bert-base-uncased", "xlm-roberta-large"} <= shared
    assert all(ours.model2layers[m] == bert_score_utils.model2layers[m] for m in shared)
    args = ("roberta-large", 17, True, True, False, True)
    mine, theirs = ours.get_hash(*args), bert_score_utils.get_hash(*args)
    assert mine.split("_version=")[0] == theirs.split("_version=")[0]
    assert mine.endswith("-rescaled_fast-tokenizer") and theirs.endswith("-rescaled_fast-tokenizer")
    rescaled = bsloss.BERTScorer(encoder=scorer.encoder, rescale_with_baseline=True)
    assert rescaled.hash == ours.get_hash(rescaled.model_type, 6, False, True, False, False)
    model = ours.get_model(None, 3)
    assert model.config.num_hidden_layers == 3 and not model.training
    assert ours.get_tokenizer(None).get_vocab() == tokenizer.get_vocab()


def test_plot_example_takes_bert_score_positional_arguments(tmp_path, monkeypatch, scorer):
    """bert_score's order: (candidate, reference, model_type, num_layers, lang,
    rescale_with_baseline, baseline_path, use_fast_tokenizer, fname)."""
    import inspect

    pytest.importorskip("matplotlib")
    bert_score = pytest.importorskip("bert_score")
    theirs = list(inspect.signature(bert_score.plot_example).parameters)
    mine = list(inspect.signature(bsloss.plot_example).parameters)
    assert mine[: len(theirs)] == theirs
    from bsloss.scorer.default import embedded_model_path

    out = tmp_path / "pair.png"
    figure = bsloss.plot_example("a cat sat", "the cat sits", embedded_model_path(), 4, None,
                                 False, None, False, str(out))  # fmt: skip
    assert out.stat().st_size > 1000 and figure.axes
    assert bsloss.plot_example("a cat sat", "the cat sits", scorer).axes  # a scorer, positional
