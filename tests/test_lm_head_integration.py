"""The trainer integration's fused LM-head path (bsloss.integrations.lm_head): a Trainer or
SFTTrainer step with the BERTScore term on a model with Gemma 3's real 262,144-token vocabulary
never makes [B, L, V] float32 logits (its logits chunks stay under the fused pass's bound of
4M elements, 16 MB), peaks lower than the dense path by at least their size,
and gives the dense path's loss and gradients (within 1e-5); causal and encoder-decoder models,
tied and untied heads, a soft-capped head; under DDP and FSDP 2 on two gloo processes; FSDP 1's
wrapper is refused, named."""

from __future__ import annotations

import copy
import math
import weakref

import pytest
import torch
from _helpers import DISTRIBUTED_MODES, tiny_training_arguments
from _models import (
    scorer_vocabulary_tokenizer,
    tiny_gemma,
    tiny_gpt2,
    tiny_paligemma,
    tiny_seq2seq,
)
from packaging import version
from torch.utils._python_dispatch import TorchDispatchMode

import bsloss
from bsloss.functional.fused_expectation import DEFAULT_CHUNK_ELEMENTS
from bsloss.integrations.huggingface import BERTScoreTrainerMixin
from bsloss.integrations.lm_head import lm_head_inputs, lm_head_refusal, token_cross_entropy

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

PROMPTS = ["Translate: el gato duerme.", "Translate: la casa es grande y vieja."]
REFERENCES = ["The cat sleeps.", "The house is big and old."]


