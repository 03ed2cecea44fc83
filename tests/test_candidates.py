"""The model's own answers as the BERTScore term's candidates (bsloss.integrations.candidates)
in the trainer integration: the joined batch against rows run one by one, the mixin's loss
against the term called by hand, fused against dense, the three trainers, and bad input."""

from __future__ import annotations

import copy

import pytest
import torch
from _helpers import DISTRIBUTED_MODES, sft_completions, tiny_training_arguments
from _models import scripted, tiny_gpt2
from torch.torch_version import TorchVersion

import bsloss
from bsloss.integrations.candidates import (
    GreedyAnswers,
    ModelAnswers,
    SampledAnswers,
    TeacherForced,
    generated_labels,
    resolve_candidates,
)
from bsloss.integrations.huggingface import BERTScoreTerm, BERTScoreTrainerMixin
from bsloss.integrations.term_weights import Balanced

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

PROMPTS = ["Summarize: the cat sat on the mat.", "Summarize: a dog ran in the long park today."]
REFERENCES = ["The cat sat.", "A dog ran."]


def causal_batch(vocabulary_tokenizer, left_pad: bool = False):
    """Prompt + reference + [SEP] rows (right-padded unless ``left_pad``), labels -100 on the
    prompt and the padding."""
    rows, labels = [], []
    for prompt, reference in zip(PROMPTS, REFERENCES, strict=True):
        p = vocabulary_tokenizer(prompt, add_special_tokens=False)["input_ids"]
        r = vocabulary_tokenizer(reference, add_special_tokens=False)["input_ids"] + [
            vocabulary_tokenizer.sep_token_id
        ]
        rows.append(p + r)
        labels.append([-100] * len(p) + r)
    width = max(map(len, rows))

    def pad(row, value):
        padding = [value] * (width - len(row))
        return padding + row if left_pad else row + padding

    return {
        "input_ids": torch.tensor([pad(r, vocabulary_tokenizer.pad_token_id) for r in rows]),
        "attention_mask": torch.tensor([pad([1] * len(r), 0) for r in rows]),
        "labels": torch.tensor([pad(r, -100) for r in labels]),
    }


def causal_answers(model, batch, labels, tokenizer, answers=None):
    """``answers`` (default greedy) for a causal batch, ending at the tokenizer's [SEP]."""
    return (answers or GreedyAnswers()).answer(
        model,
        batch,
        labels,
        causal=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_ids=[tokenizer.sep_token_id],
    )


def answer_one_by_one(model, vocabulary_tokenizer, batch, max_new_tokens):
    """Each row's greedy answer from its prompt alone (no padding anywhere), cut after [SEP]:
    (prompt + answer ids, the answer's labels) per row."""
    rows = []
    columns = batch["input_ids"], batch["attention_mask"], batch["labels"]
    for ids, mask, labels in zip(*columns, strict=True):
        start = int((labels != -100).int().argmax())
        prompt = ids[mask.bool() & (torch.arange(len(ids)) < start)]
        model.eval()
        with torch.no_grad():
            out = model.generate(
                input_ids=prompt[None],
                attention_mask=torch.ones_like(prompt)[None],
                do_sample=False,
                max_new_tokens=max_new_tokens,
                pad_token_id=vocabulary_tokenizer.pad_token_id,
                eos_token_id=[vocabulary_tokenizer.sep_token_id],
            )[0, len(prompt) :]
        model.train()
        ends = (out == vocabulary_tokenizer.sep_token_id).nonzero()
        answer = out[: int(ends[0]) + 1] if len(ends) else out
        rows.append((torch.cat([prompt, answer]), [-100] * len(prompt) + answer.tolist()))
    return rows


@pytest.mark.parametrize("left_pad", [False, True])
def test_joined_batch_equals_the_rows_run_alone(vocabulary_tokenizer, left_pad):
    """The answers equal each prompt's own greedy answer, and the one joined forward pass gives
    the batch's logits and each answer's logits as if each ran alone."""
    model = tiny_gpt2(vocabulary_tokenizer)
    batch = causal_batch(vocabulary_tokenizer, left_pad)
    labels = batch.pop("labels")
    longest = int((labels != -100).sum(1).max())
    joint = causal_answers(model, batch, labels, vocabulary_tokenizer)
    assert model.training  # its mode is restored after generating
    expected = answer_one_by_one(model, vocabulary_tokenizer, {**batch, "labels": labels}, longest)
    for i, (_, row_labels) in enumerate(expected):
        got = joint.candidate_labels[i]
        assert got[: len(row_labels)].tolist() == row_labels
        assert (got[len(row_labels) :] == -100).all()
    model.eval()
    with torch.no_grad():
        logits, answers = joint.split(model(**joint.inputs).logits)
        alone = model(**batch).logits  # the trainer's own forward of the batch
        mask = batch["attention_mask"].bool()
        assert logits.shape == alone.shape
        assert torch.allclose(logits[mask], alone[mask], atol=1e-5)
        for i, (ids, _) in enumerate(expected):
            own = model(input_ids=ids[None]).logits[0]
            assert torch.allclose(answers[i, : len(ids)], own, atol=1e-5)


