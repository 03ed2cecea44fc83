"""The cheaper sampled-answer variants (issue 44): ``ModelAnswers(rows=...)`` answers part of
the batch (the term over those rows, the CE over all), ``every=k`` answers every k-th step (the
steps between are the CE alone)."""

from __future__ import annotations

import pytest
import torch
from test_candidates import causal_batch, causal_trainer, without_dropout

from bsloss.integrations.candidates import GreedyAnswers, SampledAnswers
from bsloss.integrations.huggingface import BERTScoreTerm

transformers = pytest.importorskip("transformers")
pytest.importorskip("datasets")


def counting(model):
    """``model.generate`` wrapped to record the rows of each call."""
    calls, generate = [], model.generate

    def wrapped(*args, **kwargs):
        calls.append(kwargs["input_ids"].shape[0])
        return generate(*args, **kwargs)

    model.generate = wrapped
    return calls


def step_loss(trainer, batch, step):
    trainer.state.global_step = step
    return trainer.compute_loss(trainer.model, {k: v.clone() for k, v in batch.items()})


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("rows", [2, 5])
def test_rows_of_the_whole_batch_equal_the_full_method(
    soft_loss, vocabulary_tokenizer, tmp_path, rows, fused
):
    batch = causal_batch(vocabulary_tokenizer)
    values = []
    for source in (GreedyAnswers(), GreedyAnswers(rows=rows)):
        trainer = causal_trainer(
            soft_loss,
            vocabulary_tokenizer,
            tmp_path,
            bertscore_candidates=source,
            bertscore_fused=fused,
        )
        without_dropout(trainer.model).train()
        calls = counting(trainer.model)
        values.append(step_loss(trainer, batch, 3))
        assert calls == [2]
    assert torch.allclose(values[0], values[1], atol=1e-6)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("step", [0, 1])
def test_a_subset_answers_its_rows_only(soft_loss, vocabulary_tokenizer, tmp_path, step, fused):
    """rows=1 of 2: one row generated (row ``step`` by the rotation); the loss is the CE over
    both rows plus the term over the answered row alone."""
    batch = causal_batch(vocabulary_tokenizer)
    trainer = causal_trainer(
        soft_loss,
        vocabulary_tokenizer,
        tmp_path,
        bertscore_fused=fused,
        bertscore_candidates=GreedyAnswers(rows=1),
    )
    model = without_dropout(trainer.model).train()
    calls = counting(model)
    value = step_loss(trainer, batch, step)
    assert calls == [1]

    # by hand: the CE of the whole batch, the term of the answered row's batch run alone
    labels = batch["labels"]
    outputs = {
        "logits": model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    }
    ce = BERTScoreTerm(soft_loss, vocabulary_tokenizer, weight=0.0)(outputs, labels)
    row = slice(step, step + 1)
    alone = {k: v[row] for k, v in batch.items() if k != "labels"}
    joint = GreedyAnswers().answer(
        model,
        alone,
        labels[row],
        causal=True,
        pad_token_id=vocabulary_tokenizer.pad_token_id,
        eos_token_ids=[vocabulary_tokenizer.sep_token_id],
    )
    own, answers = joint.split(model(**joint.inputs).logits)
    term = BERTScoreTerm(soft_loss, vocabulary_tokenizer, weight=1.0, ce_weight=0.0)(
        {"logits": own},
        labels[row],
        candidate_outputs={"logits": answers},
        candidate_labels=joint.candidate_labels,
    )
    assert abs(value.item() - (ce + term).item()) < 1e-5


def test_rows_rotate_over_the_batch():
    source = SampledAnswers(rows=3)
    seen = [source.answered_rows(8, step).tolist() for step in range(3)]
    assert seen == [[0, 1, 2], [3, 4, 5], [6, 7, 0]]
    assert source.answered_rows(3, 0) is None  # a batch of at most rows: answered whole
    # with every=k the rotation counts answering steps
    assert SampledAnswers(rows=2, every=2).answered_rows(4, 2).tolist() == [2, 3]


def test_every_k_answers_on_steps_0_k_2k(soft_loss, vocabulary_tokenizer, tmp_path):
    batch = causal_batch(vocabulary_tokenizer)
    trainer = causal_trainer(
        soft_loss, vocabulary_tokenizer, tmp_path, bertscore_candidates=GreedyAnswers(every=2)
    )
    model = without_dropout(trainer.model).train()
    calls = counting(model)
    answered = []
    for step in range(5):
        before = len(calls)
        value = step_loss(trainer, batch, step)
        answered.append(len(calls) > before)
        if step % 2:  # between answering steps: the CE alone
            outputs = {
                "logits": model(
                    input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
                ).logits
            }
            ce = BERTScoreTerm(soft_loss, vocabulary_tokenizer, weight=0.0)(
                outputs, batch["labels"]
            )
            assert abs(value.item() - ce.item()) < 1e-5
    assert answered == [True, False, True, False, True]


def test_subset_options_are_checked_named():
    for field in ("rows", "every"):
        with pytest.raises(ValueError, match=rf"SampledAnswers\({field}\)"):
            SampledAnswers(**{field: 0})
        for bad in (True, 2.0, "2"):
            with pytest.raises(TypeError, match=rf"SampledAnswers\({field}\)"):
                SampledAnswers(**{field: bad})
    np = pytest.importorskip("numpy")
    assert SampledAnswers(rows=np.int64(2), every=np.int32(3)) == SampledAnswers(rows=2, every=3)
