"""The Hugging Face integration: the BERTScore term in a real Trainer, Seq2SeqTrainer and TRL
SFTTrainer (2 optimisation steps each on tiny randomly initialised models that use the embedded
scorer's tokenizer), its gradient-accumulation normalisation, and the compute_metrics helper."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from _helpers import sft_completions, tiny_training_arguments
from _models import scorer_vocabulary_tokenizer, tiny_bert2bert, tiny_gpt2

import bsloss
from bsloss import BERTScoreLoss
from bsloss.integrations import huggingface as hf
from bsloss.integrations.huggingface import (
    BERTScoreTerm,
    BERTScoreTrainerMixin,
    bertscore_compute_metrics,
)
from bsloss.integrations.term_weights import Fixed, TermWeight

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

PROMPTS = ["Summarize: the cat sat on the mat.", "Summarize: a dog ran in the park."]
REFERENCES = ["The cat sat.", "A dog ran."]


@pytest.fixture(scope="module")
def loss(scorer):
    return bsloss.BERTScoreLoss(encoder=scorer.encoder)


@pytest.fixture(scope="module")
def tokenizer(scorer):
    return scorer_vocabulary_tokenizer(scorer)


def causal_batch(tokenizer):
    """Prompt + reference + [SEP], labels -100 on the prompt and the padding."""
    rows, labels = [], []
    for prompt, reference in zip(PROMPTS, REFERENCES, strict=True):
        p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        r = tokenizer(reference, add_special_tokens=False)["input_ids"] + [tokenizer.sep_token_id]
        rows.append(p + r)
        labels.append([-100] * len(p) + r)
    width = max(map(len, rows))
    pad = tokenizer.pad_token_id
    return {
        "input_ids": torch.tensor([r + [pad] * (width - len(r)) for r in rows]),
        "attention_mask": torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows]),
        "labels": torch.tensor([r + [-100] * (width - len(r)) for r in labels]),
    }


def test_term_adds_up_over_gradient_accumulation(loss, tokenizer):
    """Two micro-batches with the trainer's num_items_in_batch give the loss and gradients of
    the whole batch: CE per completion token plus the token-weighted mean of 1 - F."""
    torch.manual_seed(1)
    labels = causal_batch(tokenizer)["labels"]
    logits = torch.randn(*labels.shape, len(tokenizer), requires_grad=True)
    term = BERTScoreTerm(loss, tokenizer, weight=0.7, causal=True)
    whole = term({"logits": logits}, labels)
    (grad_whole,) = torch.autograd.grad(whole, logits)
    total = int((labels[:, 1:] != -100).sum())
    parts = [term({"logits": logits[i : i + 1]}, labels[i : i + 1], total) for i in (0, 1)]
    (grad_parts,) = torch.autograd.grad(sum(parts), logits)
    assert abs(sum(parts).item() - whole.item()) < 1e-5
    assert (grad_parts - grad_whole).abs().max().item() < 1e-6
    # against the formula, term by term
    mask = labels[:, 1:] != -100
    ce = torch.nn.functional.cross_entropy(logits[:, :-1][mask], labels[:, 1:][mask])
    f = loss.score(logits=logits[:, :-1], candidate_mask=mask, references=REFERENCES).f1
    expected = ce + 0.7 * ((1 - f) * mask.sum(1)).sum() / total
    assert abs(whole.item() - expected.item()) < 1e-5


def test_an_empty_candidate_scores_zero_and_counts_as_one_token(loss, tokenizer):
    """A row that has a completion but an empty candidate (an answer of no token) scores F = 0
    (the loss's rule for an empty candidate) and counts as one token in the term's mean, on the
    dense and the fused path alike: answering nothing is the term's worst value (before: the
    row was dropped and added 0, the term's best)."""
    from bsloss.integrations.lm_head import lm_head_inputs, token_cross_entropy

    model = tiny_gpt2(tokenizer).eval()
    batch = causal_batch(tokenizer)
    labels = batch.pop("labels")
    own = labels.clone()
    own[1] = -100  # row 1 answered nothing
    term = BERTScoreTerm(loss, tokenizer, weight=1.0, causal=True)
    values = []
    for fused in (False, True):
        if fused:
            with lm_head_inputs(model) as head:
                outputs = model(**batch)
        else:
            head, outputs = None, model(**batch)
        values.append(term(outputs, labels, head=head, candidate_outputs=outputs,
                           candidate_labels=own))  # fmt: skip
    f_logged = term.pop_metrics()["bertscore_f"]
    with torch.no_grad():
        logits = model(**batch).logits[:, :-1]
        ce = token_cross_entropy(labels[:, 1:], logits=logits)
        candidates = own[:1, 1:] != -100
        f0 = loss.score(logits=logits[:1], candidate_mask=candidates,
                        references=term.references_from_labels(labels[:1])).f1[0]  # fmt: skip
    tokens = candidates.sum()
    expected = ce + ((1 - f0) * tokens + 1.0) / (tokens + 1)
    for value in values:
        torch.testing.assert_close(value, expected, rtol=1e-5, atol=1e-5)
    assert f_logged == pytest.approx(f0.item() / 2, abs=1e-5)  # F = 0 for row 1, in the mean


def test_references_are_decoded_once_and_cached(loss, tokenizer, monkeypatch):
    labels = causal_batch(tokenizer)["labels"]
    term = BERTScoreTerm(loss, tokenizer, causal=False)
    calls = []
    decode = tokenizer.decode
    monkeypatch.setattr(tokenizer, "decode", lambda ids, **kw: calls.append(1) or decode(ids, **kw))
    first = term.references_from_labels(labels)
    again = term.references_from_labels(labels)
    assert first == again == ["the cat sat.", "a dog ran."]
    assert len(calls) == 2


def test_term_rejects_bad_input(loss, tokenizer):
    with pytest.raises(TypeError, match="BERTScoreLoss"):
        BERTScoreTerm(object(), tokenizer)
    term = BERTScoreTerm(loss, tokenizer, causal=False)
    with pytest.raises(ValueError, match="do not match the logits"):
        term({"logits": torch.randn(2, 5, len(tokenizer))}, torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="needs labels"):
        term({"logits": torch.randn(2, 5, len(tokenizer))}, None)


@pytest.mark.parametrize(
    "rows, answers, error, message",
    [
        ([5], 1, ValueError, r"candidate_rows\[0\] is 5: outside the batch's rows 0\.\.1"),
        ([-1], 1, ValueError, r"candidate_rows\[0\] is -1: outside"),
        ([0, 0], 2, ValueError, r"candidate_rows\[1\] repeats row 0 \(candidate_rows\[0\]\)"),
        ([0.0], 1, TypeError, r"candidate_rows must have an integer dtype, got torch\.float32"),
        ([[0]], 1, ValueError, r"candidate_rows must be \[R\] row indices, got shape \[1, 1\]"),
        ("list", 1, TypeError, r"candidate_rows must be a torch\.Tensor, got list"),
        ([1], 0, ValueError, r"pass it with candidate_outputs and candidate_labels"),
    ],
    ids=["past-the-batch", "negative", "repeated", "float", "2-d", "list", "no-candidates"],
)
def test_bad_candidate_rows_are_named_and_the_term_works_after(
    loss, tokenizer, rows, answers, error, message
):
    """``candidate_rows`` outside the batch raised torch's ``IndexError`` (``-1`` silently
    scored the last row), a float tensor an ``IndexError``, a list ``AttributeError``, and a
    row answered twice was taken (audit h22, N3)."""
    term = BERTScoreTerm(loss, tokenizer, causal=False)
    labels = torch.tensor([tokenizer("a cat sat", add_special_tokens=False)["input_ids"]] * 2)
    logits = torch.randn(2, labels.shape[1], len(tokenizer), requires_grad=True)
    candidates = {}
    if answers:
        candidates = {"candidate_outputs": {"logits": logits[:answers]}}
        candidates["candidate_labels"] = labels[:answers]
    given = [1] if rows == "list" else torch.tensor(rows)
    with pytest.raises(error, match=message):
        term({"logits": logits}, labels, candidate_rows=given, **candidates)
    candidates = {"candidate_outputs": {"logits": logits[:1]}, "candidate_labels": labels[:1]}
    value = term({"logits": logits}, labels, candidate_rows=torch.tensor([1]), **candidates)
    assert torch.isfinite(value)
    narrow = torch.tensor([1], dtype=torch.uint8)  # indexes as a mask if used as it is
    assert torch.equal(term({"logits": logits}, labels, candidate_rows=narrow, **candidates), value)


@pytest.mark.parametrize("fused", [False, True], ids=["dense", "fused"])
@pytest.mark.parametrize("weight", [1.0, 0.0], ids=["term", "ce-alone"])
def test_a_label_outside_the_vocabulary_is_named_where_the_caller_put_it(
    loss, tokenizer, fused, weight
):
    """A label id outside the model's vocabulary failed in torch's CE on the dense path
    (``IndexError: Target 30527 is out of bounds``; on a GPU a device-side assert, which breaks
    the process's CUDA context), and was named one place too early on the fused path (the
    model's labels are shifted by one), as ``target_ids`` and by its row among the scored rows.
    Each path names it ``labels[b, t]``, t in the labels given, and the term works after."""
    from bsloss.integrations.lm_head import lm_head_inputs

    model = tiny_gpt2(tokenizer)
    batch = causal_batch(tokenizer)
    vocab = model.get_output_embeddings().weight.shape[0]
    bad = batch["labels"].clone()
    position = int((bad[1] != -100).nonzero()[1])
    bad[1, position] = vocab + 5
    term = BERTScoreTerm(loss, tokenizer, weight=weight)

    def step(labels):
        inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}
        if not fused:
            return term(model(**inputs), labels)
        with lm_head_inputs(model) as head:
            outputs = model(**inputs)
        return term(outputs, labels, head=head)

    where = re.escape(f"outside [0, {vocab}) (the model's vocabulary; and not -100) at ")
    with pytest.raises(ValueError, match=where + rf"labels\[1, {position}\]$"):
        step(bad)
    assert torch.isfinite(step(batch["labels"]))