def without_dropout(model):
    """Training mode (the mixin generates only then) without dropout's noise, so that two
    forward passes agree: the dropout modules' and the probabilities that attention modules
    hand to their kernel (transformers 4.x's BERT SDPA attention keeps a float
    ``dropout_prob``)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for name, value in vars(module).items():
            if "dropout" in name and isinstance(value, float):
                setattr(module, name, 0.0)
    return model


def trainer_class(base):
    class Trainer(BERTScoreTrainerMixin, base):
        pass

    return Trainer


def causal_trainer(soft_loss, vocabulary_tokenizer, tmp_path, **options):
    batch = causal_batch(vocabulary_tokenizer)
    rows = [{k: v[i].tolist() for k, v in batch.items()} for i in range(2)] * 2
    return trainer_class(transformers.Trainer)(
        model=tiny_gpt2(vocabulary_tokenizer),
        args=tiny_training_arguments(tmp_path),
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=vocabulary_tokenizer,
        bertscore_loss=soft_loss,
        **options,
    )


# the loss's options that act on the candidates' distributions, met with generated answers
CANDIDATE_OPTIONS = {
    "soft": dict(matching="softmax"),
    "hard": dict(matching="hard"),
    "top_k": dict(matching="softmax", top_k=4),
    "straight_through": dict(matching="softmax", straight_through=True),
}


@pytest.mark.parametrize("options", CANDIDATE_OPTIONS)
@pytest.mark.parametrize("fused", [False, True])
def test_mixin_loss_is_the_term_on_the_models_answers(
    scorer, vocabulary_tokenizer, tmp_path, fused, options
):
    """compute_loss with greedy answers equals BERTScoreTerm called by hand on answers made
    one by one (CE on the labels, the term on the answers), value and gradients, for each
    matching / candidate transform; the fused path (no [B, L, V] logits) equals the dense
    one."""
    loss = bsloss.BERTScoreLoss(encoder=scorer.encoder, **CANDIDATE_OPTIONS[options])
    trainer = causal_trainer(
        loss,
        vocabulary_tokenizer,
        tmp_path,
        bertscore_candidates="greedy",
        bertscore_weight=Balanced(1.0),
        bertscore_fused=fused,
    )
    model = trainer.model
    without_dropout(model).train()
    batch = causal_batch(vocabulary_tokenizer)
    value = trainer.compute_loss(model, {k: v.clone() for k, v in batch.items()})
    grads = torch.autograd.grad(value, [p for p in model.parameters() if p.requires_grad])

    longest = int((batch["labels"] != -100).sum(1).max())
    expected = answer_one_by_one(model, vocabulary_tokenizer, batch, longest)
    width = max(len(ids) for ids, _ in expected)
    answer_ids = torch.stack(
        [torch.nn.functional.pad(ids, (0, width - len(ids))) for ids, _ in expected]
    )
    answer_mask = (torch.arange(width) < torch.tensor([[len(ids)] for ids, _ in expected])).long()
    answer_labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in expected])
    term = BERTScoreTerm(loss, vocabulary_tokenizer, weight=Balanced(1.0), causal=True)
    own = model(input_ids=answer_ids, attention_mask=answer_mask).logits
    reference = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    by_hand = term(
        {"logits": reference},
        batch["labels"],
        candidate_outputs={"logits": own},
        candidate_labels=answer_labels,
    )
    grads_by_hand = torch.autograd.grad(by_hand, [p for p in model.parameters() if p.requires_grad])
    assert abs(value.item() - by_hand.item()) < 1e-5
    for got, want in zip(grads, grads_by_hand, strict=True):
        assert torch.allclose(got, want, atol=1e-5)


def test_sampled_answers_in_sft_trainer(soft_loss, vocabulary_tokenizer, tmp_path):
    """SFTTrainer + mixin with sampled answers and the balanced weight (the study's winning
    setting): trains, logs, the scorer sees the answers (not the labels) against the
    completions, and evaluation still scores the labels."""
    trl = pytest.importorskip("trl")
    data = datasets.Dataset.from_dict({"prompt": PROMPTS * 2, "completion": REFERENCES * 2})
    trainer = trainer_class(trl.SFTTrainer)(
        model=tiny_gpt2(vocabulary_tokenizer),
        args=tiny_training_arguments(tmp_path, trl.SFTConfig, max_length=48, bf16=False),
        train_dataset=data,
        eval_dataset=data,  # prepared by the trainer (TRL 0.20 prepares no dataset given later)
        processing_class=vocabulary_tokenizer,
        bertscore_loss=soft_loss,
        bertscore_weight=Balanced(1.0),
        bertscore_candidates=SampledAnswers(max_new_tokens=3),
        bertscore_fused=False,
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    seen = []
    score = soft_loss.score

    def recording(*args, **kwargs):
        seen.append((kwargs["candidate_mask"].sum(1).tolist(), list(kwargs["references"])))
        return score(*args, **kwargs)

    soft_loss.score = recording
    try:
        trainer.train()
        trained = len(seen)
        metrics = trainer.evaluate()
    finally:
        del soft_loss.score
    assert trained == 2
    completions = sft_completions(trainer.train_dataset, vocabulary_tokenizer)
    assert all(any(r.lower().endswith(c) for r in REFERENCES) for c in completions)
    for counts, references in seen[:trained]:
        assert all(1 <= c <= 3 for c in counts)  # the answers: at most max_new_tokens
        assert completions == {r.replace(" [SEP]", "") for r in references}
    # evaluation scored the labels' teacher-forced distributions (their completions are
    # longer than an answer can be)
    assert len(seen) > trained and all(c > 3 for counts, _ in seen[trained:] for c in counts)
    logged = [e for e in trainer.state.log_history if "bertscore_weight" in e]
    assert len(logged) == 2 and all(e["bertscore_weight"] > 0 and e["ce"] > 0 for e in logged)
    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())
    assert 0 < metrics["eval_bertscore_f"] <= 1


def test_greedy_answers_in_seq2seq_trainer(soft_loss, vocabulary_tokenizer, tmp_path):
    """Seq2SeqTrainer on a tiny BERT2BERT: the answers are the decoder's greedy outputs, scored
    from the one joined pass; the loss equals the term called by hand."""
    from _models import tiny_bert2bert

    model = without_dropout(tiny_bert2bert(vocabulary_tokenizer))
    rows = [
        {
            "input_ids": vocabulary_tokenizer(p)["input_ids"],
            "labels": vocabulary_tokenizer(r)["input_ids"][1:],
        }
        for p, r in zip(PROMPTS, REFERENCES, strict=True)
    ]
    collator = transformers.DataCollatorForSeq2Seq(vocabulary_tokenizer, model=model)
    trainer = trainer_class(transformers.Seq2SeqTrainer)(
        model=model,
        args=tiny_training_arguments(tmp_path, transformers.Seq2SeqTrainingArguments),
        train_dataset=datasets.Dataset.from_list(rows * 2),
        data_collator=collator,
        processing_class=vocabulary_tokenizer,
        bertscore_loss=soft_loss,
        bertscore_candidates=GreedyAnswers(max_new_tokens=5),
    )
    batch = collator(rows)
    model.train()
    value = trainer.compute_loss(model, {k: v.clone() for k, v in batch.items()})
    model.eval()
    with torch.no_grad():
        generated = model.generate(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            do_sample=False,
            max_new_tokens=5,
            pad_token_id=vocabulary_tokenizer.pad_token_id,
            eos_token_id=[vocabulary_tokenizer.sep_token_id],
        )
    model.train()
    answers = generated_labels(generated, vocabulary_tokenizer.sep_token_id)
    term = BERTScoreTerm(soft_loss, vocabulary_tokenizer, causal=False)

    def forward(labels):
        return model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            decoder_input_ids=model.prepare_decoder_input_ids_from_labels(labels=labels),
        )

    by_hand = term(
        forward(batch["labels"]),
        batch["labels"],
        candidate_outputs=forward(answers),
        candidate_labels=answers,
    )
    assert abs(value.item() - by_hand.item()) < 1e-5
    trainer.train()
    assert trainer.state.global_step == 2


def test_candidate_sources_resolve_and_refuse_named():
    assert resolve_candidates("teacher_forced") == TeacherForced()
    assert resolve_candidates("greedy") == GreedyAnswers()
    assert resolve_candidates(SampledAnswers(top_k=5)).top_k == 5
    with pytest.raises(ValueError, match="bertscore_candidates must be one of"):
        resolve_candidates("beam", "bertscore_candidates")
    with pytest.raises(ValueError, match=r"SampledAnswers\(top_p\)"):
        SampledAnswers(top_p=0.0)
    with pytest.raises(ValueError, match=r"GreedyAnswers\(max_new_tokens\)"):
        GreedyAnswers(max_new_tokens=0)
    with pytest.raises(ValueError, match=r"SampledAnswers\(temperature\)"):
        SampledAnswers(temperature=float("nan"))
    with pytest.raises(ValueError, match=r"SampledAnswers\(top_k\)"):
        SampledAnswers(top_k=-1)


def test_answer_options_take_any_number_type_and_refuse_bools_named():
    """Numbers of any numeric type (numpy's) are accepted and stored as Python numbers; a
    bool, a float where an integer belongs or a string is refused, the parameter named."""
    np = pytest.importorskip("numpy")
    options = SampledAnswers(
        max_new_tokens=np.int64(8),
        top_k=np.int32(5),
        top_p=np.float32(0.5),
        temperature=np.float64(0.7),
    )
    assert options == SampledAnswers(max_new_tokens=8, top_k=5, top_p=0.5, temperature=0.7)
    assert type(options.max_new_tokens) is int and type(options.top_p) is float
    for field, value in [
        ("top_p", True),
        ("temperature", True),
        ("max_new_tokens", True),
        ("top_k", False),
        ("max_new_tokens", 8.0),
        ("top_p", "0.9"),
    ]:
        with pytest.raises(TypeError, match=rf"SampledAnswers\({field}\)"):
            SampledAnswers(**{field: value})
    with pytest.raises(ValueError, match=r"GreedyAnswers\(top_p\) must be in \(0, 1\]"):
        GreedyAnswers(top_p=float("nan"))


def test_answer_options_are_keywords_and_the_class_fixes_sample():
    """SampledAnswers(64) set the first field, sample, to 64 (a truthy "sample"), and
    GreedyAnswers(True) sampled; GreedyAnswers(top_k=5) decoded greedily without it. Each is
    refused, named; ModelAnswers still takes sample=, a bool."""
    for build in (lambda: SampledAnswers(64), lambda: GreedyAnswers(True)):
        with pytest.raises(TypeError, match="positional argument"):
            build()
    with pytest.raises(TypeError, match="unexpected keyword argument 'sample'"):
        GreedyAnswers(sample=True)
    with pytest.raises(TypeError, match=r"ModelAnswers\(sample\) must be a bool, got 0"):
        ModelAnswers(sample=0)
    assert ModelAnswers(sample=False).sample is False and GreedyAnswers().sample is False
    assert SampledAnswers(max_new_tokens=64).sample is True
    for option, value in (("top_k", 5), ("top_p", 0.9), ("temperature", 0.7)):
        with pytest.raises(ValueError, match=rf"GreedyAnswers\({option}=.*greedy decoding"):
            GreedyAnswers(**{option: value})
        with pytest.raises(ValueError, match=rf"ModelAnswers\({option}="):
            ModelAnswers(sample=False, **{option: value})


def test_generated_labels_end_at_the_first_end_token():
    """Padding is decided by position: everything after the first end token, never a token
    before it (a generated padding id is a token of the answer), and the end token is kept
    also when it is the padding id."""
    sequences = torch.tensor([[9, 5, 7, 2, 5, 0], [9, 3, 0, 4, 1, 5]])
    assert generated_labels(sequences, eos=[2, 1]).tolist() == [
        [5, 7, 2, -100, -100],
        [3, 0, 4, 1, -100],
    ]
    # pad == eos (GPT-2 / Qwen style): an answer that ends at once is its end token
    assert generated_labels(torch.tensor([[9, 2, 2, 2], [9, 5, 2, 2]]), eos=2).tolist() == [
        [2, -100, -100],
        [5, 2, -100],
    ]


def test_end_tokens_and_labels_are_checked_named():
    """Audit h26: ``eos=None`` or ``"2"`` failed inside torch, ``[2.0]`` was taken and ``[]``
    let every answer run to its limit unnoticed; ``answer()``'s labels of another row count or
    rank failed in a ``zip`` or a ``sum(1)``, and an int ``eos_token_ids`` in ``list()``."""
    sequences = torch.tensor([[9, 5, 2, 2]])
    assert generated_labels(sequences, eos=torch.tensor([2])).tolist() == [[5, 2, -100]]
    for eos, error, message in (
        (None, TypeError, "eos must be a token id or a list of them, got None"),
        ("2", TypeError, "eos must be a token id or a list of them, got '2'"),
        ([2.0], TypeError, r"eos\[0\] must be an integer, got float"),
        ([], ValueError, "eos is empty"),
    ):
        with pytest.raises(error, match=message):
            generated_labels(sequences, eos=eos)
    inputs = {"input_ids": torch.zeros(2, 4, dtype=torch.long)}
    options = dict(causal=True, pad_token_id=0)
    for labels in (torch.zeros(3, 4, dtype=torch.long), torch.zeros(4, dtype=torch.long)):
        with pytest.raises(ValueError, match=r"labels must be \[B, L\] with input_ids' 2 rows"):
            ModelAnswers().answer(None, inputs, labels, eos_token_ids=[1], **options)
    with pytest.raises(ValueError, match="eos_token_ids is empty"):
        ModelAnswers().answer(None, inputs, torch.zeros(2, 4), eos_token_ids=[], **options)


def with_padding(vocabulary_tokenizer, pad_token: str):
    """A copy of ``tokenizer`` whose padding token is ``pad_token``."""
    vocabulary_tokenizer = copy.deepcopy(vocabulary_tokenizer)
    vocabulary_tokenizer.pad_token = pad_token
    return vocabulary_tokenizer


def scripted_answers(vocabulary_tokenizer) -> list[list[int]]:
    """An answer that ends at once, and one with a [PAD] and a [MASK] token inside it."""
    ids = vocabulary_tokenizer.convert_tokens_to_ids(["cat", "[PAD]", "[MASK]", "sat"])
    return [[vocabulary_tokenizer.sep_token_id], ids + [vocabulary_tokenizer.sep_token_id]]


def scripted_step(soft_loss, vocabulary_tokenizer, pad_token: str):
    """The greedy answers' joined batch under ``scripted_answers``, the padding token being
    ``pad_token``, and the term (weight 1) on its one forward pass."""
    padded = with_padding(vocabulary_tokenizer, pad_token)
    batch = causal_batch(padded)
    labels = batch.pop("labels")
    model = without_dropout(
        scripted(tiny_gpt2(vocabulary_tokenizer), scripted_answers(vocabulary_tokenizer))
    )
    joint = causal_answers(model, batch, labels, padded, GreedyAnswers(max_new_tokens=6))
    model.eval()
    with torch.no_grad():
        logits, own = joint.split(model(**joint.inputs).logits)
        term = BERTScoreTerm(soft_loss, padded, weight=1.0, causal=True)
        value = term(
            {"logits": logits},
            labels,
            candidate_outputs={"logits": own},
            candidate_labels=joint.candidate_labels,
        )
    return batch, labels, joint, value


def test_answers_keep_their_end_token_whatever_the_padding_id(soft_loss, vocabulary_tokenizer):
    """The same generated answers give the same candidates and the same term whether the
    padding id is the end token [SEP] itself (GPT-2 / Qwen style), [PAD] (0) or [MASK]: each
    answer keeps its end token (one that ends at once is that token, not an empty candidate
    that adds nothing to the term)."""
    answers = scripted_answers(vocabulary_tokenizer)
    values = []
    for pad_token in ("[SEP]", "[PAD]", "[MASK]"):
        batch, labels, joint, value = scripted_step(soft_loss, vocabulary_tokenizer, pad_token)
        for i, answer in enumerate(answers):
            prompt = int(batch["attention_mask"][i, : (labels[i] != -100).int().argmax()].sum())
            got = joint.candidate_labels[i]
            assert got[prompt : prompt + len(answer)].tolist() == answer, pad_token
            assert (got[:prompt] == -100).all() and (got[prompt + len(answer) :] == -100).all()
        values.append(value)
    for value in values[1:]:
        torch.testing.assert_close(value, values[0], rtol=0, atol=1e-6)


def test_a_generated_padding_id_is_fed_back_as_generated(soft_loss, vocabulary_tokenizer):
    """A padding id the model generated inside its answer ([MASK] as the padding token) is a
    token of the answer: fed back to the model as that token (not as id 0), attended, and
    scored."""
    batch, labels, joint, _ = scripted_step(soft_loss, vocabulary_tokenizer, "[MASK]")
    answer = scripted_answers(vocabulary_tokenizer)[1]
    prompt = int(batch["attention_mask"][1, : (labels[1] != -100).int().argmax()].sum())
    span = slice(prompt, prompt + len(answer))
    own_ids, own_mask = joint.inputs["input_ids"][3], joint.inputs["attention_mask"][3]
    assert own_ids[span].tolist() == answer
    assert own_mask.sum() == span.stop and own_mask[: span.stop].all()
    assert joint.candidate_labels[1, span].tolist() == answer


def test_bad_batches_are_refused_named(soft_loss, vocabulary_tokenizer, tmp_path):
    """A completion with no prompt before it and a packed batch (position_ids) are refused with
    the row or the key named; the trainer is usable after the refusal."""
    trainer = causal_trainer(
        soft_loss, vocabulary_tokenizer, tmp_path, bertscore_candidates="sample"
    )
    model = trainer.model
    model.train()
    batch = causal_batch(vocabulary_tokenizer)
    no_prompt = {k: v.clone() for k, v in batch.items()}
    no_prompt["labels"][1] = no_prompt["input_ids"][1].masked_fill(
        no_prompt["attention_mask"][1] == 0, -100
    )
    with pytest.raises(ValueError, match="labels row 1: its completion starts at position 0"):
        trainer.compute_loss(model, no_prompt)
    packed = {**{k: v.clone() for k, v in batch.items()}, "position_ids": torch.zeros(2, 1)}
    with pytest.raises(ValueError, match=r"\['position_ids'\]"):
        trainer.compute_loss(model, packed)
    value = trainer.compute_loss(model, {k: v.clone() for k, v in batch.items()})
    assert torch.isfinite(value)


def test_a_row_without_labels_gets_no_answer_scored(soft_loss, vocabulary_tokenizer, tmp_path):
    """A row whose labels are all -100 (nothing to train on) has no reference: its answer is
    not scored (no empty-reference score), and the step is the other row's."""
    trainer = causal_trainer(
        soft_loss, vocabulary_tokenizer, tmp_path, bertscore_candidates="greedy"
    )
    model = without_dropout(trainer.model).train()
    batch = causal_batch(vocabulary_tokenizer)
    batch["labels"][1] = -100
    labels = batch["labels"].clone()
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}
    joint = causal_answers(model, inputs, labels, vocabulary_tokenizer)
    assert (joint.candidate_labels[1] == -100).all() and (joint.candidate_labels[0] != -100).any()
    both = trainer.compute_loss(model, {k: v.clone() for k, v in batch.items()})
    alone = trainer.compute_loss(model, {k: v[:1].clone() for k, v in batch.items()})
    assert torch.isfinite(both) and abs(both.item() - alone.item()) < 1e-5