class AllocationRecorder(TorchDispatchMode):
    """Every op's newly allocated outputs: the floating ones with last dimension ``vocab`` and
    more than ``limit`` elements (logits beyond the fused pass's chunk bound), the largest, and
    the peak of the bytes held by them (each counted until Python frees it; views and in-place
    results, which share an input's storage, are not new)."""

    def __init__(self, vocab: int, limit: int):
        super().__init__()
        self.vocab, self.limit = vocab, limit
        self.logits_like: list[tuple[tuple[int, ...], torch.dtype]] = []
        self.live = self.peak = self.largest = 0

    def _release(self, size: int) -> None:
        self.live -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # a view (or an in-place result) shares an input's storage: nothing new was allocated
        inputs = {
            t.untyped_storage().data_ptr()
            for t in torch.utils._pytree.tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if not isinstance(t, torch.Tensor) or t.untyped_storage().data_ptr() in inputs:
                continue
            size = t.numel() * t.element_size()
            self.largest = max(self.largest, size)
            if (
                t.is_floating_point()
                and t.dim() >= 2
                and t.shape[-1] == self.vocab
                and t.numel() > self.limit
            ):
                self.logits_like.append((tuple(t.shape), t.dtype))
            self.live += size
            self.peak = max(self.peak, self.live)
            weakref.finalize(t, self._release, size)
        return out


def causal_rows(tokenizer) -> list[dict]:
    """Prompt + reference + end of turn, labels -100 on the prompt."""
    rows = []
    for prompt, reference in zip(PROMPTS, REFERENCES, strict=True):
        p = tokenizer(prompt)["input_ids"]
        r = tokenizer(" " + reference, add_special_tokens=False)["input_ids"]
        r = r + [tokenizer.eos_token_id]
        rows.append({"input_ids": p + r, "labels": [-100] * len(p) + r})
    return rows


def collate(tokenizer):
    def collator(features: list[dict]) -> dict:
        width = max(len(f["input_ids"]) for f in features)
        pad = tokenizer.pad_token_id

        def padded(key, value):
            return torch.tensor([f[key] + [value] * (width - len(f[key])) for f in features])

        mask = [[1] * len(f["input_ids"]) + [0] * (width - len(f["input_ids"])) for f in features]
        return {
            "input_ids": padded("input_ids", pad),
            "attention_mask": torch.tensor(mask),
            "labels": padded("labels", -100),
        }

    return collator


@pytest.fixture(scope="module")
def gemma_loss(scorer, gemma_tokenizer):
    return bsloss.BERTScoreLoss(
        encoder=scorer.encoder, matching="softmax", generator_tokenizer=gemma_tokenizer
    )


def trainer_args(tmp_path, cls=None, **extra):
    return tiny_training_arguments(tmp_path, cls, **{"max_steps": 1, **extra})


def step_gradients(trainer, model, batch: dict) -> tuple[torch.Tensor, dict, AllocationRecorder]:
    """One training step's loss and gradients (the trainer's compute_loss, then backward), with
    the allocations recorded."""
    model.zero_grad(set_to_none=True)
    vocab = model.config.get_text_config().vocab_size
    # the fused pass's logits chunks are bounded by DEFAULT_CHUNK_ELEMENTS whatever B and L
    assert batch["input_ids"].numel() * vocab > 1.5 * DEFAULT_CHUNK_ELEMENTS
    with AllocationRecorder(vocab, DEFAULT_CHUNK_ELEMENTS) as recorder:
        loss = trainer.compute_loss(model, dict(batch))
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, recorder


def causal_trainer(model, tokenizer, loss, tmp_path, rows: list[dict], **options):
    """A ``Trainer`` with the mixin (and ``options``) over ``rows``, its first step's fused and
    dense passes recorded (after an unrecorded one: the loss builds and caches its bridged
    embedding table [V, d + 1] then)."""

    class Trainer(BERTScoreTrainerMixin, transformers.Trainer):
        pass

    trainer = Trainer(
        model=model,
        args=trainer_args(tmp_path),
        train_dataset=datasets.Dataset.from_list(rows),
        data_collator=collate(tokenizer),
        processing_class=tokenizer,
        bertscore_loss=loss,
        **options,
    )
    assert trainer.bertscore_fused  # the default for a model with an LM head
    batch = collate(tokenizer)(rows)
    step_gradients(trainer, model, batch)
    fused = step_gradients(trainer, model, batch)
    trainer.bertscore_fused = False
    dense = step_gradients(trainer, model, batch)
    trainer.bertscore_fused = True
    return trainer, batch, fused, dense


def assert_same_step(fused, dense) -> None:
    (loss_f, grads_f, _), (loss_d, grads_d, _) = fused, dense
    torch.testing.assert_close(loss_f, loss_d, rtol=0, atol=1e-5)
    assert grads_f.keys() == grads_d.keys() and grads_f
    for name in grads_d:
        torch.testing.assert_close(grads_f[name], grads_d[name], rtol=0, atol=1e-5, msg=name)


def term_step(
    model,
    batch: dict,
    term,
    labels,
    fused: bool,
    *,
    seed: int | None = None,
    candidate_labels=None,
    **term_args,
) -> tuple[torch.Tensor, dict, None]:
    """BERTScoreTerm's value on ``model(**batch)`` and the model's gradients, the forward inside
    ``lm_head_inputs`` (its head passed to the term) or dense; ``candidate_labels``: the
    forward's outputs are the candidates too. ``seed`` is set before the forward (the same
    dropout masks or Gumbel noise in both passes). As :func:`assert_same_step` compares."""
    model.zero_grad(set_to_none=True)
    if seed is not None:
        torch.manual_seed(seed)
    if fused:
        with lm_head_inputs(model) as head:
            outputs = model(**batch)
    else:
        head, outputs = None, model(**batch)
    if candidate_labels is not None:
        term_args.update(candidate_outputs=outputs, candidate_labels=candidate_labels)
    value = term(outputs, labels, head=head, **term_args)
    value.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return value.detach(), grads, None


@pytest.mark.parametrize(
    "tied, softcap", [(True, None), (False, None), (True, 30.0)], ids=["tied", "untied", "softcap"]
)
def test_trainer_step_has_no_logits_and_equals_the_dense_step(
    tied, softcap, gemma_tokenizer, gemma_loss, tmp_path
):
    model = tiny_gemma(gemma_tokenizer, tied=tied, softcap=softcap)
    rows = causal_rows(gemma_tokenizer)
    trainer, batch, fused, dense = causal_trainer(
        model, gemma_tokenizer, gemma_loss, tmp_path, rows
    )
    assert_same_step(fused, dense)
    # the instrument sees the dense step's [B, L, V] float32 logits, and none in the fused one
    batch_size, length = batch["input_ids"].shape
    assert (batch_size, length, len(gemma_tokenizer)) in [s for s, _ in dense[2].logits_like]
    assert fused[2].logits_like == []
    # and a real training step runs through it
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer.train()
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())
    logged = [e for e in trainer.state.log_history if "bertscore_f" in e]
    assert logged and 0 <= logged[0]["bertscore_f"] <= 1 and logged[0]["ce"] > 0