def test_token_cross_entropy_names_a_label_outside_the_vocabulary():
    """The dense branch left the check to torch (an IndexError without a place; a device-side
    assert on a GPU); the hidden-states branch already named it."""
    from bsloss.integrations.lm_head import token_cross_entropy

    labels = torch.tensor([[1, 2, -100], [3, 12, 5]])
    with pytest.raises(ValueError, match=r"outside \[0, 10\) \(and not -100\) at labels\[1, 1\]"):
        token_cross_entropy(labels, logits=torch.randn(2, 3, 10))
    with pytest.raises(ValueError, match=r"at labels\[1, 1\]"):
        token_cross_entropy(labels, hidden_states=torch.randn(2, 3, 4), head=torch.randn(10, 4))
    labels[1, 1] = 9
    assert torch.isfinite(token_cross_entropy(labels, logits=torch.randn(2, 3, 10)))


def training_args(tmp_path, cls=None, **extra):
    return tiny_training_arguments(tmp_path, cls, **{"gradient_accumulation_steps": 2, **extra})


def changed(model, before) -> bool:
    return any(not torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_trainer_with_compute_loss_func(loss, tokenizer, tmp_path):
    """Trainer(compute_loss_func=BERTScoreTerm): the trainer passes num_items_in_batch."""
    model = tiny_gpt2(tokenizer)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    batch = causal_batch(tokenizer)
    rows = [{k: v[i].tolist() for k, v in batch.items()} for i in range(2)] * 4
    term = BERTScoreTerm(loss, tokenizer, causal=True)
    seen = []

    def recorded(outputs, labels, num_items_in_batch=None):
        seen.append(num_items_in_batch)
        return term(outputs, labels, num_items_in_batch)

    trainer = transformers.Trainer(
        model=model,
        args=training_args(tmp_path),
        train_dataset=datasets.Dataset.from_list(rows),
        compute_loss_func=recorded,
    )
    trainer.train()
    assert len(seen) == 4  # 2 steps x 2 accumulated micro-batches
    completion = int((batch["labels"][:, 1:] != -100).sum())
    assert all(int(n) == 2 * completion for n in seen)  # both micro-batches' tokens
    assert changed(model, before)
    assert 0 < term.pop_metrics()["bertscore_f"] <= 1


def test_seq2seq_trainer_mixin_with_reference_column(loss, tokenizer, tmp_path):
    """Seq2SeqTrainer + mixin on a tiny BERT2BERT: references from a dataset column (here
    deliberately different from the labels), CE and F logged as separate metrics."""

    class Trainer(BERTScoreTrainerMixin, transformers.Seq2SeqTrainer):
        pass

    model = tiny_bert2bert(tokenizer)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    rows = []
    for prompt, reference in zip(PROMPTS, REFERENCES, strict=True):
        rows.append(
            {
                "input_ids": tokenizer(prompt)["input_ids"],
                "labels": tokenizer(reference)["input_ids"][1:],
                "reference": reference.upper() + " indeed",
            }
        )
    trainer = Trainer(
        model=model,
        args=training_args(tmp_path, transformers.Seq2SeqTrainingArguments),
        train_dataset=datasets.Dataset.from_list(rows * 4),
        data_collator=transformers.DataCollatorForSeq2Seq(tokenizer, model=model),
        processing_class=tokenizer,
        bertscore_loss=loss,
        bertscore_weight=2.0,
        bertscore_reference_column="reference",
    )
    seen = []
    # the training step's one chunked pass (bertscore_fused, the default for a model with an
    # LM head): its references are recorded
    score = loss.score_and_cross_entropy

    def recording(*args, **kwargs):
        seen.append(list(kwargs["references"]))
        return score(*args, **kwargs)

    loss.score_and_cross_entropy = recording
    try:
        trainer.train()
    finally:
        del loss.score_and_cross_entropy
    assert len(seen) == 4 and all(r.endswith(" indeed") for refs in seen for r in refs)
    logged = [e for e in trainer.state.log_history if "bertscore_f" in e]
    assert len(logged) == 2 and all("ce" in e and e["ce"] > 0 for e in logged)
    assert changed(model, before)
    metrics = trainer.evaluate(datasets.Dataset.from_list(rows))
    assert 0 < metrics["eval_bertscore_f"] <= 1 and metrics["eval_ce"] > 0


def test_sft_trainer_mixin(loss, tokenizer, tmp_path):
    trl = pytest.importorskip("trl")

    class Trainer(BERTScoreTrainerMixin, trl.SFTTrainer):
        pass

    model = tiny_gpt2(tokenizer)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    data = datasets.Dataset.from_dict({"prompt": PROMPTS * 4, "completion": REFERENCES * 4})
    args = training_args(tmp_path, trl.SFTConfig, max_length=48, bf16=False)
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=data,
        processing_class=tokenizer,
        bertscore_loss=loss,
    )
    trainer.train()
    logged = [e for e in trainer.state.log_history if "bertscore_f" in e]
    assert len(logged) == 2
    assert all(0 < e["bertscore_f"] <= 1 and e["ce"] > 0 for e in logged)
    assert all(np.isfinite(e["loss"]) for e in trainer.state.log_history if "loss" in e)
    assert changed(model, before)
    # the references were the completions TRL trains on (prompt tokens are -100 in SFT's
    # labels): each the end of a reference text, the whole of it under TRL > 0.20
    decoded = {d.replace(" [SEP]", "") for d in trainer.bertscore_term._decoded.values()}
    completions = sft_completions(trainer.train_dataset, tokenizer)
    assert len(completions) == len(REFERENCES) and completions <= decoded, (completions, decoded)
    assert all(any(r.lower().endswith(c) for r in REFERENCES) for c in completions)


