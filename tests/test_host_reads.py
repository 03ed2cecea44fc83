"""The loss's training steps read the device back only where they must.

On a GPU each read of a device value (``.item()``, ``bool()``, ``nonzero``, boolean indexing)
makes the host wait for every kernel queued before it, so the host cannot prepare the next
operations while the card works. A step that is bound by the host (``benchmarks/README.md``,
"Runs 4-6") pays for each read with the card's backlog at that moment. These tests count the
reads of forward + backward on the CPU (:class:`~_helpers.HostReads`), with the scorer's mask
prepared as on a GPU, and name where each one is.
"""

from __future__ import annotations

import traceback

import pytest
import torch
from _helpers import HostReads, head_for
from _models import tiny_gemma

import bsloss.scorer.encoder
from bsloss import BERTScoreLoss, Softmax
from bsloss.integrations.huggingface import BERTScoreTerm
from bsloss.integrations.lm_head import lm_head_inputs
from bsloss.integrations.term_weights import Balanced

REFERENCES = ["a cat sat on the mat", "the weather is fine today"]


@pytest.fixture
def paced(monkeypatch):
    """The scorer's mask prepared as where the host sets the pace (a GPU)."""
    monkeypatch.setattr(bsloss.scorer.encoder, "paced_by_host", lambda device: True)


def reads_of(step) -> HostReads:
    step()  # warm: the references' cache and the tables filled outside the count
    with HostReads() as reads:
        step()
    return reads


@pytest.mark.parametrize("masked", [False, True], ids=["all-real", "padded"])
def test_the_dense_loss_reads_the_device_once(encoder, vocab, paced, masked):
    """Logits in, forward + backward: one read, the check that the logits are finite. (The
    special tokens were spliced in with boolean indexing: two reads forward, two backward.)"""
    loss = BERTScoreLoss(model=encoder, matching=Softmax(0.1))
    logits = torch.randn(2, 9, vocab, requires_grad=True)
    mask = torch.ones(2, 9, dtype=torch.bool)
    if masked:
        mask[1, 5:] = False

    def step():
        loss(logits, references=REFERENCES, candidate_mask=mask).backward()

    reads = reads_of(step)
    assert reads.count == 1, reads.where
    assert "distributions.py" in reads.where[0]


@pytest.mark.parametrize("layout", ["several-references", "rescaled"])
def test_the_dense_loss_reads_once_with_several_references_or_a_baseline(
    encoder, vocab, paced, layout
):
    """Audit h19, finding 2: with several references per candidate (the owner of each) or a
    baseline (which pairs are empty) the loss made a device tensor of a host list with
    ``torch.tensor(..., device=)``, after the scorer's forward was queued: on CUDA a copy that
    waits for the stream, two more waits a call. Now pinned and asynchronous."""
    options = {"rescale_with_baseline": True} if layout == "rescaled" else {}
    loss = BERTScoreLoss(model=encoder, matching=Softmax(0.1), **options)
    logits = torch.randn(2, 9, vocab, requires_grad=True)
    references = REFERENCES
    if layout == "several-references":
        references = [[REFERENCES[0], REFERENCES[1]], [REFERENCES[1]]]

    def step():
        loss(logits, references=references).backward()

    reads = reads_of(step)
    assert reads.count == 1, reads.where
    assert "distributions.py" in reads.where[0]


def test_the_fused_loss_reads_the_device_three_times(plain_loss, paced):
    """Hidden states, head and targets in, forward + backward: the selected rows (their
    number), the targets' range and the pass's finiteness check, once each per call; no read
    per chunk, none in the backward, none to check the hidden states apart. (Before: 11.)"""
    vocab = plain_loss.generator_vocab_size
    hidden, weight = head_for([2000, 3000, 4000], vocab, width=16)
    hidden = hidden.expand(2, -1, -1).clone().requires_grad_(True)
    targets = torch.randint(0, vocab, (2, 3))
    targets[1, 0] = -100
    mask = torch.tensor([[True, True, False], [True, True, True]])

    def step():
        out = plain_loss.loss_and_cross_entropy(
            bsloss.LMHeadInputs(hidden, weight), targets, REFERENCES, candidate_mask=mask
        )
        (out.loss.sum() + out.cross_entropy.sum()).backward()

    reads = reads_of(step)
    assert reads.count == 3, reads.where
    assert not any("engine" in where for where in reads.where), reads.where


def test_a_nan_hidden_state_is_still_named(plain_loss):
    """The hidden states are checked by the pass's own read: a NaN among the positions it
    uses is refused by name, as before the separate check was dropped; one at a position it
    does not use changes nothing."""
    vocab = plain_loss.generator_vocab_size
    hidden, weight = head_for([2000, 3000], vocab, width=16)
    broken = hidden.clone()
    broken[0, 1, 3] = float("nan")
    with pytest.raises(ValueError, match=r"hidden_states contains NaN or Inf \(first at "):
        plain_loss(hidden_states=broken, output_embeddings=weight, references=["a cat"])
    # a position the pass does not use (neither scored nor a target) does not count
    unused = torch.tensor([[True, False]])
    value = plain_loss(
        hidden_states=broken, output_embeddings=weight, references=["a cat"], candidate_mask=unused
    )
    assert torch.isfinite(value).all()