@pytest.mark.slow  # two processes each load the scorer
@pytest.mark.parametrize("mode", DISTRIBUTED_MODES)
def test_answers_across_processes_equal_each_half_run_alone(
    scorer, vocabulary_tokenizer, tmp_path, mode
):
    """Two CPU processes (gloo) under DDP or FSDP 2, each answering its half of the batch with
    a different answer length (so their generation loops differ): each process's answers are
    the ones a single process gives for that half, and the reduced gradients (fused and dense)
    are the mean of the two halves' gradients computed in one process."""
    from _distributed_candidates import ROWS, answered_gradients
    from _distributed_lm_head import distributed_model
    from test_distributed_scoring import run_two_processes

    if mode == "fsdp" and TorchVersion(torch.__version__) < (2, 11):
        pytest.skip(
            "torch 2.8's FSDP 2 on CPU tensors (gloo) sums the two processes' gradients (2x "
            "the mean here, fused and dense alike); under 2.11 and later it averages them, as "
            "DDP does"
        )
    ranks = run_two_processes("_distributed_candidates.py", tmp_path, mode)

    term = BERTScoreTerm(
        bsloss.BERTScoreLoss(encoder=scorer.encoder), vocabulary_tokenizer, weight=1.0
    )
    alone = []
    for rows in ROWS:
        model, _ = distributed_model(vocabulary_tokenizer, tied=True, mode="none")
        alone.append(
            answered_gradients(model, model, term, vocabulary_tokenizer, rows, fused=False)
        )
    lengths = [int((a["answers"] != -100).sum(1).max()) for a in alone]
    assert lengths[0] != lengths[1], lengths  # the processes generated for different lengths
    mean = {n: (alone[0]["grads"][n] + alone[1]["grads"][n]) / 2 for n in alone[0]["grads"]}
    for path in ("fused", "dense"):
        for rank in (0, 1):
            got = ranks[rank][path]
            assert torch.equal(got["answers"], alone[rank]["answers"]), (path, rank)
            assert got["grads"].keys() == mean.keys()
            for name, want in mean.items():
                torch.testing.assert_close(
                    got["grads"][name], want, rtol=0, atol=1e-5, msg=f"{path} rank {rank}: {name}"
                )