def test_compute_metrics_scores_predict_outputs(scorer, tokenizer, tmp_path):
    model = tiny_gpt2(tokenizer)
    batch = causal_batch(tokenizer)
    rows = [{k: v[i].tolist() for k, v in batch.items()} for i in range(2)]
    metrics = bertscore_compute_metrics(tokenizer, scorer, causal=True)
    trainer = transformers.Trainer(
        model=model, args=training_args(tmp_path), compute_metrics=metrics
    )
    out = trainer.predict(datasets.Dataset.from_list(rows))
    assert {"test_bertscore_precision", "test_bertscore_recall", "test_bertscore_f1"} <= set(
        out.metrics
    )
    # a causal LM's position t predicts label t + 1; only the labelled positions are its answer
    predicted, labels = out.predictions.argmax(-1)[:, :-1], out.label_ids[:, 1:]
    cands = [tokenizer.decode(p[y != -100], skip_special_tokens=True).strip()
             for p, y in zip(predicted, labels, strict=True)]  # fmt: skip
    refs = [tokenizer.decode(y[y != -100], skip_special_tokens=True).strip() for y in labels]
    expected = scorer.score(cands, refs)[2].mean().item()
    assert abs(out.metrics["test_bertscore_f1"] - expected) < 1e-6
    # identical ids score 1
    same = bertscore_compute_metrics(tokenizer, scorer)
    assert same((out.label_ids, out.label_ids))["bertscore_f1"] == pytest.approx(1.0, abs=1e-6)