def test_generated_answers_step_has_no_logits_and_equals_the_dense_step(
    gemma_tokenizer, gemma_loss, tmp_path
):
    """The model's greedy answers as the candidates (``bertscore_candidates="greedy"``, the
    answers joined to the batch) on the 262k-vocabulary Gemma with the real tokenizer and the
    retokenize bridge: the fused step allocates no [rows, L, V] logits (generation's own
    last-position logits, [rows, 1, V], are generate()'s), the dense step does for the joined
    batch, and the two agree within 1e-5."""
    from bsloss.integrations.term_weights import Balanced

    model = tiny_gemma(gemma_tokenizer)
    rows = causal_rows(gemma_tokenizer)
    _, batch, fused, dense = causal_trainer(
        model, gemma_tokenizer, gemma_loss, tmp_path, rows,
        bertscore_candidates="greedy", bertscore_weight=Balanced(1.0),
    )  # fmt: skip
    assert_same_step(fused, dense)
    sequence_logits = [[s for s, _ in r[2].logits_like if s[-2] > 1] for r in (fused, dense)]
    assert sequence_logits[0] == []
    rows_joined = 2 * batch["input_ids"].shape[0]  # the batch's rows, then the answers'
    assert any(s[0] == rows_joined for s in sequence_logits[1]), sequence_logits[1]


def test_fused_step_peaks_below_the_dense_step_by_the_logits(gemma_tokenizer, gemma_loss, tmp_path):
    """With the 262k x 48 embedding / head frozen (as the efficacy study trains Gemma), the
    step's memory is activations and logits: the fused step's peak is below the dense step's by
    at least the [B, L, V] float32 logits. (With it trainable, the three [V, d] gradient buffers
    of a tied head set both peaks alike.)"""

    model = tiny_gemma(gemma_tokenizer)
    model.get_input_embeddings().weight.requires_grad_(False)  # tied: the head too
    rows = causal_rows(gemma_tokenizer) * 2
    _, batch, fused, dense = causal_trainer(model, gemma_tokenizer, gemma_loss, tmp_path, rows)
    assert_same_step(fused, dense)
    logits_bytes = batch["input_ids"].numel() * len(gemma_tokenizer) * 4
    print(
        f"\npeak bytes held by the step's new tensors: fused {fused[2].peak / 2**20:.1f} MiB, "
        f"dense {dense[2].peak / 2**20:.1f} MiB (the logits: {logits_bytes / 2**20:.1f} MiB)"
    )
    assert fused[2].peak <= dense[2].peak - logits_bytes, (fused[2].peak, dense[2].peak)


def test_sft_trainer_step_has_no_logits_and_equals_the_dense_step(
    gemma_tokenizer, gemma_loss, tmp_path
):
    trl = pytest.importorskip("trl")

    class Trainer(BERTScoreTrainerMixin, trl.SFTTrainer):
        pass

    model = tiny_gemma(gemma_tokenizer)
    data = datasets.Dataset.from_dict(
        {"prompt": [p + " " for p in PROMPTS], "completion": REFERENCES}
    )
    trainer = Trainer(
        model=model,
        args=trainer_args(tmp_path, trl.SFTConfig, max_length=48, bf16=False),
        train_dataset=data,
        processing_class=gemma_tokenizer,
        bertscore_loss=gemma_loss,
    )
    batch = next(iter(trainer.get_train_dataloader()))
    fused = step_gradients(trainer, model, batch)
    trainer.bertscore_fused = False
    dense = step_gradients(trainer, model, batch)
    assert_same_step(fused, dense)
    assert dense[2].logits_like and fused[2].logits_like == []
    trainer.bertscore_fused = True
    trainer.train()
    assert [e for e in trainer.state.log_history if "bertscore_f" in e]