def test_accumulated_micro_batches_step_as_the_whole_batch(
    soft_loss, vocabulary_tokenizer, tmp_path
):
    """One optimizer step (SGD) over 2 rows with generated answers and a fixed weight: as one
    batch of 2, or as 2 accumulated micro-batches of 1 (the trainer then passes the whole
    batch's token count, num_items_in_batch, and does not divide by the accumulation steps).
    The rows' references and answers have equal token counts, so the two must move the
    parameters alike; a term averaged over each micro-batch alone counted twice (found by this
    test). (A Balanced weight is a ratio of each micro-batch's own means: not linear in the
    batch, so not compared here.)"""
    batch = causal_batch(vocabulary_tokenizer)
    assert len(set((batch["labels"] != -100).sum(1).tolist())) == 1  # equal reference lengths
    rows = [{k: v[i].tolist() for k, v in batch.items()} for i in range(2)]
    moved = []
    for size, accumulation in ((2, 1), (1, 2)):
        model = without_dropout(tiny_gpt2(vocabulary_tokenizer))
        start = {n: p.detach().clone() for n, p in model.named_parameters()}
        trainer = trainer_class(transformers.Trainer)(
            model=model,
            args=tiny_training_arguments(
                tmp_path,
                max_steps=1,
                per_device_train_batch_size=size,
                gradient_accumulation_steps=accumulation,
                optim="sgd",
                learning_rate=1.0,
                max_grad_norm=0.0,
                lr_scheduler_type="constant",
            ),
            train_dataset=datasets.Dataset.from_list(rows),
            processing_class=vocabulary_tokenizer,
            bertscore_loss=soft_loss,
            bertscore_weight=1.0,
            bertscore_candidates=GreedyAnswers(max_new_tokens=3),
        )
        trainer.train()
        moved.append({n: p.detach() - start[n] for n, p in model.named_parameters()})
    assert any(d.abs().max() > 0 for d in moved[0].values())
    for name, delta in moved[0].items():
        torch.testing.assert_close(moved[1][name], delta, rtol=1e-4, atol=1e-6, msg=name)