def _word_tokenizer(pad: bool):
    """A vocabulary whose id 0 is an ordinary word, as GPT-2's and Qwen's "!"."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["!", "<eos>", "the", "cat", "sat", "a", "dog", "ran"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<eos>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<eos>", pad_token="<eos>" if pad else None
    )


def _one_hot_logits(rows, width, vocab=8):
    """Logits whose argmax is each row's ids, padded with -100 (as the evaluation loop pads
    batches of different lengths)."""
    logits = np.full((len(rows), width, vocab), -100.0, dtype=np.float32)
    for b, row in enumerate(rows):
        for t, token in enumerate(row):
            logits[b, t] = -5.0
            logits[b, t, token] = 5.0
    return logits


@pytest.mark.parametrize("pad", [True, False], ids=["pad-token", "no-pad-token"])
def test_compute_metrics_decodes_only_what_the_labels_mark(scorer, pad):
    """Teacher-forced logits were decoded at every position: the evaluation loop's -100 padding
    (argmax 0: "!" in GPT-2's vocabulary) and the prompt's or padding's predictions joined the
    answer (F 0.910 and 0.896 for predictions equal to the labels); generated ids and labels
    had -100 mapped to the padding id, or to 0 without one. Each now decodes only what the
    labels mark (teacher-forced) or what is not -100 (generated): F 1 for equal texts."""
    tokenizer = _word_tokenizer(pad)
    metrics = bertscore_compute_metrics(tokenizer, scorer)
    labels = np.array([[2, 3, 4, -100, -100], [5, 6, 7, 2, 3]])
    padded = _one_hot_logits([[2, 3, 4], [5, 6, 7, 2, 3]], 5)
    assert metrics((padded, labels))["bertscore_f1"] == pytest.approx(1.0, abs=1e-6)
    predicted_past_labels = _one_hot_logits([[2, 3, 4, 6, 7], [5, 6, 7, 2, 3]], 5)
    assert metrics((predicted_past_labels, labels))["bertscore_f1"] == pytest.approx(1.0, abs=1e-6)
    assert metrics((labels, labels))["bertscore_f1"] == pytest.approx(1.0, abs=1e-6)
    # argmax ids from preprocess_logits_for_metrics, a causal LM's: position t predicts t + 1
    shifted = np.array([[3, 4, 6, 0, 0], [6, 7, 2, 3, 0]])
    causal = bertscore_compute_metrics(tokenizer, scorer, causal=True)
    assert causal((shifted, labels))["bertscore_f1"] == pytest.approx(1.0, abs=1e-6)
    with pytest.raises(ValueError, match=r"must be \[N, L\] as the labels, \[2, 5\]; got \[2, 4\]"):
        metrics((padded[:, :4], labels))
    with pytest.raises(ValueError, match="causal=True is for teacher-forced"):
        bertscore_compute_metrics(tokenizer, scorer, teacher_forced=False, causal=True)
    # teacher_forced=False said of generated ids was read as True: decoded at the labels'
    # positions only (F 1.0 for an answer that goes on past the reference), and another
    # width than the labels' refused as "teacher-forced predictions must be [N, L]"
    generated = bertscore_compute_metrics(tokenizer, scorer, teacher_forced=False)
    longer = np.array([[2, 3, 4, 6, 7], [5, 6, 7, 2, 3]])
    f1 = generated((longer, labels))["bertscore_f1"]
    assert f1 == pytest.approx(metrics((longer, labels))["bertscore_f1"], abs=1e-6)
    assert f1 < 0.99
    wider = np.array([[2, 3, 4, -100, -100, -100], [5, 6, 7, 2, 3, -100]])  # the loop's padding
    assert generated((wider, labels))["bertscore_f1"] == pytest.approx(1.0, abs=1e-6)


def test_mixin_needs_the_tokenizer(loss, tokenizer, tmp_path):
    class Trainer(BERTScoreTrainerMixin, transformers.Trainer):
        pass

    with pytest.raises(ValueError, match="processing_class"):
        Trainer(model=tiny_gpt2(tokenizer), args=training_args(tmp_path), bertscore_loss=loss)


# --------------------------------------------------------------------------- term weights
def test_balanced_weight_value_and_gradient(scorer):
    """Balanced(lam): the loss is CE + lam * sg(CE / term) * term, so its value is (1 + lam) CE
    and its gradient grad CE + lam (CE / term) grad term (EMO's balance); Fixed(lam) and the
    plain number lam give CE + lam * term."""
    from bsloss.integrations.term_weights import Balanced, Fixed

    loss = bsloss.BERTScoreLoss(encoder=scorer.encoder)
    tokenizer = loss.encoder.tokenizer
    labels = torch.tensor([tokenizer("a cat sat on the mat")["input_ids"][1:-1]])
    torch.manual_seed(0)
    base = torch.randn(1, labels.shape[1], tokenizer.vocab_size)

    def parts(logits):
        ce = torch.nn.functional.cross_entropy(logits[0], labels[0])
        f = loss.score(logits=logits, references=["a cat sat on the mat"]).f1
        return ce, 1 - f.mean()

    logits = base.clone().requires_grad_(True)
    ce, term = parts(logits)
    grad_ce = torch.autograd.grad(ce, logits, retain_graph=True)[0]
    grad_term = torch.autograd.grad(term, logits)[0]
    for weight, factor in [
        (Balanced(0.5), 0.5 * ce.item() / term.item()),
        (Fixed(0.5), 0.5),
        (0.5, 0.5),
    ]:
        term_fn = BERTScoreTerm(loss, tokenizer, weight=weight, causal=False)
        logits = base.clone().requires_grad_(True)
        value = term_fn({"logits": logits}, labels)
        value.backward()
        torch.testing.assert_close(value, ce + factor * term, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(logits.grad, grad_ce + factor * grad_term, rtol=1e-4, atol=1e-7)
        logged = term_fn.pop_metrics()
        if isinstance(weight, Balanced):  # the step-by-step weight is logged
            assert logged["bertscore_weight"] == pytest.approx(factor, rel=1e-5)
        else:
            assert "bertscore_weight" not in logged


def test_a_step_that_scores_no_row_logs_no_term_weight(scorer):
    """A micro-batch whose answered rows have nothing to score (the one answered row has no
    labels and an empty answer) has no term; Balanced's weight for it is CE / min_term (10,397
    against 10.6 in audit h22's run) and was logged into the window's mean. Not logged now."""
    from bsloss.integrations.term_weights import Balanced

    loss = bsloss.BERTScoreLoss(encoder=scorer.encoder)
    tokenizer = loss.encoder.tokenizer
    ids = tokenizer("a cat sat on the mat")["input_ids"][1:-1]
    labels = torch.tensor([ids, [-100] * len(ids)])
    torch.manual_seed(0)
    logits = torch.randn(2, len(ids), tokenizer.vocab_size, requires_grad=True)  # training
    answer = {"logits": torch.randn(1, len(ids), tokenizer.vocab_size, requires_grad=True)}
    term = BERTScoreTerm(loss, tokenizer, weight=Balanced(1.0), causal=False)

    def step(row: int, answer_ids: list[int]) -> torch.Tensor:
        return term(
            {"logits": logits},
            labels,
            candidate_outputs=answer,
            candidate_labels=torch.tensor([answer_ids]),
            candidate_rows=torch.tensor([row]),
        )

    unscored = step(1, [-100] * len(ids))
    assert "bertscore_weight" not in term.pop_metrics() and torch.isfinite(unscored)
    step(1, [-100] * len(ids))
    step(0, ids)
    together = term.pop_metrics()["bertscore_weight"]
    step(0, ids)
    assert together == pytest.approx(term.pop_metrics()["bertscore_weight"], rel=1e-6)


@pytest.mark.parametrize(
    "weight, error",
    [(-1.0, ValueError), (float("nan"), ValueError), ("1", TypeError), (True, TypeError)],
)
def test_term_weight_refused_named(scorer, weight, error):
    from bsloss.integrations.term_weights import Balanced

    loss = bsloss.BERTScoreLoss(encoder=scorer.encoder)
    with pytest.raises(error, match="weight"):
        BERTScoreTerm(loss, loss.encoder.tokenizer, weight=weight)
    if not isinstance(weight, str):
        with pytest.raises(error, match=r"Balanced\(weight\)"):
            Balanced(weight)


class Ratio(TermWeight):
    """EMO's ratio as the docs invite a rule to be written: no .detach()."""

    def __call__(self, ce, term):
        return ce / term


class DetachedRatio(TermWeight):
    def __call__(self, ce, term):
        return (ce / term).detach()


class LearnedScale(TermWeight):
    """A rule whose result carries a gradient of its own (a scale that requires grad)."""

    def __init__(self):
        self.scale = torch.tensor(1.0, requires_grad=True)

    def __call__(self, ce, term):
        return self.scale * ce / term


def test_a_term_weights_result_is_a_constant(loss, tokenizer):
    """Whatever a TermWeight returns, no gradient flows through it: a rule without .detach()
    gives the value and the gradient of the same rule detached (before the fix: the same
    value, a gradient far off), and a rule's own tensor gets no gradient."""
    labels = causal_batch(tokenizer)["labels"]
    torch.manual_seed(2)
    base = torch.randn(*labels.shape, len(tokenizer))

    def step(weight):
        logits = base.clone().requires_grad_(True)
        term = BERTScoreTerm(loss, tokenizer, weight=weight, causal=True)
        value = term({"logits": logits}, labels)
        value.backward()
        return value.detach(), logits.grad

    want_value, want_grad = step(DetachedRatio())
    learned = LearnedScale()
    for rule in (Ratio(), learned):
        value, grad = step(rule)
        torch.testing.assert_close(value, want_value, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-8)
    assert learned.scale.grad is None


@pytest.mark.parametrize(
    "result, error, shown",
    [
        (float("nan"), ValueError, "returned nan"),
        (torch.tensor(float("inf")), ValueError, "returned inf"),
        (-0.5, ValueError, "returned -0.5"),
        (torch.ones(2), TypeError, "shape [2]"),
        ("1", TypeError, "str '1'"),
    ],
)
def test_a_term_weights_result_is_checked_named(loss, tokenizer, result, error, shown):
    """A rule returning NaN, Inf, a negative number or not one number is refused on the step,
    its class and value named, before any metric is recorded (Fixed and Balanced refuse such
    weights at construction)."""

    class Custom(TermWeight):
        def __call__(self, ce, term):
            return result

    labels = causal_batch(tokenizer)["labels"]
    logits = torch.randn(*labels.shape, len(tokenizer))
    term = BERTScoreTerm(loss, tokenizer, weight=Custom(), causal=True)
    with pytest.raises(error, match="term weight Custom") as caught:
        term({"logits": logits}, labels)
    assert shown in str(caught.value), str(caught.value)
    assert term.pop_metrics() == {}


def test_balanced_min_term_must_hold_in_float32(loss, tokenizer):
    """A floor below float32's smallest normal number rounds to 0 there: refused, named. The
    smallest accepted floor with the term at 0 gives a finite weight, or, when CE / floor
    overflows, the rule is refused named on the step (never a NaN loss)."""
    from bsloss.integrations.term_weights import Balanced

    for floor in (1e-300, 1e-39, 0.0):
        with pytest.raises(ValueError, match=r"Balanced\(min_term\)"):
            Balanced(min_term=floor)
    from bsloss.integrations.term_weights import SMALLEST_TERM, evaluate_term_weight

    zero = torch.tensor(0.0)
    weight = evaluate_term_weight(Balanced(min_term=SMALLEST_TERM), torch.tensor(2.0), zero)
    assert torch.isfinite(weight) and weight > 0
    with pytest.raises(ValueError, match="term weight Balanced returned inf"):
        evaluate_term_weight(Balanced(min_term=SMALLEST_TERM), torch.tensor(10.0), zero)


def test_balanced_needs_the_cross_entropy(loss, tokenizer):
    """Balanced scales the term to the CE's value: with ce_weight=0 the CE is not in the loss
    (the loss's value would be the untrained CE, the term's step size would follow it), so the
    pair is refused, named, however it is set; a fixed weight with ce_weight=0 is fine."""
    from bsloss.integrations.term_weights import Balanced

    with pytest.raises(ValueError, match="ce_weight=0"):
        BERTScoreTerm(loss, tokenizer, weight=Balanced(1.0), ce_weight=0)
    term = BERTScoreTerm(loss, tokenizer, weight=1.0, ce_weight=0)
    with pytest.raises(ValueError, match="ce_weight=0"):
        term.weight = Balanced(1.0)
    term = BERTScoreTerm(loss, tokenizer, weight=Balanced(1.0))
    with pytest.raises(ValueError, match="ce_weight=0"):
        term.ce_weight = 0.0
    assert term.ce_weight == 1.0 and isinstance(term.weight, Balanced)
    term.weight = 0.5  # a number set later is a Fixed weight, as in the constructor
    assert term.weight == Fixed(0.5)


def test_mixin_logs_loss_as_ce_plus_the_term(loss, tokenizer, tmp_path):
    """Trainer + mixin on a causal LM with labels = input ids (a row's first label is never a
    target): at weight 1 the logged loss is ce + (1 - F), not below ce (the trainer would count
    the first label of each row in num_items_in_batch)."""

    class Trainer(BERTScoreTrainerMixin, transformers.Trainer):
        pass

    texts = ["the cat sat on the mat", "a dog ran in the park"]  # the same length, no padding
    ids = [tokenizer(t)["input_ids"] for t in texts]
    assert len({len(i) for i in ids}) == 1
    rows = [{"input_ids": i, "attention_mask": [1] * len(i), "labels": i} for i in ids] * 2
    args = training_args(tmp_path)
    args.gradient_accumulation_steps = 1
    trainer = Trainer(
        model=tiny_gpt2(tokenizer),
        args=args,
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=tokenizer,
        bertscore_loss=loss,
        bertscore_weight=1.0,
    )
    trainer.train()
    logged = [e for e in trainer.state.log_history if "bertscore_f" in e]
    assert len(logged) == 2
    for entry in logged:
        assert entry["loss"] == pytest.approx(entry["ce"] + 1 - entry["bertscore_f"], rel=1e-4)


def test_sft_trainer_with_a_tokenizer_without_end_of_sequence(loss, scorer, tmp_path):
    """The scorer's own BERT tokenizer (no eos token) in SFTTrainer: the trainer gets a copy that
    ends completions with [SEP]; one with neither eos nor [SEP] is refused, saying what to set."""
    import copy

    trl = pytest.importorskip("trl")
    from bsloss.integrations.huggingface import _with_end_of_sequence

    bert = scorer.encoder.tokenizer
    assert bert.eos_token is None
    sft_args = trl.SFTConfig(output_dir=str(tmp_path), report_to=[], bf16=False)
    fixed = _with_end_of_sequence(bert, sft_args)
    assert fixed is not bert and fixed.eos_token == "[SEP]" and bert.eos_token is None
    assert _with_end_of_sequence(bert, training_args(tmp_path)) is bert  # Trainer: no eos needed
    chosen = trl.SFTConfig(output_dir=str(tmp_path), report_to=[], bf16=False, eos_token="[SEP]")
    assert _with_end_of_sequence(bert, chosen) is bert  # SFTConfig(eos_token=...) decides
    bare = copy.deepcopy(bert)
    bare.sep_token = None
    with pytest.raises(ValueError, match=r"eos_token = '...' or SFTConfig\(eos_token='...'\)"):
        _with_end_of_sequence(bare, sft_args)


def test_rc7_trainer_keeps_training_and_evaluation_metrics_apart(scorer, tmp_path):
    """An evaluation between two logging steps reported the pending training batches as
    eval_ce / eval_bertscore_f, and those training values never reached the log. Now the
    in-training evaluation equals a clean evaluate() of the same model, and the training
    values reach the next training log (here the end-of-training one)."""
    transformers = pytest.importorskip("transformers")
    datasets = pytest.importorskip("datasets")
    tokenizer = scorer_vocabulary_tokenizer(scorer)
    rows = []
    for prompt, reference in [("Summarize: the cat sat.", "The cat sat."),
                              ("Summarize: a dog ran.", "A dog ran.")]:  # fmt: skip
        p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        r = tokenizer(reference, add_special_tokens=False)["input_ids"] + [tokenizer.sep_token_id]
        rows.append({"input_ids": p + r, "labels": [-100] * len(p) + r})

    class Trainer(hf.BERTScoreTrainerMixin, transformers.Trainer):
        pass

    args = tiny_training_arguments(
        tmp_path, per_device_eval_batch_size=2, learning_rate=1e-2, logging_steps=3,
        eval_strategy="steps", eval_steps=2,
    )  # fmt: skip
    trainer = Trainer(
        model=tiny_gpt2(tokenizer),
        args=args,
        train_dataset=datasets.Dataset.from_list(rows * 2),
        eval_dataset=datasets.Dataset.from_list(rows[:1]),
        data_collator=transformers.DataCollatorForSeq2Seq(tokenizer),
        processing_class=tokenizer,
        bertscore_loss=BERTScoreLoss(encoder=scorer.encoder),
    )
    trainer.train()
    inside = [e for e in trainer.state.log_history if "eval_ce" in e]
    assert len(inside) == 1
    clean = trainer.evaluate()  # the model has not changed since that evaluation
    assert inside[0]["eval_ce"] == pytest.approx(clean["eval_ce"], abs=1e-6)
    assert inside[0]["eval_bertscore_f"] == pytest.approx(clean["eval_bertscore_f"], abs=1e-6)
    training = [e for e in trainer.state.log_history if "ce" in e]
    assert len(training) == 1 and training[0]["ce"] > 0 and 0 < training[0]["bertscore_f"] <= 1
    assert not any(k.startswith("eval_") for k in training[0])
    # predict() gets its own prefix and leaves nothing pending
    metrics = trainer.predict(datasets.Dataset.from_list(rows[:1])).metrics
    assert metrics["test_ce"] == pytest.approx(clean["eval_ce"], abs=1e-6)
    assert trainer.bertscore_term.pop_metrics(training=False) == {}


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "dense"])
def test_the_mixin_reads_the_labels_before_the_forward(loss, tokenizer, tmp_path, fused):
    """The references decoded from the labels (a read of the device) are decoded before the
    model's forward, where on a GPU the read waits only for the labels' copy, not for the
    forward; they are the references the term decodes itself, and the loss is the same."""

    class Trainer(BERTScoreTrainerMixin, transformers.Trainer):
        pass

    model = tiny_gpt2(tokenizer)
    trainer = Trainer(
        model=model,
        args=training_args(tmp_path),
        processing_class=tokenizer,
        bertscore_loss=loss,
        bertscore_fused=fused,
    )
    model.eval()  # no dropout: the two calls below see the same forward
    term = trainer.bertscore_term
    batch = causal_batch(tokenizer)
    forward = model.forward
    events, _ = record_decoding_and_forward(model, term)
    value = trainer.compute_loss(model, dict(batch))
    assert events == ["decode", "forward"], events
    model.forward = forward
    outputs = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    expected = term(outputs, batch["labels"])  # the term decoding its references itself
    torch.testing.assert_close(value, expected, rtol=1e-5, atol=1e-6)
    uncased = [reference.lower() for reference in REFERENCES]  # the scorer's vocabulary
    assert events[-1] == "decode" and term.references_of(batch["labels"]) == uncased


