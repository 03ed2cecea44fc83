"""Batched no-grad inference: many token-id sequences -> their hidden states, fast and bounded.

Sequences are encoded longest first in token-budget batches (little padding, bounded memory),
padded to bucketed shapes (:func:`~bsloss.scorer.batching.bucket_length`,
:func:`~bsloss.scorer.batching.bucket_rows`) so that a long run reuses a few tensor sizes. A
sequence longer than the scorer's maximum is encoded whole with overlapping sliding windows
(:func:`embed_windows`).

Both functions run the encoder's no-grad path
(:meth:`~bsloss.scorer.encoder.ScorerEncoder.encode_without_grad`: the compiled model when there
is one, every layer with ``all_layers``); the caller chooses ``torch.no_grad`` or
``torch.inference_mode`` and the autocast around them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from bsloss.scorer.batching import (
    bucket_length,
    bucket_rows,
    paced_by_host,
    progress_bar,
    to_device,
    token_budget_batches,
    token_budget_rows,
)

if TYPE_CHECKING:
    from bsloss.scorer.encoder import ScorerEncoder

__all__ = ["embed_token_ids", "embed_windows"]


def embed_token_ids(
    encoder: ScorerEncoder,
    token_ids: Sequence[Sequence[int]],
    batch_size: int,
    progress: bool | None = None,
    transform: Callable[[Tensor], Tensor] | None = None,
) -> list[Tensor]:
    """Hidden states ``[L_i, d]`` of each id sequence, in input order.

    Args:
        encoder: the scorer encoder.
        token_ids: id sequences with their special tokens
            (:meth:`~bsloss.scorer.tokenization.ScorerTokenizer.encode`).
        batch_size: the token budget of a batch: ``batch_size`` sequences of 128 tokens
            (fewer longer ones; on a GPU more shorter ones,
            :func:`~bsloss.scorer.batching.paced_by_host`); the windows of a sequence longer
            than the maximum are batched within the same budget (:func:`embed_windows`).
        progress: a progress bar (``None``: when stderr is a terminal).
        transform: applied to each batch's ``[B, L, d]`` hidden states at once (e.g. a
            normalisation).

    Returns:
        Views of one packed ``[sum L_i, d]`` tensor laid out in encoding order: the real tokens
        of each batch are selected straight into their slice of it, so the embeddings are held
        once, in one block, and no temporary depends on the batch's exact token count.

    >>> from bsloss.scorer.encoder import ScorerEncoder
    >>> encoder = ScorerEncoder.from_pretrained(device="cpu")
    >>> with torch.no_grad():
    ...     hidden = embed_token_ids(encoder, [[101, 4937, 102], [101, 102]], batch_size=8)
    >>> [tuple(h.shape) for h in hidden]
    [(3, 384), (2, 384)]
    """
    transform = transform or (lambda hidden: hidden)
    tokens = encoder.tokenization
    max_length = tokens.max_length
    sizes = [len(ids) for ids in token_ids]
    long = [i for i, size in enumerate(sizes) if size > max_length]
    short = sorted(
        (i for i, size in enumerate(sizes) if size <= max_length),
        key=lambda i: sizes[i],
        reverse=True,
    )
    offsets: dict[int, int] = {}  # the packed layout: encoding order
    offset = 0
    for i in long + short:
        offsets[i] = offset
        offset += sizes[i]
    packed: Tensor | None = None

    def slots(first: int, count: int, like: Tensor) -> Tensor:
        """The ``count`` packed rows that start at text ``first`` (allocated like ``like`` on
        first use)."""
        nonlocal packed
        if packed is None:
            packed = like.new_empty(offset, like.shape[-1])
        return packed[offsets[first] : offsets[first] + count]

    embedding_rows = encoder.input_embeddings.num_embeddings
    for i in long:
        rows = transform(embed_windows(encoder, token_ids[i], batch_size=batch_size))
        slots(i, len(rows), rows).copy_(rows)
    padded_lengths = [bucket_length(sizes[i], max_length) for i in short]
    fill = paced_by_host(encoder.device)
    batches = token_budget_batches(padded_lengths, batch_size, fill)
    pad = tokens.pad_token_id
    for start, stop in progress_bar(batches, len(batches), progress, "bsloss: encoding"):
        members = short[start:stop]
        length = padded_lengths[start]
        rows = bucket_rows(len(members), token_budget_rows(length, batch_size, fill))
        # numpy rows, not nested Python lists: torch.tensor reads a list element by element
        ids = np.full((rows, length), pad, dtype=np.int64)
        for row, i in enumerate(members):
            ids[row, : sizes[i]] = token_ids[i]
        check_embeddable(encoder, int(ids.max()), embedding_rows)
        input_ids = torch.from_numpy(ids)
        real_lengths = torch.tensor([sizes[i] for i in members] + [0] * (rows - len(members)))
        real = torch.arange(length)[None, :] < real_lengths[:, None]
        # a filler row attends to one token, not none: not every attention implementation
        # handles a fully masked row (a softmax over only -inf is NaN)
        filler_first_token = (torch.arange(rows)[:, None] >= len(members)) & (
            torch.arange(length)[None, :] == 0
        )
        attended = real | filler_first_token
        device = encoder.device
        # no padding, no mask: what transformers would choose after reading an all-ones mask
        # back from the device (the encoder prepares a padded one so that it need not)
        mask = None if bool(attended.all()) else to_device(attended, device)
        hidden = transform(encoder.encode_without_grad(to_device(input_ids, device), mask))
        flat_hidden = hidden.reshape(rows * length, -1)
        token_rows = to_device(real.flatten().nonzero().squeeze(1), device)
        # row-major: sequence by sequence, which is the packed layout of ``members``
        out = slots(members[0], len(token_rows), flat_hidden)
        torch.index_select(flat_hidden, 0, token_rows, out=out)
        del hidden, flat_hidden
    if packed is None:
        return []
    return [packed[offsets[i] : offsets[i] + sizes[i]] for i in range(len(sizes))]


def check_embeddable(encoder: ScorerEncoder, largest_id: int, embedding_rows: int) -> None:
    """Refuses a batch whose largest token id has no row in the scorer's input embedding,
    checked on the host before the batch is copied: inside the model it was an ``IndexError``
    deep in torch on a CPU and a device-side assert, which ends the CUDA context, on a GPU. A
    tokenizer gives such ids after tokens were added to it without
    ``resize_token_embeddings``, or when it is not the model's own."""
    if largest_id < embedding_rows:
        return
    token = encoder.tokenizer.convert_ids_to_tokens(largest_id)
    raise ValueError(
        f"the {encoder.name} tokenizer gives {token!r} the id {largest_id}, past the "
        f"{embedding_rows} rows of its model's input embedding: tokens added to the tokenizer "
        "need encoder.model.resize_token_embeddings(len(encoder.tokenizer)) (their new rows "
        "are untrained), or pass the tokenizer that belongs to the model"
    )