def test_answers_with_gradient_checkpointing_equal_the_step_without(
    soft_loss, vocabulary_tokenizer, tmp_path
):
    """gradient_checkpointing=True (the model recomputes its blocks in backward, and turns its
    KV cache off for training): the answers are generated in eval mode as without it, and the
    step's loss and gradients are the same."""
    batch = causal_batch(vocabulary_tokenizer)
    results = []
    for checkpointing in (False, True):
        trainer = causal_trainer(
            soft_loss, vocabulary_tokenizer, tmp_path, bertscore_candidates="greedy"
        )
        if checkpointing:
            trainer.model.gradient_checkpointing_enable()
        model = without_dropout(trainer.model).train()
        value = trainer.compute_loss(model, {k: v.clone() for k, v in batch.items()})
        value.backward()
        results.append((value.detach(), {n: p.grad for n, p in model.named_parameters()}))
        # transformers 5 renamed the flag (the old name warns)
        flag = getattr(model, "is_activation_checkpointing", None)
        flag = model.is_gradient_checkpointing if flag is None else flag
        assert flag == checkpointing and model.training
    (plain, plain_grads), (checkpointed, checkpointed_grads) = results
    torch.testing.assert_close(checkpointed, plain, rtol=0, atol=1e-6)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(checkpointed_grads[name], grad, rtol=0, atol=1e-6, msg=name)