def test_a_seq2seq_mixin_reads_its_unshifted_labels_before_the_forward(loss, tokenizer, tmp_path):
    """Seq2SeqTrainer + mixin on a tiny BERT2BERT (labels not shifted: ``causal=False``): the
    references decoded before the forward are the whole labels, the references the term
    would decode itself."""

    class Trainer(BERTScoreTrainerMixin, transformers.Seq2SeqTrainer):
        pass

    model = tiny_bert2bert(tokenizer)
    trainer = Trainer(
        model=model,
        args=training_args(tmp_path, transformers.Seq2SeqTrainingArguments),
        processing_class=tokenizer,
        bertscore_loss=loss,
    )
    term = trainer.bertscore_term
    assert term.causal is False
    prompts = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    targets = tokenizer(REFERENCES, return_tensors="pt", padding=True)["input_ids"][:, 1:]
    labels = targets.masked_fill(targets == tokenizer.pad_token_id, -100)
    events, decoded = record_decoding_and_forward(model, term)
    trainer.compute_loss(model, {**prompts, "labels": labels})
    assert events == ["decode", "forward"], events
    assert decoded == [[reference.lower() for reference in REFERENCES]]


def record_decoding_and_forward(model, term) -> tuple[list[str], list[list[str]]]:
    """Wrap ``model.forward`` and the term's decoding of labels (on the instances) to record
    the order of their calls (``"forward"``, ``"decode"``) and the references decoded."""
    events, decoded = [], []
    forward, decode = model.forward, term._decoded_rows

    def recorded_forward(*args, **kwargs):
        events.append("forward")
        return forward(*args, **kwargs)

    def recorded_decode(*args):
        events.append("decode")
        decoded.append(decode(*args))
        return decoded[-1]

    model.forward, term._decoded_rows = recorded_forward, recorded_decode
    return events, decoded


def _mixin_trainer(loss, tokenizer, tmp_path, model, rows=(), **args):
    class Trainer(BERTScoreTrainerMixin, transformers.Trainer):
        pass

    settings = training_args(tmp_path)
    for key, value in args.items():
        setattr(settings, key, value)
    return Trainer(
        model=model,
        args=settings,
        train_dataset=datasets.Dataset.from_list(list(rows)) if rows else None,
        processing_class=tokenizer,
        data_collator=transformers.DataCollatorForSeq2Seq(tokenizer),
        bertscore_loss=loss,
        bertscore_weight=1.0,
    )


def _prompt_and_answer(tokenizer, prompt: str, answer: str) -> dict:
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    answer_ids = tokenizer(answer, add_special_tokens=False)["input_ids"]
    return {
        "input_ids": prompt_ids + answer_ids,
        "labels": [-100] * len(prompt_ids) + answer_ids,
    }


def _assert_one_logged_step_adds_up(loss, tokenizer, tmp_path, rows) -> None:
    """One step of micro-batches of one row each (``rows``): the logged loss is
    ``ce + bertscore_loss`` (weight 1)."""
    trainer = _mixin_trainer(
        loss, tokenizer, tmp_path, tiny_gpt2(tokenizer), rows,
        per_device_train_batch_size=1, max_steps=1, learning_rate=0.0, logging_steps=1,
    )  # fmt: skip
    trainer.train()
    (entry,) = [e for e in trainer.state.log_history if "ce" in e]
    assert entry["loss"] == pytest.approx(entry["ce"] + entry["bertscore_loss"], rel=1e-5)