@pytest.mark.parametrize("kind", ["bart", "t5", "bert2bert"])
def test_lm_head_inputs_give_the_logits(kind):
    """Inside the block the model returns its head's input; the yielded head (bias and BART's
    final_logits_bias included) turns it back into the model's own logits; the model is
    restored after."""
    model = tiny_seq2seq(kind).eval()  # no dropout: two forward passes compared
    batch = {
        "input_ids": torch.tensor([[5, 6, 7, 8]]),
        "decoder_input_ids": torch.tensor([[2, 9, 10]]),
    }
    logits = model(**batch).logits
    with lm_head_inputs(model) as head:
        hidden = model(**batch).logits
    z = hidden @ head.weight.T + (0 if head.bias is None else head.bias)
    torch.testing.assert_close(z, logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(model(**batch).logits, logits, rtol=0, atol=0)
    # the blocks do not nest: said so (audit h26: "has no output embedding ... not a wrapper")
    with lm_head_inputs(model):
        assert "inside an lm_head_inputs block already" in lm_head_refusal(model)
        with pytest.raises(ValueError, match="the blocks do not nest"), lm_head_inputs(model):
            pass
    torch.testing.assert_close(model(**batch).logits, logits, rtol=0, atol=0)


def test_lm_head_inputs_applies_no_softcap_and_yields_it(gemma_tokenizer):
    model = tiny_gemma(gemma_tokenizer, softcap=2.0)
    ids = torch.tensor([[2, 100, 200]])
    logits = model(input_ids=ids).logits
    with lm_head_inputs(model) as head:
        hidden = model(input_ids=ids).logits
        assert head.softcap == 2.0 and model.config.final_logit_softcapping is None
    z = hidden @ head.weight.T
    torch.testing.assert_close(2.0 * torch.tanh(z / 2.0), logits, rtol=0, atol=1e-5)
    assert model.config.final_logit_softcapping == 2.0
    labels = torch.tensor([[100, -100, 5]])
    torch.testing.assert_close(
        token_cross_entropy(labels, hidden_states=hidden.detach(), head=head),
        token_cross_entropy(labels, logits=logits.detach()),
        rtol=0,
        atol=1e-5,
    )


def capped_model(kind: str, vocab_size: int = 97):
    """A tiny model whose forward reads its soft-cap (2) from a sub-config: T5Gemma from its
    decoder's config, PaliGemma (as Gemma 3n / 4) from its text config; the head scaled so
    that the cap bends the logits (a random head's are below 0.3)."""
    if kind == "t5gemma":
        model = tiny_seq2seq("t5gemma", vocab_size, softcap=2.0)
    else:
        model = tiny_paligemma(vocab_size, softcap=2.0)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(30.0)
    return model.eval()


def capped_batch(kind: str) -> dict:
    if kind == "t5gemma":
        return {"input_ids": torch.tensor([[5, 6, 7, 8]]),
                "decoder_input_ids": torch.tensor([[1, 9, 10, 11]])}  # fmt: skip
    return {"input_ids": torch.tensor([[5, 6, 7, 8]])}


def cap_the_model_applies(model, config, batch) -> float | None:
    """The cap ``config`` holds if the model's forward applies it (its logits change when the
    cap is taken out of ``config``), else None: what the model does, told apart by running it.
    transformers 5.24's PaliGemma applies its text config's cap; 5.17's holds it and never
    reads it."""
    cap = config.final_logit_softcapping
    capped = model(**batch).logits
    config.final_logit_softcapping = None
    try:
        plain = model(**batch).logits
    finally:
        config.final_logit_softcapping = cap
    return None if torch.equal(capped, plain) else cap


@pytest.mark.parametrize("kind", ["t5gemma", "paligemma"])
def test_lm_head_inputs_finds_a_softcap_kept_in_a_sub_config(kind):
    """Issue 43: the cap read from a sub-config (T5Gemma: the decoder's; Gemma 3n / 4 and
    PaliGemma: the text config's) is off inside the block, carried as head.softcap and restored
    after; the fused CE equals the CE of the model's own logits (once 7.012 against 7.196).
    Where the installed transformers' forward does not read the cap (PaliGemma in 5.17), the
    head carries none and the config is left as it is."""
    model = capped_model(kind)
    config = model.config.decoder if kind == "t5gemma" else model.config.get_text_config()
    batch = capped_batch(kind)
    applied = cap_the_model_applies(model, config, batch)
    if kind == "t5gemma" or version.parse(transformers.__version__) >= version.parse("5.24"):
        assert applied == 2.0
    logits = model(**batch).logits
    with lm_head_inputs(model) as head:
        hidden = model(**batch).logits
        assert head.softcap == applied
        assert config.final_logit_softcapping == (None if applied else 2.0)
    assert config.final_logit_softcapping == 2.0
    z = hidden @ head.weight.T
    if applied:
        assert logits.abs().max() > 1.9 and z.abs().max() > 2.0  # the cap bends them
        z = 2.0 * torch.tanh(z / 2.0)
    torch.testing.assert_close(z, logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(model(**batch).logits, logits, rtol=0, atol=0)
    labels = torch.tensor([[9, 10, 11, 2]])
    torch.testing.assert_close(
        token_cross_entropy(labels, hidden_states=hidden.detach(), head=head),
        token_cross_entropy(labels, logits=logits.detach()),
        rtol=0,
        atol=1e-5,
    )


def seq2seq_batch(tokenizer) -> tuple[torch.Tensor, dict]:
    """Two Spanish sources and their English labels (the scorer's tokenizer's ids, SEP-ended)
    with their teacher-forced decoder inputs."""
    labels = torch.tensor(
        [tokenizer(r, add_special_tokens=False)["input_ids"] + [tokenizer.sep_token_id]
         for r in ("the cat sleeps .", "a big old house")]
    )  # fmt: skip
    batch = {
        "input_ids": torch.tensor([tokenizer("el gato duerme")["input_ids"]] * 2),
        "decoder_input_ids": torch.cat(
            [torch.full((2, 1), tokenizer.cls_token_id), labels[:, :-1]], dim=1
        ),
    }
    return labels, batch


def test_t5gemma_term_fused_equals_dense(scorer):
    """The mixin's default path for a seq2seq model, on a T5Gemma with cap 2 in its decoder's
    config: BERTScoreTerm's fused value and gradients equal the dense ones (once 11.3504
    against 11.3637)."""
    from bsloss.integrations.huggingface import BERTScoreTerm

    tokenizer = scorer_vocabulary_tokenizer(scorer)
    model = capped_model("t5gemma", len(tokenizer)).train()
    labels, batch = seq2seq_batch(tokenizer)
    term = BERTScoreTerm(
        bsloss.BERTScoreLoss(encoder=scorer.encoder), tokenizer, weight=1.0, causal=False
    )
    dense = term_step(model, batch, term, labels, fused=False, seed=0)
    assert_same_step(term_step(model, batch, term, labels, fused=True, seed=0), dense)


def test_a_lora_wrapped_bart_keeps_its_final_bias_and_the_fused_term_equals_dense(scorer):
    """BART (Marian, mBART, Pegasus) adds ``final_logits_bias`` after its head. Wrapped by PEFT,
    the bias was read through the wrapper but switched off on it, not on the BART module: the
    mixin's default (``lm_head_refusal``) raised ``KeyError: "attribute 'final_logits_bias'
    already exists"`` and a forward in the block failed on shapes (audit h22, F1)."""
    peft = pytest.importorskip("peft")
    from bsloss.integrations.huggingface import BERTScoreTerm
    from bsloss.integrations.lm_head import lm_head_refusal

    tokenizer = scorer_vocabulary_tokenizer(scorer)
    bart = tiny_seq2seq("bart", len(tokenizer))
    model = peft.get_peft_model(bart, peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    model.eval()  # no dropout: forward passes compared
    assert lm_head_refusal(model) is None and "final_logits_bias" not in vars(model)
    labels, batch = seq2seq_batch(tokenizer)
    logits = model(**batch).logits
    with lm_head_inputs(model) as head:
        hidden = model(**batch).logits
    torch.testing.assert_close(hidden @ head.weight.T + head.bias, logits, rtol=0, atol=1e-5)
    assert torch.equal(model(**batch).logits, logits) and "final_logits_bias" not in vars(model)
    term = BERTScoreTerm(
        bsloss.BERTScoreLoss(encoder=scorer.encoder), tokenizer, weight=1.0, causal=False
    )
    dense = term_step(model, batch, term, labels, fused=False, seed=0)
    assert any("lora" in name for name in dense[1])
    assert_same_step(term_step(model, batch, term, labels, fused=True, seed=0), dense)


class _ScaledHead(torch.nn.Linear):  # a head whose output is not h @ W.T + b (LoRA-like)
    def forward(self, hidden):
        return 2.0 * super().forward(hidden)


def _refused_models(scorer) -> dict:
    """Models whose head lm_head_inputs cannot account for, and what its message names."""
    peft = pytest.importorskip("peft")
    tokenizer = scorer_vocabulary_tokenizer(scorer)
    wrapped_head = tiny_gpt2(tokenizer)
    head = wrapped_head.lm_head
    wrapped_head.lm_head = _ScaledHead(head.in_features, head.out_features, bias=False)
    # LoRA on the head: its weight is not what the head computes with (peft leaves the head
    # out of "all-linear", as the recipes use it)
    lora_head = peft.get_peft_model(
        tiny_gpt2(tokenizer), peft.LoraConfig(r=2, target_modules=["lm_head", "c_attn"])
    )
    softcap_module = tiny_gpt2(tokenizer)
    softcap_module.logit_softcap = torch.nn.Tanh()  # applied after the head (as Inkling 2's)
    # caps on a model whose forward reads one (Gemma 3's; GPT-2's reads none: the next test)
    two_caps = tiny_gemma(tokenizer, softcap=2.0)
    two_caps.final_logit_softcapping = 3.0  # a copy the forward could read instead

    class FixedCapConfig(type(two_caps.config)):
        @property
        def final_logit_softcapping(self):  # read-only: cannot be switched off
            return 2.0

    fixed_cap = tiny_gemma(tokenizer)
    fixed_cap.config.__class__ = FixedCapConfig
    return {
        "head": (wrapped_head, r"GPT2LMHeadModel's LM head is a test_lm_head_integration\._Sca"),
        "lora-head": (lora_head, r"PeftModel's LM head is a peft\.tuners\.lora\.layer\.Linear"),
        "softcap-module": (softcap_module, r"GPT2LMHeadModel applies a soft-cap .*logit_softcap"),
        "two-caps": (two_caps, r"Gemma3ForCausalLM holds different final logit soft-caps"),
        "read-only-cap": (fixed_cap, r"Gemma3ForCausalLM's soft-cap .* cannot be switched off"),
    }


@pytest.mark.parametrize(
    "case", ["head", "lora-head", "softcap-module", "two-caps", "read-only-cap"]
)
def test_lm_head_inputs_refuses_a_head_it_cannot_account_for(scorer, case, tmp_path):
    """A head that is not a plain Linear, a soft-cap after the head it cannot switch off, or
    caps that disagree: refused, naming the model's class and what it could not account for;
    the model is left as it was, and the mixin's default takes the dense path."""
    model, message = _refused_models(scorer)[case]
    before = model.config.to_dict()
    head = model.get_output_embeddings()
    with pytest.raises(ValueError, match=message), lm_head_inputs(model):
        pass
    assert model.get_output_embeddings() is head and model.config.to_dict() == before

    class Trainer(BERTScoreTrainerMixin, transformers.Trainer):
        pass

    tokenizer = scorer_vocabulary_tokenizer(scorer)
    loss = bsloss.BERTScoreLoss(encoder=scorer.encoder)
    trainer = Trainer(model=model, args=trainer_args(tmp_path), processing_class=tokenizer,
                      bertscore_loss=loss)  # fmt: skip
    assert trainer.bertscore_fused is False


def test_a_cap_no_forward_reads_is_left_alone(scorer):
    """A config's cap that the model's forward never reads (GPT-2's source names none; so did
    transformers 5.17's PaliGemma, holding Gemma 2's in its text config) bends nothing: the
    head carries no cap, the configs and the model's copy stay as they are, and the fused CE
    is the CE of the model's own logits. A class whose source cannot be read is trusted to
    apply its config's cap."""
    from bsloss.integrations import lm_head

    tokenizer = scorer_vocabulary_tokenizer(scorer)
    model = tiny_gpt2(tokenizer).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)  # logits beyond the cap, were it applied
    model.config.final_logit_softcapping = 2.0
    model.final_logit_softcapping = 3.0  # two caps: refused if either could be read
    ids = torch.tensor([[5, 6, 7, 8]])
    logits = model(input_ids=ids).logits
    assert logits.abs().max() > 2.0
    with lm_head_inputs(model) as head:
        hidden = model(input_ids=ids).logits
        assert head.softcap is None
        assert model.config.final_logit_softcapping == 2.0 and model.final_logit_softcapping == 3.0
    torch.testing.assert_close(hidden @ head.weight.T, logits, rtol=0, atol=1e-5)
    labels = torch.tensor([[6, 7, 8, -100]])
    # both sum V = 30,522 exponentials in float32, in orders that depend on the CPU's vector
    # width (a 1.5e-5 difference on one machine, none on another): log2(V) roundings of the
    # CE's size bound that
    dense = token_cross_entropy(labels, logits=logits)
    bound = math.log2(head.weight.shape[0]) * 2.0**-23 * float(dense.abs())
    torch.testing.assert_close(
        token_cross_entropy(labels, hidden_states=hidden, head=head), dense, rtol=0, atol=bound
    )

    # the same model, its class made at run time (no source to read): the config is trusted
    def forward(self, *args, **kwargs):
        return type(model).forward(self, *args, **kwargs)

    unread = type("RuntimeLM", (type(model),), {"forward": forward, "__module__": "nowhere"})
    assert lm_head._source_names_the_cap(unread) is None
    del model.final_logit_softcapping
    model.__class__ = unread
    with lm_head_inputs(model) as head:
        assert head.softcap == 2.0 and model.config.final_logit_softcapping is None
    assert model.config.final_logit_softcapping == 2.0


def test_lm_head_inputs_refuses_what_it_cannot_serve():
    with (
        pytest.raises(ValueError, match="has no output embedding"),
        lm_head_inputs(torch.nn.Linear(3, 3)),
    ):
        pass
    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=40, n_embd=8, n_layer=1, n_head=2)
    )
    fsdp_like = type("FullyShardedDataParallel", (torch.nn.Module,), {})()
    model.transformer.add_module("wrapped", fsdp_like)
    with (
        pytest.raises(ValueError, match=r"FullyShardedDataParallel \(FSDP 1\).*fully_shard"),
        lm_head_inputs(model),
    ):
        pass
    with pytest.raises(ValueError, match="exactly one of logits or hidden_states"):
        token_cross_entropy(torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="needs head"):
        token_cross_entropy(torch.zeros(2, dtype=torch.long), hidden_states=torch.randn(2, 8))