@pytest.mark.parametrize("weight", [1.0, Balanced()], ids=["fixed", "balanced"])
def test_the_trainer_term_reads_no_more_than_its_pass(encoder, gemma_tokenizer, paced, weight):
    """``BERTScoreTerm`` through the LM head (the mixin's fused path), forward + backward: the
    fused pass's three reads, one for the number of positions that begin a word (through a
    bridge with word-start pieces, such as Gemma's: audit h14), and one more for a weight that
    changes step by step (its check); the logged CE, F and term stay on the device until they
    are logged, and a fixed weight is not read back. (Before: 21 reads with a fixed weight, 22
    with Balanced.)"""
    loss = BERTScoreLoss(encoder=encoder, matching="softmax", generator_tokenizer=gemma_tokenizer)
    term = BERTScoreTerm(loss, gemma_tokenizer, weight=weight)
    model = tiny_gemma(gemma_tokenizer)
    prompt = gemma_tokenizer(["Say:", "Tell me:"], return_tensors="pt", padding=True)
    answer = gemma_tokenizer([" a cat sat", " fine"], add_special_tokens=False)["input_ids"]
    width = prompt["input_ids"].shape[1] + max(map(len, answer))
    ids = torch.full((2, width), gemma_tokenizer.pad_token_id)
    labels = torch.full((2, width), -100)
    for row, tokens in enumerate(answer):
        start = prompt["input_ids"].shape[1]
        ids[row, :start] = prompt["input_ids"][row]
        ids[row, start : start + len(tokens)] = torch.tensor(tokens)
        labels[row, start : start + len(tokens)] = torch.tensor(tokens)

    def step():
        with lm_head_inputs(model) as head:
            outputs = model(input_ids=ids)
        term(outputs, labels, references=REFERENCES, head=head).backward()

    reads = reads_of(step)
    assert loss.bridging.bridge.has_word_starts  # the premise of the fourth read
    expected = 4 if isinstance(weight, float) else 5
    assert reads.count == expected, reads.where
    logged = term.pop_metrics()
    assert all(isinstance(value, float) for value in logged.values()), logged
    assert 0 <= logged["bertscore_f"] <= 1 and logged["ce"] > 0


def test_the_fused_cross_entropy_reads_the_device_three_times(gemma_tokenizer):
    """The mixin's CE through the LM head (``token_cross_entropy(hidden_states=, head=)``, what
    a step between answering steps and a term of weight 0 run), forward + backward: the
    positions with a target (their number), the targets' range and the pass's finiteness
    check. (Before: 5, two of them the boolean indexing of the rows, one in the backward.)"""
    from bsloss.integrations.lm_head import token_cross_entropy

    model = tiny_gemma(gemma_tokenizer)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, len(gemma_tokenizer), (2, 12), generator=generator)
    labels = ids.clone()
    labels[:, :7] = -100

    def step():
        with lm_head_inputs(model) as head:
            hidden = model(input_ids=ids).logits
        ce = head.run(
            lambda h, x: token_cross_entropy(labels[:, 1:], hidden_states=x, head=h), hidden[:, :-1]
        )
        ce.backward()

    reads = reads_of(step)
    assert reads.count == 3, reads.where


def test_the_fused_pass_is_checked_once_the_scorers_forward_is_queued(plain_loss, paced):
    """The pass's finiteness is read after the scorer's forward has been queued: on a GPU the
    host prepares the scorer's work while the card runs the pass, instead of waiting for the
    pass first. The first read is the selection's, before the pass; the last forward read
    comes after the scorer's first operation."""
    vocab = plain_loss.generator_vocab_size
    hidden, weight = head_for([2000, 3000, 4000], vocab, width=16)
    order: list[str] = []

    class Order(HostReads):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            before = self.count
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if self.count > before:
                order.append("read")
            elif "modeling_bert" in "".join(f.filename for f in traceback.extract_stack()[-8:]):
                order.append("scorer")
            return out

    def call():
        plain_loss(hidden_states=hidden, output_embeddings=weight, references=["a cat sat"])

    call()  # the reference's encoding (the scorer's too) cached outside the record
    with Order():
        call()
    reads = [i for i, what in enumerate(order) if what == "read"]
    first_scorer = order.index("scorer")
    assert reads[0] < first_scorer < reads[-1], (reads, first_scorer)


def test_a_copy_is_counted_in_a_block_entered_twice():
    """The counter itself: entered again inside its own block (a helper that counts, called
    from a test that counts), bsloss's copies of host data are still counted after the inner
    block ends (its exit unpatched the factories for the rest of the outer block)."""
    copy = compile("torch.tensor([1, 2], device='cpu')", "/site/bsloss/copying.py", "eval")
    factory, reads = torch.tensor, HostReads()
    with reads:
        with reads:
            eval(copy, {"torch": torch})
        assert reads.count == 1, reads.where  # once, not once a level
        eval(copy, {"torch": torch})
    assert reads.count == 2, reads.where
    assert torch.tensor is factory  # restored once the outer block ends