def test_logged_ce_and_term_add_up_to_the_loss_over_uneven_micro_batches(loss, tokenizer, tmp_path):
    """Two accumulated micro-batches of 1 and 10 completion tokens: the trainer's loss weighs
    them by tokens; the logged ce and bertscore_loss were plain means of the micro-batches'
    own means, and did not add up to it (11.94 against 13.35 + 0.88)."""
    rows = [
        _prompt_and_answer(tokenizer, "say", "cat"),
        _prompt_and_answer(
            tokenizer, "say", "the river ran past old stone houses while children played"
        ),
    ]
    assert [sum(t != -100 for t in r["labels"]) for r in rows] == [1, 10]
    _assert_one_logged_step_adds_up(loss, tokenizer, tmp_path, rows)


def test_a_failed_evaluation_leaves_nothing_in_the_next(loss, tokenizer, tmp_path):
    """An evaluation that failed at its second batch left its first batch's ce and F to be
    averaged into the next evaluation's."""
    rows = [_prompt_and_answer(tokenizer, "say", t) for t in ("a cat", "the dog ran")]
    trainer = _mixin_trainer(
        loss, tokenizer, tmp_path, tiny_gpt2(tokenizer), per_device_eval_batch_size=1
    )
    good = datasets.Dataset.from_list(rows)
    first = trainer.evaluate(good)
    broken = [rows[0], {**rows[1], "input_ids": [len(tokenizer) + 5] * len(rows[1]["input_ids"])}]
    with pytest.raises(IndexError):  # the model's embedding, at the second batch
        trainer.evaluate(datasets.Dataset.from_list(broken))
    again = trainer.evaluate(good)
    for key in ("eval_ce", "eval_bertscore_f", "eval_bertscore_loss"):
        assert again[key] == pytest.approx(first[key], rel=1e-6), key


def _packed_row(*examples: dict) -> dict:
    """The examples in one padding-free row, ``position_ids`` restarting at 0 for each."""
    return {
        "input_ids": torch.tensor([sum((e["input_ids"] for e in examples), [])]),
        "position_ids": torch.tensor(
            [sum((list(range(len(e["input_ids"]))) for e in examples), [])]
        ),
        "labels": torch.tensor([sum((e["labels"] for e in examples), [])]),
    }


def test_a_right_padded_batch_with_position_ids_is_not_cut():
    """A right-padded batch given ``position_ids`` restarts them in its padding; it was cut
    into documents all the same, a gather copy of the logits for the same scores (audit h23,
    N4). A row whose labelled document does not start it is still cut."""
    from bsloss.integrations.packing import PackedDocuments

    labels = torch.tensor([[-100, 5, 6, -100, -100], [-100, 7, -100, -100, -100]])
    right_padded = torch.tensor([[0, 1, 2, 0, 0], [0, 1, 0, 0, 0]])
    assert PackedDocuments.of(right_padded, labels) is None
    second_labelled = torch.tensor([[-100, -100, -100, 5, 6], [-100, 7, -100, -100, -100]])
    packed = PackedDocuments.of(torch.tensor([[0, 1, 2, 0, 1], [0, 1, 0, 0, 0]]), second_labelled)
    assert packed.split(second_labelled, fill=-100).tolist() == [[5, 6], [-100, 7]]


def test_a_packed_batch_is_scored_document_by_document(loss, tokenizer, tmp_path):
    """A padding-free row of two examples (position_ids restarting at 0) was scored as one
    text, against both completions joined. With a model whose logits at a position depend on
    its token and position only (no layers), the packed batch's loss now equals the padded
    batch's, and each document is scored against its own completion."""
    model = tiny_gpt2(tokenizer, n_layer=0).eval()  # eval: no dropout
    trainer = _mixin_trainer(loss, tokenizer, tmp_path, model)
    a = _prompt_and_answer(tokenizer, "say", "a cat sat on the mat")
    b = _prompt_and_answer(tokenizer, "tell me", "the dog ran")
    packed = _packed_row(a, b)
    padded = transformers.DataCollatorForSeq2Seq(tokenizer)([a, b])
    seen = []
    references_of = trainer.bertscore_term.references_of
    trainer.bertscore_term.references_of = lambda *args: (
        seen.append(references_of(*args)) or seen[-1]
    )
    with torch.no_grad():
        packed_loss = trainer.compute_loss(model, dict(packed))
        padded_loss = trainer.compute_loss(model, dict(padded))
    assert seen[0] == seen[1] == ["a cat sat on the mat", "the dog ran"], seen
    torch.testing.assert_close(packed_loss, padded_loss, rtol=1e-5, atol=1e-6)
    assert trainer.bertscore_term.pop_metrics(training=False)["bertscore_f"] > 0


@pytest.mark.parametrize("fused", [False, True], ids=["dense", "fused"])
def test_trls_padding_free_batch_gives_the_padded_batchs_loss_and_gradients(
    loss, tokenizer, tmp_path, fused
):
    """TRL's own padding-free collator (``pad_to_multiple_of=8``: padding after the last
    document), a one-token document among four, on the dense and the fused path: the loss and
    every gradient equal the padded batch's (audit h23 checked these by script; no test held
    them)."""
    trl = pytest.importorskip("trl")
    collator_class = trl.trainer.sft_trainer.DataCollatorForLanguageModeling
    model = tiny_gpt2(tokenizer, n_layer=0).eval()  # eval: no dropout
    trainer = _mixin_trainer(loss, tokenizer, tmp_path, model)
    trainer.bertscore_fused = fused
    examples = [
        _prompt_and_answer(tokenizer, "say", "a cat sat on the mat"),
        {"input_ids": [tokenizer.convert_tokens_to_ids("cat")], "labels": [-100]},
        _prompt_and_answer(tokenizer, "tell me", "the dog ran"),
        _prompt_and_answer(tokenizer, "x", "hello"),
    ]
    packing = collator_class(
        pad_token_id=tokenizer.pad_token_id, padding_free=True, pad_to_multiple_of=8
    )
    packed = packing([dict(e) for e in examples])
    assert packed["input_ids"].shape[0] == 1 and packed["input_ids"].shape[1] % 8 == 0
    padded = transformers.DataCollatorForSeq2Seq(tokenizer)([dict(e) for e in examples])
    steps = []
    for batch in (packed, padded):
        model.zero_grad(set_to_none=True)
        value = trainer.compute_loss(model, dict(batch))
        value.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        steps.append((value.detach(), grads))
    (packed_loss, packed_grads), (padded_loss, padded_grads) = steps
    torch.testing.assert_close(packed_loss, padded_loss, rtol=1e-5, atol=1e-6)
    assert packed_grads.keys() == padded_grads.keys() and packed_grads
    for name, grad in padded_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("fused", [False, True], ids=["dense", "fused"])
@pytest.mark.parametrize("weight", [1.0, 0.0], ids=["term", "ce-alone"])
def test_a_label_outside_the_vocabulary_in_a_packed_batch_is_named_in_the_packed_row(
    loss, tokenizer, tmp_path, fused, weight
):
    """A packed (padding-free) batch is scored one document a row; a label outside the
    vocabulary was named by its place in that split, ``labels[1, t]`` (the document's row and
    its own position), a row the caller's ``[1, T]`` labels do not have. It is named where the
    caller put it, and the trainer works after."""
    model = tiny_gpt2(tokenizer, n_layer=0).eval()
    trainer = _mixin_trainer(loss, tokenizer, tmp_path, model)
    trainer.bertscore_fused = fused
    trainer.bertscore_term.weight = weight
    a = _prompt_and_answer(tokenizer, "say", "a cat sat on the mat")
    b = _prompt_and_answer(tokenizer, "tell me", "the dog ran")
    packed = _packed_row(a, b)
    vocab = model.get_output_embeddings().weight.shape[0]
    bad = {k: v.clone() for k, v in packed.items()}
    position = len(a["labels"]) + len(b["labels"]) - 1  # b's last completion token
    bad["labels"][0, position] = vocab + 5
    where = re.escape(f"outside [0, {vocab}) (the model's vocabulary; and not -100) at ")
    with torch.no_grad():
        with pytest.raises(ValueError, match=where + rf"labels\[0, {position}\]$"):
            trainer.compute_loss(model, dict(bad))
        bad["labels"][0, position] = -1  # with the term: decoded before the forward, named there
        with pytest.raises(ValueError, match=rf" at labels\[0, {position}\]$"):
            trainer.compute_loss(model, dict(bad))
        assert torch.isfinite(trainer.compute_loss(model, dict(packed)))