def embed_windows(
    encoder: ScorerEncoder, ids: Sequence[int], overlap: float = 0.5, batch_size: int = 64
) -> Tensor:
    """Hidden states ``[len(ids), d]`` of a token sequence longer than the scorer's maximum.

    The content between the special tokens is cut into windows of ``max_length`` tokens
    (special tokens included) that overlap by ``overlap``; each window is encoded with the
    scorer's own special tokens, and every content token takes its vector from the window in
    which it lies farthest from an edge (the most context on both sides). The prefix special
    tokens come from the first window, the suffix ones from the last.

    The windows go to the encoder ``token_budget_rows(max_length, batch_size)`` at a time, as
    a batch of the normal path's texts of that length would
    (:func:`~bsloss.scorer.batching.token_budget_rows`), and only the rows each token takes are
    kept from a batch, so that memory is bounded by ``batch_size``, not by the text's length.
    Each window is encoded on its own (full width, no padding), so the vectors do not depend on
    ``batch_size``.
    """
    tokens = encoder.tokenization
    prefix_ids, suffix_ids = tokens.prefix_ids, tokens.suffix_ids
    n_prefix, n_suffix = len(prefix_ids), len(suffix_ids)
    content = list(ids[n_prefix : len(ids) - n_suffix])
    width = tokens.content_length
    stride = max(1, int(width * (1 - overlap)))
    starts = list(range(0, max(len(content) - width, 0) + 1, stride))
    if starts[-1] + width < len(content):
        starts.append(len(content) - width)
    windows = [prefix_ids + content[a : a + width] + suffix_ids for a in starts]
    check_embeddable(encoder, max(ids), encoder.input_embeddings.num_embeddings)
    # The window where each token is most central (the first such window on a tie), found
    # window by window: memory O(tokens), not a [windows, tokens] table.
    best = torch.zeros(len(content), dtype=torch.long)
    best_margin = torch.full((len(content),), -1, dtype=torch.long)
    for w, a in enumerate(starts):
        inside = torch.arange(min(width, len(content) - a))
        margin = torch.minimum(inside, width - 1 - inside)
        better = margin > best_margin[a : a + len(inside)]
        best[a : a + len(inside)][better] = w
        best_margin[a : a + len(inside)][better] = margin[better]
    column = n_prefix + torch.arange(len(content)) - torch.tensor(starts)[best]
    device = encoder.device
    per_call = token_budget_rows(tokens.max_length, batch_size, paced_by_host(device))
    out: Tensor | None = None
    for first in range(0, len(windows), per_call):
        last = min(first + per_call, len(windows))
        # all of the full width; pinned and asynchronous (a plain copy would wait for the
        # card at every window batch)
        input_ids = to_device(torch.tensor(windows[first:last]), device)
        # no padding, no mask: transformers would drop an all-ones one after reading it back
        hidden = encoder.encode_without_grad(input_ids, None)
        if out is None:
            out = hidden.new_empty(len(ids), hidden.shape[-1])
        if first == 0:
            out[:n_prefix] = hidden[0, :n_prefix]
        if last == len(windows):
            out[len(ids) - n_suffix :] = hidden[-1, hidden.shape[1] - n_suffix :]
        taken = ((best >= first) & (best < last)).nonzero().squeeze(1)
        if len(taken):
            window_rows = to_device(best[taken] - first, device)
            out[to_device(n_prefix + taken, device)] = hidden[
                window_rows, to_device(column[taken], device)
            ]
        del hidden
    assert out is not None  # there is always a window
    return out