def test_a_streamer_follows_every_answering_call_and_changes_no_answer(vocabulary_tokenizer):
    """``streamer=`` reaches ``model.generate`` (the prompt, then one put per decoding step,
    then ``end``), the answers stay those without it, and it is not one of the options."""

    class Recorder:
        def __init__(self):
            self.puts, self.ends = 0, 0

        def put(self, value):
            self.puts += 1

        def end(self):
            self.ends += 1

    model = tiny_gpt2(vocabulary_tokenizer)
    batch = causal_batch(vocabulary_tokenizer)
    labels = batch.pop("labels")
    special = dict(
        pad_token_id=vocabulary_tokenizer.pad_token_id,
        eos_token_ids=[vocabulary_tokenizer.sep_token_id],
    )
    recorder = Recorder()
    streamed = GreedyAnswers(max_new_tokens=3, streamer=recorder)
    assert streamed == GreedyAnswers(max_new_tokens=3) and "streamer" not in repr(streamed)
    with_streamer = streamed.answer(model, batch, labels, causal=True, **special)
    without = GreedyAnswers(max_new_tokens=3).answer(model, batch, labels, causal=True, **special)
    assert torch.equal(with_streamer.candidate_labels, without.candidate_labels)
    assert recorder.ends == 1 and 2 <= recorder.puts <= 1 + 3