def test_a_reference_column_reaches_no_generate(loss, scorer, tokenizer, tmp_path):
    """The reference column rides in every batch for compute_loss to take out; a prediction
    step that does not call it (Seq2SeqTrainer's with predict_with_generate) passed it to
    generate(): ``ValueError: The following model_kwargs are not used by the model:
    ['bertscore_references']``, although docs/huggingface.md shows the two together. That step
    runs without it now (as a split without labels does), and the generated answers are
    scored."""

    class Trainer(BERTScoreTrainerMixin, transformers.Seq2SeqTrainer):
        pass

    model = tiny_bert2bert(tokenizer)
    rows = [
        {
            "input_ids": tokenizer(prompt)["input_ids"],
            "labels": tokenizer(reference)["input_ids"][1:],
            "reference": reference,
        }
        for prompt, reference in zip(PROMPTS, REFERENCES, strict=True)
    ]
    args = training_args(tmp_path, transformers.Seq2SeqTrainingArguments)
    args.predict_with_generate, args.generation_max_length = True, 8
    trainer = Trainer(
        model=model,
        args=args,
        data_collator=transformers.DataCollatorForSeq2Seq(tokenizer, model=model),
        processing_class=tokenizer,
        compute_metrics=bertscore_compute_metrics(tokenizer, scorer),
        bertscore_loss=loss,
        bertscore_weight=1.0,
        bertscore_reference_column="reference",
    )
    metrics = trainer.evaluate(datasets.Dataset.from_list(rows))
    assert 0 < metrics["eval_bertscore_f1"] <= 1 and np.isfinite(metrics["eval_loss"])


def test_labels_of_the_wrong_kind_and_negative_ids_are_named(loss, tokenizer, tmp_path):
    """A negative label other than -100 (labels padded with -1) crashed inside the tokenizer's
    decode (``OverflowError: number too small to fit in target type``), in the term and in the
    mixin's step; 1-D, float, numpy or list labels crashed in torch or in decode; a single
    string as ``references`` was read as one reference per character. Each is named now, and
    the term works after."""
    model = tiny_gpt2(tokenizer)
    batch = causal_batch(tokenizer)
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}
    labels = batch["labels"]
    term = BERTScoreTerm(loss, tokenizer)
    outputs = model(**inputs)
    bad = labels.clone()
    position = int((bad[1] != -100).nonzero()[0])
    bad[1, position] = -1
    negative = (
        r"labels has a negative id \(-1; -100 marks a position without a label\) at "
        rf"labels\[1, {position}\]$"
    )
    with pytest.raises(ValueError, match=negative):
        term(outputs, bad)
    trainer = _mixin_trainer(loss, tokenizer, tmp_path, model)
    with pytest.raises(ValueError, match=negative):
        trainer.compute_loss(model, {**inputs, "labels": bad})
    with pytest.raises(ValueError, match=r"labels must be \[B, L\] token ids, got shape \[16\]"):
        term(outputs, labels[0])
    with pytest.raises(TypeError, match="labels must have an integer dtype, got torch.float32"):
        term(outputs, labels.float())
    with pytest.raises(TypeError, match="labels must be a torch.Tensor, got ndarray"):
        term(outputs, labels.numpy())
    with pytest.raises(TypeError, match="references must be a list of strings"):
        term(outputs, labels, references="ab")
    assert torch.isfinite(term(outputs, labels))


@pytest.mark.parametrize("given", ["path", "peft-head"])
def test_the_default_path_is_chosen_on_the_model_the_trainer_trains(
    loss, tokenizer, tmp_path, given
):
    """``bertscore_fused=None`` was decided on the ``model=`` argument before the trainer
    loaded or wrapped it: a model given as a path took the dense path silently (a string has
    no LM head), and ``peft_config`` with ``modules_to_save=["lm_head"]`` (a head the fused
    pass refuses) chose the fused path and failed at the first step. It is decided on the
    model the trainer holds: fused for the loaded model, dense for the wrapped head, and a
    step trains."""
    trl = pytest.importorskip("trl")
    peft = pytest.importorskip("peft")

    class Trainer(BERTScoreTrainerMixin, trl.SFTTrainer):
        pass

    model, extra = tiny_gpt2(tokenizer), {}
    if given == "path":
        model.save_pretrained(tmp_path / "model")
        model = str(tmp_path / "model")
    else:
        extra["peft_config"] = peft.LoraConfig(
            r=2, target_modules=["c_attn"], modules_to_save=["lm_head"], task_type="CAUSAL_LM"
        )
    data = datasets.Dataset.from_dict({"prompt": PROMPTS * 2, "completion": REFERENCES * 2})
    trainer = Trainer(
        model=model,
        args=training_args(tmp_path, trl.SFTConfig, max_length=48, bf16=False, max_steps=1),
        train_dataset=data,
        processing_class=tokenizer,
        bertscore_loss=loss,
        **extra,
    )
    assert trainer.bertscore_fused is (given == "path")
    trainer.train()
    assert all(np.isfinite(e["loss"]) for e in trainer.state.log_history if "loss" in e)


@pytest.mark.parametrize("weight", [1.0, 0.0], ids=["term", "ce-alone"])
@pytest.mark.parametrize(
    "count",
    [
        -5,
        float("nan"),
        float("inf"),
        True,
        torch.tensor(-5),
        torch.tensor(float("nan")),
        torch.tensor([3, 4]),
    ],
    ids=["-5", "nan", "inf", "bool", "tensor-5", "tensor-nan", "two-counts"],
)
def test_a_bad_num_items_in_batch_given_by_hand_is_named(loss, tokenizer, weight, count):
    """``num_items_in_batch`` (the trainer's token count) given by hand as a negative number
    was clamped to 1 silently (a loss 59 times the mean), NaN gave a NaN loss and infinity a
    loss of 0. A Python number or a CPU tensor must be a count >= 0 now, a tensor one number
    (two counts were broadcast into two losses); the trainer's own, a tensor on the device,
    has its value taken as it is (checking it would cost a read)."""
    model = tiny_gpt2(tokenizer)
    batch = causal_batch(tokenizer)
    outputs = model(**{k: batch[k] for k in ("input_ids", "attention_mask")})
    term = BERTScoreTerm(loss, tokenizer, weight=weight)
    with pytest.raises((TypeError, ValueError), match="num_items_in_batch"):
        term(outputs, batch["labels"], count)
    assert torch.isfinite(term(outputs, batch["labels"], 7))


@pytest.mark.parametrize("center", [True, False])
def test_a_micro_batch_without_a_completion_still_calls_a_centering_loss(scorer, tokenizer, center):
    """With ``center=True`` the loss's all-reduces pair with the other processes' calls only if
    every process makes every call: a micro-batch whose rows have no completion token skipped
    the loss, so two processes' centering calls paired up wrongly (F 0.0711 for 0.0700, then a
    failure or a hang; audit h12). The loss now runs on no row there (and its zero stays on the
    graph); without centering it is still skipped."""
    loss = BERTScoreLoss(model=scorer.encoder, center=center)
    calls = []
    score = loss.score

    def recording(*args, **kwargs):
        calls.append(kwargs.get("references"))
        return score(*args, **kwargs)

    loss.score = recording
    term = BERTScoreTerm(loss, tokenizer, causal=True)
    labels = torch.full((2, 6), -100)
    logits = torch.randn(2, 6, len(tokenizer), requires_grad=True)
    value = term({"logits": logits}, labels)
    value.backward()
    assert calls == ([[]] if center else [])
    assert value.item() == 0.0 and torch.equal(logits.grad, torch.zeros_like(logits))


