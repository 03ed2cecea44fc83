"""Encoder batches are padded to a few bucketed shapes, and the padding changes no embedding.

The buckets are what keeps the peak memory of a long run flat (``benchmarks/memory.py``): a
bounded set of tensor sizes lets the allocator reuse freed blocks. These tests check the
mechanism (bounded shapes, filler rows harmless), not the memory itself.
"""

from __future__ import annotations

import random

import pytest
import torch

from bsloss.scorer.batching import (
    TOKENS_PER_SEQUENCE,
    bucket_length,
    bucket_rows,
    paced_by_host,
    pair_budget_batches,
    token_budget_batches,
    token_budget_rows,
)
from bsloss.scorer.inference import embed_token_ids


@pytest.mark.parametrize("max_length", [128, 256, 512])
def test_bucket_length_covers_and_is_coarse(max_length):
    buckets = [bucket_length(n, max_length) for n in range(1, max_length + 1)]
    for n, padded in enumerate(buckets, start=1):
        assert n <= padded <= max_length
        assert padded - n < max(4, n // 4), f"length {n} padded to {padded}: too much waste"
    assert buckets == sorted(buckets)  # sorted lengths stay sorted
    assert len(set(buckets)) <= 8 + 4 + 4 + (max_length - 128) // 32 + 1


def test_bucket_rows():
    assert [bucket_rows(n, 64) for n in range(1, 8)] == list(range(1, 8))  # one text, one row
    assert bucket_rows(9, 64) == 16
    assert bucket_rows(64, 64) == 64
    assert bucket_rows(30, 29) == 30  # never fewer rows than sequences
    assert bucket_rows(27, 29) == 29  # a full batch of this length is 29 rows


def test_token_budget_rows_respect_budget():
    for length in (1, 16, 128, 129, 256, 512):
        rows = token_budget_rows(length, 64)
        assert 1 <= rows <= 64
        assert rows * length <= 64 * 128 or rows == 1
    lengths = sorted((random.Random(0).randint(1, 512) for _ in range(500)), reverse=True)
    batches = token_budget_batches(lengths, 64)
    assert batches[0][0] == 0 and batches[-1][1] == len(lengths)
    assert all(a < b for a, b in batches)
    assert all(b1 == a2 for (_, b1), (a2, _) in zip(batches, batches[1:], strict=False))


def test_filled_batches_hold_the_token_budget():
    """On a GPU (fill) a batch of short texts takes as many as ``batch_size`` texts of 128
    tokens would hold; long texts are bounded as without it."""
    assert paced_by_host(torch.device("cuda")) and not paced_by_host(torch.device("cpu"))
    budget = 64 * TOKENS_PER_SEQUENCE
    for length in (1, 4, 32, 100, 128, 129, 256, 512):
        rows = token_budget_rows(length, 64, fill=True)
        assert rows * length <= budget or rows == 1
        assert (rows + 1) * length > budget  # full: one more would not fit
        assert rows >= token_budget_rows(length, 64)
    assert token_budget_rows(32, 64, fill=True) == 256
    lengths = sorted((random.Random(1).randint(3, 300) for _ in range(800)), reverse=True)
    batches = token_budget_batches(lengths, 64, fill=True)
    assert len(batches) < len(token_budget_batches(lengths, 64))
    assert [a for a, _ in batches[1:]] == [b for _, b in batches[:-1]]
    assert batches[0][0] == 0 and batches[-1][1] == len(lengths)
    assert all((b - a) * lengths[a] <= budget or b - a == 1 for a, b in batches)


@pytest.mark.parametrize("copies", [1, 7])
def test_pair_batches_hold_the_similarity_budget(copies):
    rng = random.Random(copies)
    sizes = sorted(
        ((rng.randint(2, 200), rng.randint(2, 200)) for _ in range(600)), key=lambda s: sum(s)
    )
    plain = pair_budget_batches(sizes, 64, copies=copies)
    assert plain == [(a, min(a + 64, 600)) for a in range(0, 600, 64)]
    filled = pair_budget_batches(sizes, 64, fill=True, copies=copies)
    assert [a for a, _ in filled[1:]] == [b for _, b in filled[:-1]]
    assert filled[0][0] == 0 and filled[-1][1] == 600
    budget = 64 * TOKENS_PER_SEQUENCE**2
    for a, b in filled:
        longest_c = max(c for c, _ in sizes[a:b])
        longest_r = max(r for _, r in sizes[a:b])
        assert (b - a) * copies * longest_c * longest_r <= budget or b - a == 1
        if b < 600:  # full: the next pair would not fit
            c, r = max(longest_c, sizes[b][0]), max(longest_r, sizes[b][1])
            assert (b - a + 1) * copies * c * r > budget


def test_filled_batches_score_the_same(scorer, monkeypatch):
    """The GPU's batches, forced on the CPU: fewer encoder calls and matching batches, masks
    the model does not read back on the host (``attention_masks.py``), the same scores."""
    from _helpers import HostReads
    from _tokenizers import stsb_pairs

    import bsloss.metric
    import bsloss.scorer.encoder
    import bsloss.scorer.inference

    cands, refs = stsb_pairs(400)
    encoder = scorer.encoder
    calls: list[tuple[int, int]] = []
    original = encoder.encode_without_grad

    host_reads: list[int] = []

    def recording(input_ids, attention_mask):
        calls.append(tuple(input_ids.shape))
        with HostReads() as reads:
            hidden = original(input_ids, attention_mask)
        host_reads.append(reads.count)
        return hidden

    monkeypatch.setattr(encoder, "encode_without_grad", recording)
    plain = torch.stack(scorer.score(cands, refs, batch_size=16))
    assert sum(host_reads) >= len(calls)  # transformers reads each plain mask back
    plain_calls, calls[:], host_reads[:] = len(calls), [], []
    for module in (bsloss.metric, bsloss.scorer.inference, bsloss.scorer.encoder):
        monkeypatch.setattr(module, "paced_by_host", lambda device: True)
    filled = torch.stack(scorer.score(cands, refs, batch_size=16))
    assert len(calls) < plain_calls / 2, (len(calls), plain_calls)
    budget = scorer.batch_size  # the encoder's; score's batch_size is the matching's
    assert max(rows for rows, _ in calls) > budget
    assert all(rows * length <= budget * TOKENS_PER_SEQUENCE for rows, length in calls)
    torch.testing.assert_close(filled, plain, atol=2e-6, rtol=0)
    assert sum(host_reads) == 0  # prepared masks: no wait for the card per batch


@pytest.fixture(scope="module")
def random_ids(scorer) -> list[list[int]]:
    """500 id sequences of random lengths 40..200 (where the length buckets are 8 to 32 tokens
    wide), between the scorer's special tokens."""
    tokens = scorer.encoder.tokenization
    rng = random.Random(0)
    vocab = range(1000, 20000)
    return [
        tokens.prefix_ids + rng.choices(vocab, k=rng.randint(38, 198)) + tokens.suffix_ids
        for _ in range(500)
    ]


def test_encoder_sees_few_shapes(scorer, random_ids, monkeypatch):
    encoder = scorer.encoder
    shapes: list[tuple[int, int]] = []
    original = encoder.encode_without_grad

    def recording(input_ids, attention_mask):
        shapes.append(tuple(input_ids.shape))
        return original(input_ids, attention_mask)

    monkeypatch.setattr(encoder, "encode_without_grad", recording)
    with torch.inference_mode():
        embed_token_ids(encoder, random_ids, batch_size=8)
    lengths = sorted((len(ids) for ids in random_ids), reverse=True)
    exact_shapes = {lengths[start] for start, _ in token_budget_batches(lengths, 8)}
    assert len(exact_shapes) > 40  # batches padded to their longest text: this many shapes
    assert len(set(shapes)) <= 16, sorted(set(shapes))
    assert sum(rows for rows, _ in shapes) >= len(random_ids)


def test_padding_and_filler_rows_change_no_embedding(scorer, random_ids):
    """9 sequences make a batch of 16 rows (7 filler rows), padded to a length bucket: every
    embedding equals the sequence encoded alone, unpadded."""
    encoder = scorer.encoder
    chosen = [ids for ids in random_ids if len(ids) <= 60][:9]
    assert len(chosen) == 9
    with torch.inference_mode():
        batched = embed_token_ids(encoder, chosen, batch_size=64)
        for ids, got in zip(chosen, batched, strict=True):
            whole = torch.ones(1, len(ids))
            alone = encoder(input_ids=torch.tensor([ids]), attention_mask=whole)[0]
            assert got.shape == (len(ids), alone.shape[-1])
            assert torch.isfinite(got).all()
            torch.testing.assert_close(got, alone, atol=1e-5, rtol=1e-5)