def test_mixin_refuses_a_non_bool_fused(gemma_tokenizer, gemma_loss, tmp_path):
    class Trainer(BERTScoreTrainerMixin, transformers.Trainer):
        pass

    with pytest.raises(TypeError, match="bertscore_fused must be None or a bool"):
        Trainer(
            model=copy.deepcopy(tiny_gemma(gemma_tokenizer)),
            args=trainer_args(tmp_path),
            processing_class=gemma_tokenizer,
            bertscore_loss=gemma_loss,
            bertscore_fused="yes",
        )


@pytest.mark.slow  # two processes each load the scorer
@pytest.mark.parametrize("mode", DISTRIBUTED_MODES)
def test_distributed_fused_gradients_equal_dense_and_agree_across_processes(tmp_path, mode):
    """Two CPU processes (gloo), a tiny GPT-2 with a tied and an untied head, under DDP or
    FSDP 2 (fully_shard; the untied head its own unit, gathered for the chunked pass only): the
    fused step's reduced gradients equal the dense step's and are the same on both."""
    from test_distributed_scoring import run_two_processes

    ranks = run_two_processes("_distributed_lm_head.py", tmp_path, mode)
    for head in ("tied", "untied"):
        fused, dense = ranks[0][f"{head}-fused"], ranks[0][f"{head}-dense"]
        assert fused.keys() == dense.keys() and "transformer.wte.weight" in fused
        if head == "untied":
            assert "lm_head.weight" in fused  # the head's gradient arrived, outside the forward
        for name in dense:
            torch.testing.assert_close(fused[name], dense[name], rtol=0, atol=1e-5, msg=name)
            torch.testing.assert_close(
                ranks[1][f"{head}-fused"][name], fused[name], rtol=0, atol=0, msg=name
            )