@pytest.mark.slow  # two processes each load the scorer: ~20 s on 2 busy cores
def test_logged_metrics_are_the_whole_batchs_over_processes(tmp_path):
    """Under several processes each logged its own rows' ``ce``, ``bertscore_loss`` and
    ``bertscore_f`` (the trainer reports rank 0's: ``bertscore_f`` 0.0605 for the batch's
    0.0918, and ``loss`` != ``ce + bertscore_loss``). ``pop_metrics(distributed=True)`` (what
    the mixin's ``log`` and ``evaluation_loop`` ask for when ``world_size > 1``) sums the
    values and weights of every process before dividing; a key one process lacks counts 0."""
    import _distributed_term_metrics as script
    from test_distributed_scoring import run_two_processes

    results = run_two_processes("_distributed_term_metrics.py", tmp_path)
    everyone = {}
    for recorded in script.RECORDED:
        for key, entries in recorded.items():
            everyone.setdefault(key, []).extend(entries)
    expected = {k: sum(v for v, _ in e) / sum(w for _, w in e) for k, e in everyone.items()}
    assert expected["ce"] == pytest.approx(9.0)  # (2 + 3 + 4) / (0.25 + 0.25 + 0.5)
    for rank, result in enumerate(results):
        assert result["reduced"] == pytest.approx(expected)
        own = script.RECORDED[rank]
        assert result["local"] == pytest.approx(
            {k: sum(v for v, _ in e) / sum(w for _, w in e) for k, e in own.items()}
        )


# ---------------------------------------------------------------- round 17 (audit h30)
def test_a_mixture_of_experts_keeps_its_load_balancing_loss(loss, tokenizer, tmp_path):
    """The mixin takes the labels out of the forward, so the model adds no loss of its own:
    a Mixtral's router load-balancing loss was dropped (step loss 10.343 against the plain
    Trainer's 11.345, the router's gradient 40x smaller). Without accumulation the two agree;
    with it the mixin averages the router's loss over the micro-batches as TRL's SFTTrainer
    does (the plain Trainer adds it whole at each)."""

    def mixtral():
        torch.manual_seed(0)
        config = transformers.MixtralConfig(
            vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
            num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
            router_aux_loss_coef=0.5, pad_token_id=tokenizer.pad_token_id,
            max_position_embeddings=64,
        )  # fmt: skip
        return transformers.MixtralForCausalLM(config)

    batch = causal_batch(tokenizer)
    single = training_args(tmp_path, gradient_accumulation_steps=1)
    steps = {}
    for name, mixin in (("trainer", False), ("mixin", True)):
        model = mixtral()
        if mixin:  # the CE alone (weight 0), as the model's own loss

            class Mixin(BERTScoreTrainerMixin, transformers.Trainer):
                pass

            trainer = Mixin(model=model, args=single, processing_class=tokenizer,
                            bertscore_loss=loss, bertscore_weight=0.0)  # fmt: skip
        else:
            trainer = transformers.Trainer(model=model, args=single)
        count = trainer._get_num_items_in_batch([batch], torch.device("cpu"))
        value = trainer.training_step(model, dict(batch), count).item()
        steps[name] = value, model.model.layers[0].mlp.gate.weight.grad.clone()
    assert steps["mixin"][0] == pytest.approx(steps["trainer"][0], rel=1e-5)
    torch.testing.assert_close(steps["mixin"][1], steps["trainer"][1], rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize(
    ("setting", "named"),
    [
        ({"label_smoothing_factor": 0.1}, "label_smoothing_factor=0.1: BERTScoreTrainerMixin"),
        ({"loss_type": "dft"}, "loss_type='dft'"),
        ({"packing": True, "packing_strategy": "wrapped"}, "packing_strategy='wrapped'"),
    ],
)
def test_loss_options_the_mixin_would_not_apply_are_refused(
    loss, tokenizer, tmp_path, setting, named
):
    """label_smoothing_factor and SFTTrainer's loss_type were ignored (plain NLL, unnoticed);
    TRL's wrapped packing gave rows cut and joined across examples, scored as one text."""
    trl = pytest.importorskip("trl")

    class Trainer(BERTScoreTrainerMixin, trl.SFTTrainer):
        pass

    data = datasets.Dataset.from_dict({"prompt": PROMPTS * 2, "completion": REFERENCES * 2})
    args = training_args(tmp_path, trl.SFTConfig, max_length=48, bf16=False, **setting)
    with pytest.raises(ValueError, match=re.escape(named)):
        Trainer(model=tiny_gpt2(tokenizer), args=args, train_dataset=data,
                processing_class=tokenizer, bertscore_loss=loss)  # fmt: skip


def test_a_micro_batch_without_completion_tokens_weighs_nothing_in_the_log(
    loss, tokenizer, tmp_path
):
    """An accumulated micro-batch without a completion token weighed as one token (its count
    clamped to 1): the logged ce and bertscore_loss came out low by N / (N + 1) (8.996 logged
    for a step loss of 11.245)."""
    rows = [
        _prompt_and_answer(tokenizer, "say", "the cat sat on the mat"),
        {**_prompt_and_answer(tokenizer, "say", "nothing"), "labels": [-100, -100]},
    ]
    _assert_one_logged_step_adds_up(loss, tokenizer, tmp_path, rows)


def test_a_logging_step_without_completion_tokens_reports_no_ce(loss, tokenizer):
    """Only micro-batches without a completion token since the last log: there is no CE to
    average, so the key is left out (not a 0 that reads as a perfect model, not a NaN); the
    loss is 0 with a finite gradient. Found by the fuzz test in CI (stop 75)."""
    term = BERTScoreTerm(loss, tokenizer, weight=1.0, causal=True)
    logits = torch.randn(2, 4, len(tokenizer), requires_grad=True)
    labels = torch.full((2, 4), -100)
    value = term({"logits": logits}, labels, None)
    value.backward()
    assert float(value) == 0.0 and torch.isfinite(logits.grad).all()
    assert "ce" not in term.pop_metrics()
    labels[0, 2:] = torch.tensor([5, 6])  # one completion token after the shift: ce comes back
    term({"logits": logits.detach()}, labels, None, training=True)
    assert "ce" in term.pop_metrics()


def test_recorded_metrics_are_running_sums(loss, tokenizer):
    """The term kept a (value, weight) pair per micro-batch until popped, without end where
    nothing pops (compute_loss_func; logging_strategy="no"): ~1 KB of host objects each."""
    term = BERTScoreTerm(loss, tokenizer, weight=1.0, causal=True)
    model = tiny_gpt2(tokenizer)
    batch = causal_batch(tokenizer)
    labels = batch.pop("labels")
    values = []
    for _ in range(3):
        outputs = model(**batch)
        values.append(float(term(outputs, labels, None)))
    kept = term._metrics["train"]
    assert all(len(list(kept[key])) == 1 for key in ("ce", "bertscore_loss", "bertscore_f"))
    popped = term.pop_metrics()  # each call's share is 1 (no num_items_in_batch): the mean
    assert popped["ce"] + popped["bertscore_loss"] == pytest.approx(np.mean(values), rel=1e-5)


def test_a_seq2seq_term_without_decoder_inputs_says_so(loss, tokenizer):
    """Seq2SeqTrainer(compute_loss_func=BERTScoreTerm(causal=False)) with a batch without
    decoder_input_ids: the model's decoder ran on its shifted source, and a length mismatch
    did not say why."""
    term = BERTScoreTerm(loss, tokenizer, weight=1.0, causal=False)
    logits = torch.randn(2, 7, len(tokenizer))
    labels = torch.randint(0, 100, (2, 5))
    with pytest.raises(ValueError, match=r"do not match the logits \[2, 7\]; .*decoder_input_ids"):
        term({"logits": logits}, labels, None)
