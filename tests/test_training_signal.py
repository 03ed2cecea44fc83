"""The training signal: on one fixed batch of a generator with a real 262,144-token vocabulary
(a small random Gemma 3 config with Gemma's own tokenizer), loss-only training lowers both the
loss and the hard F_BERT gap (1 - F of the decoded argmax text, the metric) for every bridge mode
and matching the docs offer. The real Gemma 3 270M is measured by
``benchmarks/training_signal.py``.

The small model is first fitted with CE to the references and, alternately, to wrong versions of
them (other words in the same places), so that, like a pretrained model, it is torn between a
right and a wrong token at many positions: its argmax text is partly wrong (F_BERT gap ~0.45) and
a gradient that carries the metric's information can fix it.

The earlier retokenize gradient (straight-through of the decoded pieces, aligned by character
offsets) failed this on the real Gemma; see :mod:`bsloss.bridge`.
"""

from __future__ import annotations

import copy

import _models
import pytest
import torch

import bsloss

CE_STEPS = 40
LOSS_STEPS = 8
LEARNING_RATE = 3e-4


@pytest.fixture(scope="module")
def tiny_gemma(gemma_tokenizer):
    """A 2-layer Gemma 3 with the real vocabulary, fitted with CE to the references and to
    their wrong versions in turn."""
    model = _models.tiny_gemma(
        gemma_tokenizer, hidden_size=64, intermediate_size=128, num_hidden_layers=2, head_dim=32
    )
    batch = _batch(gemma_tokenizer, REFERENCES)
    wrong = _batch(gemma_tokenizer, WRONG)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for step in range(CE_STEPS):
        logits, targets, _ = _completion_logits(model, wrong if step % 2 else batch)
        ce = torch.nn.functional.cross_entropy(logits, targets)
        optimizer.zero_grad()
        ce.backward()
        optimizer.step()
    return model, batch


REFERENCES = [
    "And he said, Go. And he sent her away for two months.",
    "The king spake unto the people, saying,",
    "And the water was upon the earth forty days.",
    "Blessed are the meek: for they shall inherit the earth.",
]
WRONG = [
    "And she said, Come. And she sent him away for three years.",
    "The queen spake unto the priests, saying,",
    "And the fire was upon the land seven days.",
    "Cursed are the proud: for they shall lose the land.",
]
SOURCES = [
    "El entonces dijo: Ve. Y dejóla por dos meses.",
    "El rey habló al pueblo, diciendo:",
    "Y estuvo el agua sobre la tierra cuarenta días.",
    "Bienaventurados los mansos: porque ellos recibirán la tierra.",
]


def _batch(tokenizer, references):
    """Prompt + completion ids (left-padded) and the next-token targets of the completion."""
    rows, labels = [], []
    for source, reference in zip(SOURCES, references, strict=True):
        prompt = tokenizer(f"Spanish: {source}\nEnglish:")["input_ids"]
        completion = tokenizer(" " + reference, add_special_tokens=False)["input_ids"]
        rows.append(prompt + completion)
        labels.append([-100] * len(prompt) + completion)
    width = max(len(r) for r in rows)
    ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(r)) + r for r in rows])
    lab = torch.tensor([[-100] * (width - len(r)) + x for r, x in zip(rows, labels, strict=True)])
    attention = torch.arange(width)[None] >= torch.tensor([width - len(r) for r in rows])[:, None]
    targets = torch.cat([lab[:, 1:], torch.full_like(lab[:, :1], -100)], dim=1)  # t predicts t+1
    return ids, attention.long(), targets


def _completion_logits(model, batch):
    """Logits at the completion positions only (the LM head over 262k tokens is the cost)."""
    ids, attention, targets = batch
    hidden = model.model(input_ids=ids, attention_mask=attention).last_hidden_state
    keep = targets != -100
    return model.lm_head(hidden[keep]), targets[keep], keep


def _candidates(model, batch):
    """The completion positions' distributions, left-aligned ``[B, n, V]``, and their mask."""
    logits, _, keep = _completion_logits(model, batch)
    counts = keep.sum(1).tolist()
    width = max(counts)
    rows = logits.split(counts)
    cand = torch.stack([torch.nn.functional.pad(r, (0, 0, 0, width - len(r))) for r in rows])
    mask = torch.arange(width)[None] < torch.tensor(counts)[:, None]
    return cand, mask


def _metric_gap(scorer, tokenizer, cand, mask) -> float:
    texts = [
        tokenizer.decode(row[m].tolist(), skip_special_tokens=True)
        for row, m in zip(cand.argmax(-1), mask, strict=True)
    ]
    return 1 - scorer.score(texts, REFERENCES)[2].mean().item()


@pytest.mark.parametrize("matching", ["hard", "softmax", "logsumexp", "sinkhorn"])
@pytest.mark.parametrize("mode", ["retokenize", "average"])
def test_loss_only_training_lowers_the_loss_and_the_metric(
    tiny_gemma, gemma_tokenizer, scorer, mode, matching
):
    trained, batch = tiny_gemma
    model = copy.deepcopy(trained)
    loss_fn = bsloss.BERTScoreLoss(
        encoder=scorer.encoder,
        matching=matching,
        generator_tokenizer=gemma_tokenizer,
        bridge_mode=mode,
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=LEARNING_RATE)
    losses, gaps = [], []
    for step in range(LOSS_STEPS + 1):
        cand, mask = _candidates(model, batch)
        loss = loss_fn(logits=cand, candidate_mask=mask, references=REFERENCES)
        losses.append(loss.item())
        gaps.append(_metric_gap(scorer, gemma_tokenizer, cand.detach(), mask))
        if step < LOSS_STEPS:
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    print(
        f"\n{mode} {matching}: loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
        f"metric gap {gaps[0]:.3f} -> {gaps[-1]:.3f}"
    )
    assert 0.2 < gaps[0] < 0.7, gaps[0]  # the start leaves room to improve and to get worse
    assert losses[-1] < losses[0] - 0.02, losses  # measured: 0.06-0.09 lower after 8 steps
    assert gaps[-1] < gaps[0] - 0.03, gaps  # measured: 0.453 -> 0.38-0.39