@pytest.mark.parametrize("tied", [True, False])
def test_own_output_candidates_fused_equal_dense_and_the_formula(gemma_tokenizer, gemma_loss, tied):
    """BERTScoreTerm with the model's own outputs as candidates (candidate_outputs /
    candidate_labels, the study's `sampled` arm): CE on the reference labels plus the
    candidates' token-weighted 1 - F over their own token count; the fused pass (one forward,
    hidden states, LMHead.run) gives the dense value and gradients within 1e-5."""
    from bsloss.integrations.huggingface import BERTScoreTerm
    from bsloss.integrations.lm_head import token_cross_entropy

    model = tiny_gemma(gemma_tokenizer, tied=tied)
    batch = collate(gemma_tokenizer)(causal_rows(gemma_tokenizer))
    labels = batch.pop("labels")
    # "own outputs": the references' tokens shuffled within each completion, one row shortened
    generator = torch.Generator().manual_seed(0)
    own = labels.clone()
    for row in own:
        positions = (row != -100).nonzero().squeeze(1)
        row[positions] = row[positions][torch.randperm(len(positions), generator=generator)]
    own[0, (own[0] != -100).nonzero().squeeze(1)[-2:]] = -100
    term = BERTScoreTerm(gemma_loss, gemma_tokenizer, weight=2.0)
    own_step = {"references": REFERENCES, "candidate_labels": own}
    dense = term_step(model, batch, term, labels, fused=False, **own_step)
    assert_same_step(term_step(model, batch, term, labels, fused=True, **own_step), dense)
    dense_value = dense[0]
    # the formula, by hand on the dense logits
    with torch.no_grad():
        logits = model(**batch).logits[:, :-1]
        targets, candidates = labels[:, 1:], own[:, 1:]
        ce = token_cross_entropy(targets, logits=logits)
        f = gemma_loss.score(logits=logits, candidate_mask=candidates != -100,
                             references=REFERENCES).f1  # fmt: skip
        tokens = (candidates != -100).sum(1).float()
        expected = ce + 2.0 * ((1 - f) * tokens).sum() / tokens.sum()
    torch.testing.assert_close(dense_value, expected, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="candidate_outputs and candidate_labels go together"):
        term(outputs=model(**batch), labels=labels, candidate_labels=own)