def test_a_row_whose_labels_have_gaps_gets_no_answer(soft_loss, vocabulary_tokenizer, tmp_path):
    """Labels with -100 between two parts (a multi-turn row, an assistant-only loss): the
    answer followed the first part's prompt alone and was scored against both parts joined.
    Refused, the row named; the trainer is usable after."""
    trainer = causal_trainer(
        soft_loss, vocabulary_tokenizer, tmp_path, bertscore_candidates="greedy"
    )
    model = trainer.model
    model.train()
    batch = causal_batch(vocabulary_tokenizer)
    gapped = {k: v.clone() for k, v in batch.items()}
    first = int((gapped["labels"][1] != -100).int().argmax())
    gapped["labels"][1, first + 1] = -100
    with pytest.raises(
        ValueError, match=rf"labels row 1 has -100 between its labels \(positions {first} to"
    ):
        trainer.compute_loss(model, gapped)
    assert torch.isfinite(trainer.compute_loss(model, {k: v.clone() for k, v in batch.items()}))


def test_answers_are_cut_to_the_models_positions(soft_loss, vocabulary_tokenizer, tmp_path):
    """A long prompt in one row and a long reference in another, each row within the model's
    positions: the answers' budget (the batch's longest reference) ran past them, and
    generation failed inside torch (an embedding index out of range). Now the budget is cut,
    with a warning naming both lengths."""
    tokens = lambda text: vocabulary_tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    prompts = [
        tokens("summarize : a dog ran in the long park today and then it rained hard"),
        tokens("say :"),
    ]
    answers = [
        tokens("a dog ran"),
        tokens("the cat sat on the mat while the rain fell all day long"),
    ]
    rows = [p + a for p, a in zip(prompts, answers, strict=True)]
    width = max(map(len, rows))
    assert len(prompts[0]) + len(answers[1]) > width  # the case: prompt + budget past the rows
    sep = vocabulary_tokenizer.pad_token_id
    batch = {
        "input_ids": torch.tensor([r + [sep] * (width - len(r)) for r in rows]),
        "attention_mask": torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows]),
        "labels": torch.tensor(
            [
                [-100] * len(p) + a + [-100] * (width - len(p) - len(a))
                for p, a in zip(prompts, answers, strict=True)
            ]
        ),
    }
    trainer = causal_trainer(
        soft_loss, vocabulary_tokenizer, tmp_path, bertscore_candidates="greedy"
    )
    trainer.model = model = tiny_gpt2(vocabulary_tokenizer, n_positions=width)
    model.train()
    with pytest.warns(
        UserWarning, match=rf"cut at {width - len(prompts[0])} new tokens .* {width} positions"
    ):
        value = trainer.compute_loss(model, batch)
    assert torch.isfinite(value)


@pytest.mark.parametrize("source", ["greedy", "sampled"])
def test_an_encoder_decoders_answers_are_cut_to_its_decoders_positions(source):
    """An encoder-decoder's answers were not fitted to its decoder's positions (a causal
    model's are, with a warning): max_new_tokens=40 on a BART of 32 positions failed inside
    generate, "IndexError: index out of range in self". They are cut to the decoder's positions
    (its start token included), with the same warning, and the joint forward runs."""
    from _models import tiny_seq2seq

    from bsloss.integrations.candidates import GreedyAnswers, SampledAnswers

    model = tiny_seq2seq("bart")  # 32 positions, vocabulary 97, pad 1, eos 2
    answers = {"greedy": GreedyAnswers, "sampled": SampledAnswers}[source](max_new_tokens=40)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 97, (2, 10), generator=generator)
    labels = torch.randint(3, 97, (2, 6), generator=generator)
    with pytest.warns(UserWarning, match="cut at 31 new tokens .* decoder takes 32 positions"):
        joint = answers.answer(
            model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, labels,
            causal=False, pad_token_id=1, eos_token_ids=[2],
        )  # fmt: skip
    assert joint.candidate_labels.shape[1] <= 31
    assert torch.isfinite(model(**joint.inputs).logits).all()


# What a shipped generation_config may carry (Qwen2.5-Instruct: repetition_penalty=1.05;
# bart-large-cnn: no_repeat_ngram_size=3, min_length=56, forced_eos_token_id=2): each changed
# the answers silently, or (num_return_sequences, return_dict_in_generate) broke the step.
def leaking_generation_settings(first: int, eos: int) -> list[dict]:
    return [
        {"repetition_penalty": 5.0},
        {"no_repeat_ngram_size": 1},
        {"bad_words_ids": [[first]]},
        {"suppress_tokens": [first]},
        {"begin_suppress_tokens": [first]},
        {"sequence_bias": {(first,): -100.0}},
        {"forced_eos_token_id": eos},
        {"exponential_decay_length_penalty": (1, 10.0)},
        {"do_sample": True, "num_return_sequences": 2},
        {"do_sample": True, "temperature": 0.7, "top_k": 20, "top_p": 0.8, "min_p": 0.3},
        {"do_sample": True, "typical_p": 0.2, "epsilon_cutoff": 0.1},
        {"return_dict_in_generate": True, "output_scores": True},
        # refused by generate for these batches (audit h22, N2): token healing wants the
        # tokenizer, prompt lookup a batch of one
        {"token_healing": True},
        {"prompt_lookup_num_tokens": 3},
    ]