@pytest.mark.parametrize("straight_through", [False, True], ids=["soft", "straight-through"])
def test_gumbel_candidates_with_cross_entropy_fused_equal_dense(
    scorer, gemma_tokenizer, straight_through
):
    """The study's `berttune` arm (Gumbel-softmax candidates, tau = 0.1, CE read in the same
    pass): the fused term equals the dense one for the same noise seed, value and gradients.
    Once a defect: the CE's bookkeeping in the fused pass overwrote the positions that address
    the noise, so this configuration crashed (or drew other noise) from the second row block."""
    from bsloss.integrations.huggingface import BERTScoreTerm

    loss = bsloss.BERTScoreLoss(
        encoder=scorer.encoder,
        matching="softmax",
        generator_tokenizer=gemma_tokenizer,
        gumbel_temperature=0.1,
        straight_through=straight_through,
    )
    model = tiny_gemma(gemma_tokenizer)
    # long enough that the fused pass splits the 262,144 tokens in several vocabulary chunks
    # (DEFAULT_CHUNK_ELEMENTS // positions < vocabulary), where the defect sat
    references = [" ".join([r.rstrip(".")] * 6) + "." for r in REFERENCES]
    rows = []
    for prompt, reference in zip(PROMPTS, references, strict=True):
        p = gemma_tokenizer(prompt)["input_ids"]
        r = gemma_tokenizer(" " + reference, add_special_tokens=False)["input_ids"]
        r = r + [gemma_tokenizer.eos_token_id]
        rows.append({"input_ids": p + r, "labels": [-100] * len(p) + r})
    batch = collate(gemma_tokenizer)(rows)
    labels = batch.pop("labels")
    assert (labels != -100).sum() * len(gemma_tokenizer) > 2 * DEFAULT_CHUNK_ELEMENTS
    term = BERTScoreTerm(loss, gemma_tokenizer, weight=1.0)
    # the loss draws its Gumbel seed from torch's generator
    gumbel_step = {"references": references, "seed": 3}
    dense = term_step(model, batch, term, labels, fused=False, **gumbel_step)
    assert_same_step(term_step(model, batch, term, labels, fused=True, **gumbel_step), dense)