# a minimum length keeps an answer from ending where the model ends it
MINIMUM_LENGTHS = [{"min_new_tokens": 8}, {"min_length": 40}]


def answers_under(model, answers, settings: dict, answer, end: int, seed: int = 0):
    """``answer(answers, end)``'s candidate labels (answers ending at token ``end``) with
    ``settings`` set on the model's generation_config (restored after), the sampling seeded."""
    config = model.generation_config
    saved = copy.deepcopy(config)
    for name, value in settings.items():
        setattr(config, name, value)
    try:
        torch.manual_seed(seed)
        return answer(answers, end).candidate_labels
    finally:
        model.generation_config = saved


def assert_config_leaves_answers(model, options, answer, eos: int, extra=()):
    """Under each leaking setting (and ``extra``), the answers equal the plain config's;
    under a minimum length too, the answers ending at the first answer's last token (8 new
    tokens at most: a minimum of 8 would keep it from ending)."""
    plain = answers_under(model, options, {}, answer, eos)
    answered = plain[0][plain[0] != -100]
    first, last = int(answered[0]), int(answered[-1])
    for settings in [*leaking_generation_settings(first, eos), *extra]:
        assert torch.equal(answers_under(model, options, settings, answer, eos), plain), settings
    ending = answers_under(model, options, {}, answer, last)
    for settings in MINIMUM_LENGTHS:
        assert torch.equal(answers_under(model, options, settings, answer, last), ending), settings


@pytest.mark.parametrize("source", ["greedy", "sampled"])
def test_the_models_generation_config_does_not_change_its_answers(vocabulary_tokenizer, source):
    """The answers are the model's argmax (or samples of its distribution) under the explicit
    options only: a repetition penalty, n-gram blocking, a minimum length, suppressed / bad /
    biased words, a forced end or a return layout in the model's ``generation_config`` changed
    them silently (``no_repeat_ngram_size=1``: a different greedy answer; ``min_new_tokens``:
    answers that cannot end) or broke the step (``num_return_sequences=2``: "zip() argument 2
    is longer than argument 1")."""
    model = tiny_gpt2(vocabulary_tokenizer)
    batch = causal_batch(vocabulary_tokenizer)
    labels = batch.pop("labels")
    options = {"greedy": GreedyAnswers, "sampled": SampledAnswers}[source](max_new_tokens=8)

    def answer(answers, end):
        return answers.answer(
            model, batch, labels, causal=True,
            pad_token_id=vocabulary_tokenizer.pad_token_id, eos_token_ids=[end],
        )  # fmt: skip

    assert_config_leaves_answers(model, options, answer, vocabulary_tokenizer.sep_token_id)


def test_an_encoder_decoders_answers_ignore_its_generation_config_but_its_forced_start():
    """The same for an encoder-decoder, with the encoder-side settings
    (``encoder_no_repeat_ngram_size``, ``encoder_repetition_penalty``); the language-picking
    ``forced_bos_token_id`` (mBART, NLLB) stays the config's: the answers start with it."""
    from _models import tiny_seq2seq

    model = tiny_seq2seq("bart")  # 32 positions, vocabulary 97, pad 1, eos 2
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 97, (2, 10), generator=generator)
    labels = torch.randint(3, 97, (2, 6), generator=generator)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    def answer(answers, end):
        return answers.answer(
            model, inputs, labels, causal=False, pad_token_id=1, eos_token_ids=[end]
        )

    options = GreedyAnswers(max_new_tokens=8)
    encoder_side = [{"encoder_no_repeat_ngram_size": 1}, {"encoder_repetition_penalty": 5.0}]
    assert_config_leaves_answers(model, options, answer, 2, extra=encoder_side)
    forced = answers_under(model, options, {"forced_bos_token_id": 50}, answer, 2)
    assert forced[:, 0].tolist() == [50, 50]


def test_a_source_with_other_decoding_is_a_small_subclass(vocabulary_tokenizer):
    """A source that wants a processor after all (here a repetition penalty) overrides
    ``ModelAnswers.generate``: its answers change, the greedy ones do not."""

    class PenalisedAnswers(GreedyAnswers):
        def generate(self, model, input_ids, attention_mask, **options):
            return super().generate(
                model, input_ids, attention_mask, repetition_penalty=5.0, **options
            )

    model = tiny_gpt2(vocabulary_tokenizer)
    batch = causal_batch(vocabulary_tokenizer)
    labels = batch.pop("labels")
    greedy = causal_answers(
        model, batch, labels, vocabulary_tokenizer, GreedyAnswers(max_new_tokens=8)
    )
    penalised = causal_answers(
        model, batch, labels, vocabulary_tokenizer, PenalisedAnswers(max_new_tokens=8)
    )
    assert not torch.equal(greedy.candidate_labels, penalised.candidate_labels)
