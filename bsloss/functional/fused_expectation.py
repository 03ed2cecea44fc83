r"""Expected scorer inputs straight from hidden states and the LM head, without ``[N, V]``.

For hidden states :math:`h \in \mathbb{R}^{N \times d}`, an LM head :math:`W \in \mathbb{R}^{V
\times d}` (bias :math:`b`), a value table :math:`E \in \mathbb{R}^{V \times c}` (the scorer's
input embeddings with the importance-weight column, :func:`bsloss.distributions.augment_table`,
through the vocabulary bridge when vocabularies differ), an optional logit soft-cap :math:`\kappa`
and a generator temperature :math:`T`:

.. math::

    z_{iv} = \kappa \tanh\big((h_i \cdot W_v + b_v) / \kappa\big), \qquad
    s_{iv} = z_{iv} / T, \qquad
    p_{iv} = \frac{e^{s_{iv}}}{\sum_u e^{s_{iu}}}, \qquad
    e_i = \sum_v p_{iv} E_v .

This is attention with queries :math:`h`, keys :math:`W` and values :math:`E`. It is computed over
blocks of positions and chunks of the vocabulary with an online softmax (a running maximum
:math:`m` and normaliser :math:`\ell`: at each chunk :math:`m' = \max(m, \max_v s_v)`,
:math:`\ell' = \ell e^{m - m'} + \sum_v e^{s_v - m'}` and the accumulator rescaled the same way),
as flash attention does; the backward pass recomputes the chunks from the saved log-normaliser
:math:`\log Z_i = m_i + \log \ell_i`, with

.. math::

    \frac{\partial L}{\partial s_{iv}} = p_{iv}\big(g_i \cdot E_v - g_i \cdot e_i\big),
    \qquad
    \frac{\partial z}{\partial (h \cdot W + b)} = 1 - (z / \kappa)^2,

so nothing of size :math:`N \times V` is ever stored. The same pass optionally gives the
log-likelihood of target ids under the model's own logits (temperature 1, soft-capped):
:math:`\log q_i(y_i) = z_{i y_i} - \log \sum_v e^{z_{iv}}`, whose gradient
:math:`\delta_{v y_i} - q_{iv}` is added to the same recomputed chunks (the CE term of a
training step without full logits).

Options, with the semantics of the dense path (:func:`bsloss.distributions.token_distribution`
followed by :func:`~bsloss.distributions.expected_inputs`):

- ``top_k``: the :math:`k` largest :math:`s_{iv}` are found chunk by chunk (a running top-k),
  their :math:`k` logits recomputed differentiably from :math:`k` gathered rows of :math:`W`,
  renormalised by a softmax over the :math:`k` alone, and :math:`k` rows of :math:`E` gathered;
- ``straight_through``: the forward value is the argmax token's row of :math:`E` (tracked with the
  running maximum), the backward pass that of the expected row;
- ``gumbel_temperature`` :math:`\tau`: Gumbel-softmax, :math:`s_{iv} = (z_{iv} / T + g_{iv}) /
  \tau` with the noise :math:`g_{iv}` of :mod:`bsloss.functional.gumbel_noise`, a function of
  (seed, position, token) that each chunk, and the backward pass, recomputes. The chunks keep
  :math:`t_{iv} = z_{iv} / T + g_{iv}` and its running maximum, and divide by :math:`\tau` only
  after the shift, :math:`e^{(t_{iv} - m_i) / \tau}`: at most 1 for any :math:`\tau > 0`, where
  :math:`t / \tau` overflowed below :math:`\tau \approx 10^{-37}`.

Softmax arithmetic is float32 (float64 for float64 inputs) whatever the caller's autocast; the
``h W^T`` products and the table products (``p E`` and ``g E^T``) run in the autocast dtype when
autocast is on (as the model's own LM head and the dense path's table product would), else in the
inputs' dtype. The logits stay in that dtype unless a bias, soft-cap, temperature or noise must be
applied, and the softmax upcasts them as it reads them.

Chunk shapes: on the CPU, ~16 MB chunks of rows x vocabulary (cache-sized); on CUDA, all the
rows (up to 16,384) by vocabulary chunks of 64-256 MiB per float32 temporary (at most 1/32 of the
``[N, V]`` logits; the whole vocabulary when it fits), so that a call makes tens of chunks, not
hundreds, and W's gradient is written once per chunk, in W's dtype, rather than summed over row
blocks (``chunk_elements`` overrides both). Nothing
inside the loops reads a value back to the host: targets are gathered and scattered with clamped
indices and a mask, and the rows' finiteness is checked once, after the forward loop. On CUDA,
``use_sdpa=True`` sends the plain case (no top-k, soft-cap, straight-through or targets) through
:func:`torch.nn.functional.scaled_dot_product_attention`'s memory-efficient backend, which
accepts a value dimension different from the key dimension; it is off by default, since on an
H200 it took the term alone at Gemma 3's sizes 174-180 ms (8 x 1024 positions) and 102 ms
(8 x 256), where this chunked pass took the CE and the term together 110-135 and 35-48 ms.
``backend="triton"`` runs the Triton kernels of :mod:`bsloss.functional.triton_fused_head`
instead (no top-k, straight-through or Gumbel noise). ``"auto"`` (the default) takes them on
CUDA when the products run in bfloat16 (a bfloat16 head, or autocast to it) and the options
allow, and the PyTorch pass elsewhere: on an H200 (run 4, ``benchmarks/README.md``) the
kernels took CE + term at Gemma 3's sizes 90 ms (8 x 1024 positions) and 53 ms (8 x 256)
where this pass took 116 and 106 ms; in the Gemma-shaped training step the two were within
4% (1.26x and 1.22x the model's own CE step). Their first call compiles and autotunes
(seconds, once per process and shape bucket). Below a generator temperature of
:data:`SELF_NORMALISED_BELOW` both backwards take one more pass over the chunks, to sum the
probabilities they recompute and normalise by that sum (a near one-hot row's gradient then
cancels as the dense one's; docs/loss.md).
"""

from __future__ import annotations

import importlib.util
import warnings
from functools import cache, partial
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from bsloss.candidate_transforms import CandidateOptions, candidate_weights
from bsloss.functional.chunk_budget import logits_share
from bsloss.functional.gumbel_noise import (
    check_seed,
    draw_seed,
    gumbel_perturbed,
    gumbel_scores,
)
from bsloss.functional.matching.base import check_temperature
from bsloss.functional.table_chunks import TableChunks
from bsloss.inputs import check_targets_shape, position_of_first

__all__ = [
    "FusedHeadOutput",
    "NonFiniteLogitsError",
    "check_target_ids",
    "fused_expected_inputs",
    "fused_token_log_likelihood",
]

IGNORE_INDEX = -100
BACKENDS = ("auto", "triton", "torch")
# CPU: elements of one logits chunk [rows, vocab], ~16 MB in float32: a chunk's elementwise
# passes then run out of the CPU's caches, and a handful of temporaries of that size live at once,
# so the pass needs ~100 MB whatever N and V.
DEFAULT_CHUNK_ELEMENTS = 1 << 22
# Below this generator temperature both backends' backwards sum their own probabilities in one
# more pass over the chunks (:func:`_recomputed_sums`, the kernels' ``_own_sums``): p =
# exp(s - log Z) with s = z / T large sum to 1 only within float32's rounding of log Z, scaled
# by 1 / T in the gradient.
SELF_NORMALISED_BELOW = 0.05
_MAX_ROW_BLOCK = 4096
# CUDA: blocks as tall as the positions (up to _MAX_CUDA_ROWS) by vocabulary chunks that make one
# [rows, chunk] temporary of the softmax dtype at most 256 MiB: the whole vocabulary in one block
# when it fits (a plain softmax), else 8,192 tokens x 8,192 positions at Gemma 3's sizes (32
# chunks), not the CPU's ~512 chunks x ~20 launches. Tall rather than whole-vocabulary blocks:
# every row block adds a read-modify-write of W's float32 gradient [V, d] (and its bf16 product),
# ~12 bytes x V x d; at 256 rows x the whole vocabulary that is 32 x 2 GB = 64 GB (~21 ms on an
# H100) at Gemma's 8 x 1024 positions, against one pass here (whose W gradient is written once,
# in W's dtype). A vocabulary chunk costs only the online rescaling of [rows] and [rows, c]
# numbers and a [rows, d] update of h's gradient.
# Memory: about three such temporaries live at once at the peak (the logits, the probabilities
# or dz, a matmul-dtype copy; each freed as soon as it is read, none kept across chunks: ~2.6
# measured on the CPU with these shapes, 4.6 before the frees) besides W's gradient. So that the
# pass stays a small share of the dense path's at every size, a temporary is also at most 1/32
# of the [N, V] float32 logits (the dense path holds about four [N, V] float32 tensors), and at
# least 64 MiB (GEMMs >= 8,192 tokens wide at 2,048 positions). At Gemma's sizes: 256 MiB blocks
# at 8 x 1024 positions, 64 MiB at 8 x 256. On an H200 (benchmarks/README.md, runs 4-6) CE +
# term at 8 x 256 then peaked at 438 MiB, 0.048x the dense path's 9 GiB (goal <= 0.1x), but its
# 32 chunks are bound by the host's launches (then ~56 a chunk, benchmarks/launches.py): 49-56
# ms, where 8 chunks of 256 MiB took 42 ms (run 3) at 0.22x the memory. The chunk loop now
# launches about half as many (benchmarks/torch_pass_revisions.py: 31 a chunk for CE + term, 24
# for the CE alone). bfloat16 products on CUDA run the Triton kernels by default.
_CUDA_BLOCK_BYTES = 256 << 20
_MIN_CUDA_BLOCK_BYTES = 64 << 20
# 16,384 rows keep a 256 MiB float32 chunk >= 4,096 tokens wide (GEMMs of K = 4,096 and more).
_MAX_CUDA_ROWS = 16_384


class FusedHeadOutput(NamedTuple):
    """What :func:`fused_expected_inputs` returns.

    ``expected``: ``[N, c]`` expected rows of the table (``None`` when no table was given);
    ``log_likelihood``: ``[N]`` log-probability of each target id (0 at ignored positions;
    ``None`` without targets); ``tokens``: ``[N]`` the most probable token of each position
    (the argmax the chunked pass tracks; ``None`` from the CUDA SDPA path); ``finite``: ``[N]``
    whether each row's logits were all finite, when the caller reads it
    (``check_finite=False``), else ``None`` (checked: a non-finite row raised)."""

    expected: Tensor | None
    log_likelihood: Tensor | None
    tokens: Tensor | None = None
    finite: Tensor | None = None


class NonFiniteLogitsError(ValueError):
    """The logits of row ``row`` (of the ``[N, d_model]`` hidden states) are NaN or infinite."""

    def __init__(self, row: int):
        self.row = row
        super().__init__(
            f"the LM head's logits of hidden_states row {row} are not finite (NaN or Inf in "
            "hidden_states or in the head's weight or bias, a float16 overflow of h W^T, or a "
            "softcap / temperature that makes them overflow)"
        )


def _accumulate_dtype(hidden: Tensor, weight: Tensor) -> torch.dtype:
    """Softmax arithmetic: float64 when either side is float64 (the dense path's rule for
    float64 logits), else float32."""
    wide = torch.float64 in (hidden.dtype, weight.dtype)
    return torch.float64 if wide else torch.float32


def _matmul_dtype(hidden: Tensor, weight: Tensor) -> torch.dtype:
    device = hidden.device.type
    if hidden.dtype != torch.float64 and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(hidden.dtype, weight.dtype)


class _Options(NamedTuple):
    softcap: float | None
    temperature: float
    candidates: CandidateOptions  # top-k, straight-through, Gumbel noise
    seed: int | Tensor  # of the Gumbel noise (a 0-d int64 tensor from a loss)
    row_block: int
    vocab_chunk: int
    matmul_dtype: torch.dtype
    dtype: torch.dtype  # softmax arithmetic
    table_pad: int  # the table's rows padded to a multiple of this (8 on CUDA: TableChunks)
    check_finite: bool = True  # read the rows' finiteness here (False: returned, read later)

    @property
    def top_k(self) -> int | None:
        return self.candidates.top_k

    @property
    def gumbel(self) -> float | None:
        """The Gumbel-softmax temperature tau (``None``: no noise)."""
        return self.candidates.gumbel_temperature


def _chunks(total: int, size: int):
    for start in range(0, total, size):
        yield start, min(start + size, total)


def _chunk_count(total: int, size: int) -> int:
    """How many ``(start, stop)`` pairs :func:`_chunks` yields."""
    return -(-total // size)


def _chunk_shape(
    n: int,
    vocab: int,
    device_type: str,
    chunk_elements: int | None,
    itemsize: int = 4,
    block_bytes: int | None = None,
    max_rows: int = _MAX_CUDA_ROWS,
) -> tuple[int, int]:
    """``(row_block, vocab_chunk)`` of the pass: ``chunk_elements`` positions x vocabulary
    entries when the caller sets it; else, on CUDA, up to ``max_rows`` rows by as much of the
    vocabulary as keeps one ``[rows, chunk]`` temporary of ``itemsize`` bytes within
    ``block_bytes`` (default: 1/32 of the ``[n, vocab]`` logits' bytes, between 64 and 256
    MiB); elsewhere :data:`DEFAULT_CHUNK_ELEMENTS`."""
    if chunk_elements is None and device_type == "cuda":
        if block_bytes is None:
            share = logits_share(n, vocab) * itemsize
            block_bytes = min(_CUDA_BLOCK_BYTES, max(_MIN_CUDA_BLOCK_BYTES, share))
        rows = max(1, min(n, max_rows))
        return rows, max(1, min(vocab, block_bytes // (itemsize * rows)))
    elements = DEFAULT_CHUNK_ELEMENTS if chunk_elements is None else chunk_elements
    row_block = max(1, min(n, _MAX_ROW_BLOCK, elements))
    return row_block, max(1, min(vocab, elements // row_block))


def _logits(
    h: Tensor, weight: Tensor, bias: Tensor | None, o: _Options, rows: Tensor | None, v0: int
) -> tuple[Tensor, Tensor]:
    """Soft-capped logits ``z`` of one chunk (vocabulary ids from ``v0``) and the scores
    ``s = z / T``, or ``z / T + g`` with the Gumbel noise ``g`` of positions ``rows`` (``s is z``
    at T = 1 without noise). With noise the softmax divides by ``tau`` after its shift
    (:func:`_exp_shifted`): ``(z / T + g) / tau`` overflows for a small ``tau``.

    ``z`` stays in the matmul dtype (bf16 under autocast) when nothing elementwise follows the
    product: the softmax statistics read it and upcast on the fly, so no softmax-dtype copy of
    the chunk is made. Otherwise it is upcast once and the steps run in place (a chunk is
    megabytes to gigabytes, and every fresh one is another pass over memory)."""
    z = h.to(o.matmul_dtype) @ weight.to(o.matmul_dtype).T
    if bias is not None or o.softcap is not None or not _scores_are_logits(o):
        z = z.to(o.dtype)
    if bias is not None:
        z.add_(bias.to(o.dtype))
    if o.softcap is not None:
        z.div_(o.softcap).tanh_().mul_(o.softcap)
    s = z if o.temperature == 1.0 else z / o.temperature
    if o.gumbel is not None:
        tokens = torch.arange(v0, v0 + z.shape[1], device=z.device)[None]
        s = gumbel_perturbed(s, o.seed, rows[:, None], tokens)
    return z, s


def _scores_are_logits(o: _Options) -> bool:
    """Whether the expectation's softmax is the model's own (T = 1, no noise): then the CE shares
    its normaliser and its probabilities. Not ``T * tau == 1``: T = 2 with tau = 0.5 scales by 1
    and still perturbs the scores."""
    return o.temperature == 1.0 and o.gumbel is None


def _exp_shifted(
    x: Tensor, shift: Tensor, dtype: torch.dtype, divisor: float | None = None
) -> Tensor:
    """``exp((x - shift[:, None]) / divisor)`` in ``dtype`` (the Gumbel temperature as
    ``divisor``: divided after the shift, which cannot overflow): in place when ``x`` already
    has that dtype (the caller no longer needs it), else one upcasting subtraction into a fresh
    chunk."""
    x = x.sub_(shift[:, None]) if x.dtype == dtype else torch.sub(x, shift[:, None])
    if divisor is not None:
        x = x.div_(divisor)
    return x.exp_()


def _exp_scaled(x: Tensor, divisor: float | None) -> Tensor:
    """``exp(x / divisor)`` (``exp(x)`` without one): the online softmax's rescaling factor."""
    return torch.exp(x if divisor is None else x / divisor)


class _TargetSlots:
    """Where each target id lies in the chunked vocabulary, found once for the pass: its
    chunk (a negative index for ``-100``, which lies in none) and its column there (clamped into
    the last, narrower chunk for the rows whose target lies elsewhere). A chunk then picks its
    rows' target logits with one gather and adds the CE's one-hot gradient with one
    ``scatter_add_``: no data-dependent shapes, no read of the device, and none of the
    comparisons and masks a chunk would otherwise launch for it."""

    def __init__(self, targets: Tensor, chunk: int, vocab: int):
        targets = targets.long()
        self.chunk, self.count = chunk, _chunk_count(vocab, chunk)
        self.index = torch.div(targets, chunk, rounding_mode="floor")
        columns = targets.remainder(chunk)[:, None]
        last = vocab - (self.count - 1) * chunk  # the last chunk's width
        self._columns = columns
        self._last_columns = columns.clamp(max=last - 1) if last < chunk else columns

    def columns(self, v0: int, v1: int) -> Tensor:
        """``[N, 1]``: each row's column in the chunk ``[v0, v1)`` (its target's where it lies
        there, an in-range one elsewhere)."""
        return self._last_columns if v1 - v0 < self.chunk else self._columns

    def spread(self, values: Tensor) -> Tensor:
        """``[N, count]``: each row's value in its target's chunk, 0 in the others."""
        chunks = torch.arange(self.count, device=values.device)
        return torch.where(self.index[:, None] == chunks, values[:, None], 0.0)

    def pick(self, per_chunk: Tensor, rows: slice) -> Tensor:
        """``[rows]``: the entries of ``per_chunk`` ``[rows, count]`` at each row's target
        chunk (an arbitrary one for ``-100``, which the caller masks)."""
        return per_chunk.gather(1, self.index[rows, None].clamp(min=0)).squeeze(1)


class _RowBlock(NamedTuple):
    """The forward pass's results for one block of rows (see :meth:`_FusedHead.forward`)."""

    max: Tensor  # running maximum of the scores
    norm: Tensor | None  # their softmax's normaliser, relative to `max`
    acc: Tensor | None  # the unnormalised expectation
    argmax: Tensor
    finite: Tensor
    target_logit: Tensor | None
    log_z1: Tensor | None  # the CE's own log-normaliser (temperature or noise)
    top_values: Tensor | None
    top_indices: Tensor | None


def _forward_rows(
    h: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    values: TableChunks | None,
    slots: _TargetSlots | None,
    rows: slice,
    row_ids: Tensor | None,
    o: _Options,
    want_norm: bool,
    separate_ce: bool,
) -> _RowBlock:
    """One block of rows over every vocabulary chunk, with an online softmax.

    The running state lives in fresh tensors rebound at each chunk, not in slices of the
    whole pass's buffers: a GPU runs this pass at the pace of the host's launches (one block
    of all the rows, tens of chunks), and every slice assignment is one more. What need not
    be running is kept per chunk and resolved once after the loop: each chunk's maximum and
    its token (the argmax: the first chunk holding the largest maximum, as a strict ``>``
    across chunks would keep it) and the logit at each row's target column."""
    n, dt, device = h.shape[0], o.dtype, h.device
    count = _chunk_count(weight.shape[0], o.vocab_chunk)
    chunk_max = torch.empty(n, count, dtype=dt, device=device)
    chunk_arg = torch.empty(n, count, dtype=torch.long, device=device)
    picked = torch.empty(n, count, dtype=dt, device=device) if slots is not None else None
    m = low = norm = acc = m1 = norm1 = top_values = top_indices = None
    for k, (v0, v1) in enumerate(_chunks(weight.shape[0], o.vocab_chunk)):
        w = weight[v0:v1].to(o.matmul_dtype)  # (no copy where the dtype is already the same)
        b = None if bias is None else bias[v0:v1]
        z, s = _logits(h, w, b, o, None if row_ids is None else row_ids[rows], v0)
        # CE and top-k read z and s first: the softmax below overwrites s (z at T = 1)
        if slots is not None:
            picked[:, k : k + 1].copy_(z.gather(1, slots.columns(v0, v1)[rows]))
        if separate_ce:
            z_max = z.amax(dim=1).to(dt)
            new1 = z_max if m1 is None else torch.maximum(m1, z_max)
            total1 = _exp_shifted(z, new1, dt).sum(dim=1)  # z is not read again
            norm1 = total1 if m1 is None else torch.addcmul(total1, norm1, torch.exp(m1 - new1))
            m1 = new1
        if o.top_k is not None:
            found, idx = s.topk(min(o.top_k, v1 - v0), dim=1)
            found, idx = found.to(dt), idx + v0
            if top_values is not None:
                found = torch.cat([top_values, found], dim=1)
                idx = torch.cat([top_indices, idx], dim=1)
            # -inf placeholders where the first chunks hold fewer than k tokens: V >= k
            # finite scores displace them all by the end
            if found.shape[1] < o.top_k:
                pad = o.top_k - found.shape[1]
                found = F.pad(found, (0, pad), value=float("-inf"))
                idx = F.pad(idx, (0, pad))
            top_values, order = found.topk(o.top_k, dim=1)
            top_indices = idx.gather(1, order)
        # Every variant of the pass tracks the maximum and its token (what
        # bridge_mode="retokenize" decodes) and whether each row's scores are finite: max
        # propagates NaN and min catches -inf, so the running maximum and minimum say it all.
        best, best_at = s.max(dim=1)
        chunk_max[:, k].copy_(best)
        chunk_arg[:, k].copy_(best_at)
        low = s.amin(dim=1).to(dt) if low is None else torch.minimum(low, s.amin(dim=1))
        new = best.to(dt) if m is None else torch.maximum(m, best)
        if want_norm:
            # on the first chunk (over the whole vocabulary, where it fits: a plain softmax)
            # nothing is rescaled
            scale = None if m is None else _exp_scaled(m - new, o.gumbel)
            p = _exp_shifted(s, new, dt, o.gumbel)  # s (and z) are not read again
            del z, s  # (p's storage, when the shift ran in place)
            total = p.sum(dim=1)
            norm = total if scale is None else torch.addcmul(total, norm, scale)
            if values is not None:
                product = _table_product(p, values.rows(v0, v1), dt)
                acc = product if scale is None else torch.addcmul(product, acc, scale[:, None])
            # freed here, not when the next chunk's p replaces it: a chunk-sized temporary
            # fewer at the peak
            del p
        m = new
    # the first chunk holding the largest maximum, and its token there
    first = chunk_max.argmax(dim=1, keepdim=True)
    argmax = chunk_arg.gather(1, first).squeeze(1) + first.squeeze(1) * o.vocab_chunk
    finite = torch.isfinite(m) & torch.isfinite(low)
    target_logit = slots.pick(picked, rows) if slots is not None else None
    log_z1 = (m1 + torch.log(norm1)) if separate_ce else None
    return _RowBlock(m, norm, acc, argmax, finite, target_logit, log_z1, top_values, top_indices)


class _FusedHead(torch.autograd.Function):
    """Forward: expected rows, target log-likelihoods, argmax and running top-k indices, chunk
    by chunk. Backward: the chunks recomputed from the saved log-normalisers.

    Nothing in the loops synchronises with the device (no ``nonzero``, boolean indexing or
    ``.item()``): the finiteness of every row is gathered on the device and read once, after
    the loop."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, table, targets, rows, o: _Options):
        n = hidden.shape[0]
        want_e = table is not None
        want_ll = targets is not None
        # the CE reuses the expectation's statistics when the scores are the logits; else it
        # keeps a normaliser of its own. A pass for the top-k alone needs no normaliser at all.
        shared_ce = want_ll and _scores_are_logits(o)
        separate_ce = want_ll and not shared_ce
        want_norm = want_e or shared_ce
        # the table read chunk by chunk in the matmul dtype (padded on CUDA): the result has
        # the padded width, which the caller cuts
        values = TableChunks(table, o.matmul_dtype, o.table_pad) if want_e else None
        slots = _TargetSlots(targets, o.vocab_chunk, weight.shape[0]) if want_ll else None
        # Rows outside, vocabulary inside: on CUDA one block holds every row (up to 16,384),
        # so each chunk of W is still converted once; on the CPU a block of up to 4,096 rows
        # converts it again, a small cost next to the block's products.
        blocks = [
            _forward_rows(
                hidden[r0:r1].to(o.matmul_dtype),
                weight,
                bias,
                values,
                slots,
                slice(r0, r1),
                rows,
                o,
                want_norm,
                separate_ce,
            )
            for r0, r1 in _chunks(n, o.row_block)
        ]
        out = _RowBlock(
            *(None if parts[0] is None else _joined(parts) for parts in zip(*blocks, strict=True))
        )
        finite = out.finite
        # the one host synchronisation of the pass (unless the caller reads `finite` later)
        if o.check_finite and not bool(finite.all()):
            raise NonFiniteLogitsError(int((~finite).nonzero()[0]))
        log_z = norm = None
        if want_norm and o.gumbel is None:
            log_z = out.max + torch.log(out.norm)
        elif want_norm:
            # with noise p = exp((t - m) / tau) / norm: m / tau + log(norm) would overflow for
            # a small tau, so the backward pass gets the shift m and the normaliser apart
            log_z, norm = out.max, out.norm
        expected = (out.acc / out.norm[:, None]) if want_e else None
        log_z1 = out.log_z1 if separate_ce else log_z
        log_likelihood = None
        if want_ll:
            ignored = targets == IGNORE_INDEX
            log_likelihood = torch.where(ignored, 0.0, out.target_logit - log_z1)
        ctx.options = o
        ctx.want_e, ctx.want_ll, ctx.shared_ce = want_e, want_ll, shared_ce
        ctx.save_for_backward(
            hidden,
            weight,
            bias,
            table,
            targets,
            rows,
            log_z,
            log_z1 if separate_ce else None,
            expected,
            norm,
        )
        argmax = out.argmax
        outputs = (
            expected if want_e else hidden.new_empty(0),
            log_likelihood if want_ll else hidden.new_empty(0),
            argmax,
            out.top_indices if out.top_indices is not None else argmax.new_empty(0),
            finite,
        )
        ctx.mark_non_differentiable(outputs[2], outputs[3], outputs[4])
        # an output nothing uses gets None, not zeros: its part of the backward is skipped
        ctx.set_materialize_grads(False)
        return outputs

    @staticmethod
    @once_differentiable  # a second derivative would need the chunks' graph: refused, named
    def backward(ctx, grad_expected, grad_ll, _argmax, _top, _finite):
        hidden, weight, bias, table, targets, rows, log_z, log_z1, expected, norm = (
            ctx.saved_tensors
        )
        o: _Options = ctx.options
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        use_e = ctx.want_e and grad_expected is not None
        use_ll = ctx.want_ll and grad_ll is not None
        dt, mm = o.dtype, o.matmul_dtype
        grad_h = torch.zeros(hidden.shape, dtype=dt, device=hidden.device) if need_h else None
        # One row block (CUDA's default up to 16,384 positions): each vocabulary chunk's rows of
        # W's gradient come whole from one product, written in W's dtype; no float32 [V, d]
        # accumulator (0.625 GiB at Gemma 3's sizes, twice the bf16 gradient itself). Several
        # row blocks sum into float32.
        direct_w = need_w and o.row_block >= hidden.shape[0]
        w_dtype = weight.dtype if direct_w else dt
        grad_w = torch.zeros(weight.shape, dtype=w_dtype, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=dt, device=bias.device) if need_b else None
        if not (use_e or use_ll) or not (need_h or need_w or need_b):
            return (
                _cast(grad_h, hidden),
                _cast(grad_w, weight),
                _cast(grad_b, bias),
                None,
                None,
                None,
                None,
            )
        # dL/dz = p (g E^T - <g, e>) / scale + gl (onehot(y) - q), p the expectation's softmax,
        # q the CE's, gl the gradient of the log-likelihoods. When p is q (T = 1, no noise) the
        # CE's -gl q joins the offset of the first term, so one product and one multiplication
        # make the whole dz, and the one-hot part is a scatter of N numbers. What does not
        # depend on the chunk is made once, before the loop (a launch less at every chunk).
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            fold_ce = use_e and use_ll and ctx.shared_ce
            if use_e:
                # ds/dz = 1 / T, and with noise 1 / (T tau): the 1 / tau scales each chunk's ds
                # (where p has vanished, 0 stays 0); folded into g it made g inf for a small tau
                g = grad_expected.to(dt) / o.temperature
                if o.temperature < SELF_NORMALISED_BELOW:
                    # p / S and <g, e> from this pass's own p (S = sum p): a near one-hot row's
                    # dz then cancels as the dense softmax's does
                    total, weighted = _recomputed_sums(hidden, weight, bias, table, rows,
                                                       log_z, g, o)  # fmt: skip
                    g, offset = g / total[:, None], -weighted / total.square()
                else:
                    offset = -(g * expected).sum(dim=1)
                    if norm is not None:  # p = exp((t - m) / tau) / norm: 1 / norm, row factors
                        g, offset = g / norm[:, None], offset / norm
                g = g.to(mm)
            if use_ll:
                gl = torch.where(targets == IGNORE_INDEX, 0.0, grad_ll.to(dt))
                lz1 = log_z if ctx.shared_ce else log_z1
                if fold_ce:
                    offset = offset - gl
                else:
                    minus_gl = -gl[:, None]
                slots = _TargetSlots(targets, o.vocab_chunk, weight.shape[0])
                hits = slots.spread(gl)  # [N, chunks]: gl at each row's target chunk
            if use_e:
                offset = offset[:, None].to(mm)
            hidden_mm = hidden.to(mm)
            n = hidden.shape[0]
            values = TableChunks(table, mm, o.table_pad) if use_e else None
            for k, (v0, v1) in enumerate(_chunks(weight.shape[0], o.vocab_chunk)):
                w = weight[v0:v1].to(mm)
                b = None if bias is None else bias[v0:v1]
                e = values.rows(v0, v1) if use_e else None
                for r0, r1 in _chunks(n, o.row_block):
                    h = hidden_mm[r0:r1]
                    z, s = _logits(h, w, b, o, None if rows is None else rows[r0:r1], v0)
                    cap_grad = None
                    if o.softcap is not None:  # d(kappa tanh(x / kappa))/dx = 1 - (z / kappa)^2
                        cap_grad = torch.div(z, o.softcap).square_().neg_().add_(1)
                    dz = None
                    if use_ll and not fold_ce:
                        # the CE's -gl q; z is not read again (s is, only when it is not z)
                        dz = _exp_shifted(z, lz1[r0:r1], dt).mul_(minus_gl[r0:r1])
                    if use_e:
                        ds = _exp_shifted(s, log_z[r0:r1], dt, o.gumbel)
                        z = s = None  # read for the last time (ds may be their storage)
                        # g E^T + offset in one product: the offset is the GEMM's added term
                        centred = torch.addmm(offset[r0:r1], g[r0:r1], e.T)
                        ds.mul_(centred)
                        del centred
                        if o.gumbel is not None:
                            ds.div_(o.gumbel)
                        dz = ds if dz is None else dz.add_(ds)
                        del ds
                    if use_ll:
                        columns = slots.columns(v0, v1)[r0:r1]
                        dz.scatter_add_(1, columns, hits[r0:r1, k : k + 1])
                    if cap_grad is not None:
                        dz.mul_(cap_grad)
                    # the chunk's logits (and all but dz) go before dz's matmul-dtype copy is
                    # made, dz as soon as it is made and the copy after the products: at most
                    # two chunk-sized temporaries live at once, none across chunks
                    del z, s, cap_grad
                    if need_b:
                        grad_b[v0:v1].add_(dz.sum(dim=0))
                    # one copy in the matmul dtype serves both products (the sums below are
                    # add_ on the slice: `x[a:b] += y` would copy the slice onto itself after)
                    dz_mm = dz.to(mm)
                    del dz
                    if need_h:
                        if mm == dt:
                            grad_h[r0:r1].addmm_(dz_mm, w)
                        else:
                            grad_h[r0:r1].add_(dz_mm @ w)
                    if direct_w and grad_w.dtype == mm:
                        torch.mm(dz_mm.T, h, out=grad_w[v0:v1])  # no copy into W's gradient
                    elif direct_w:
                        grad_w[v0:v1] = dz_mm.T @ h
                    elif need_w:
                        if mm == dt:
                            grad_w[v0:v1].addmm_(dz_mm.T, h)
                        else:
                            grad_w[v0:v1].add_(dz_mm.T @ h)
                    del dz_mm
        grads = _cast(grad_h, hidden), _cast(grad_w, weight), _cast(grad_b, bias)
        return (*grads, None, None, None, None)


def _recomputed_sums(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    table: Tensor,
    rows: Tensor | None,
    log_z: Tensor,
    g: Tensor,
    o: _Options,
) -> tuple[Tensor, Tensor]:
    """Per row, ``S = sum_v p_v`` and ``sum_v p_v <g, E_v>`` with ``p`` exactly as the
    backward recomputes it (``exp(s - log Z)``, before any Gumbel normaliser): one more pass
    over the chunks, taken below :data:`SELF_NORMALISED_BELOW`. There ``s = z / T`` is large,
    ``log Z`` is one float32 number with an absolute rounding of ~1e-7 |s|, and the p it gives
    sum to 1 only within ~1e-5; against the forward's ``e`` the backward's ``dz`` then kept
    ``(S - 1) <g, e> / T`` (audit h33: 7.5e-4 where the dense gradient is 1.9e-6, at
    T = 1e-3)."""
    dt, mm = o.dtype, o.matmul_dtype
    n = hidden.shape[0]
    total = torch.zeros(n, dtype=dt, device=hidden.device)
    weighted = torch.zeros(n, dtype=dt, device=hidden.device)
    hidden_mm, g_mm = hidden.to(mm), g.to(mm)
    values = TableChunks(table, mm, o.table_pad)
    for v0, v1 in _chunks(weight.shape[0], o.vocab_chunk):
        w = weight[v0:v1].to(mm)
        b = None if bias is None else bias[v0:v1]
        e = values.rows(v0, v1)
        for r0, r1 in _chunks(n, o.row_block):
            _, s = _logits(hidden_mm[r0:r1], w, b, o, None if rows is None else rows[r0:r1], v0)
            p = _exp_shifted(s, log_z[r0:r1], dt, o.gumbel)
            total[r0:r1] += p.sum(dim=1)
            weighted[r0:r1] += (p * (g_mm[r0:r1] @ e.T).to(dt)).sum(dim=1)
    return total, weighted


def _joined(parts: tuple[Tensor, ...]) -> Tensor:
    """The row blocks' results as one tensor (the one block itself where there is one)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _table_product(p: Tensor, table: Tensor, dtype: torch.dtype) -> Tensor:
    """``p @ table`` in the table's (the matmul) dtype, as the dense path's product under
    autocast, returned in ``dtype``."""
    return (p.to(table.dtype) @ table).to(dtype)


def _cast(grad: Tensor | None, like: Tensor | None) -> Tensor | None:
    return None if grad is None else grad.to(like.dtype)


def _split_head(output_embeddings: Tensor | nn.Module, bias: Tensor | None):
    if isinstance(output_embeddings, nn.Module):
        weight = getattr(output_embeddings, "weight", None)
        if not isinstance(weight, Tensor):
            raise TypeError(
                "output_embeddings must be a [V, d_model] tensor or a module with a .weight "
                f"(an LM head), got {type(output_embeddings).__name__}"
            )
        if bias is None:
            bias = getattr(output_embeddings, "bias", None)
        return weight, bias
    if not isinstance(output_embeddings, Tensor):
        raise TypeError(
            "output_embeddings must be a [V, d_model] tensor or an nn.Module, got "
            f"{type(output_embeddings).__name__}"
        )
    return output_embeddings, bias


def ids_outside_vocabulary(target_ids: Tensor, vocab: int) -> Tensor:
    """Where ``target_ids`` is outside ``[0, vocab)`` and not ``-100`` (no read of the device)."""
    return ((target_ids < 0) | (target_ids >= vocab)) & (target_ids != IGNORE_INDEX)


def check_target_ids(target_ids: Tensor, vocab: int, name: str = "target_ids") -> None:
    """Refuse target ids outside ``[0, vocab)`` other than ``-100``, naming the first by its
    index in ``target_ids`` (one read of the device).

    >>> check_target_ids(torch.tensor([[1, -100], [2, 9]]), vocab=5, name="labels")
    Traceback (most recent call last):
    ValueError: labels has ids outside [0, 5) (and not -100) at labels[1, 1]
    """
    bad = ids_outside_vocabulary(target_ids, vocab)
    if bad.any():
        raise ValueError(
            f"{name} has ids outside [0, {vocab}) (and not {IGNORE_INDEX}) at "
            f"{name}{position_of_first(bad)}"
        )


def _check(
    hidden: Tensor, weight: Tensor, bias, table, targets, softcap, temperature, check_targets
):
    if not isinstance(hidden, Tensor) or hidden.dim() != 2 or not hidden.is_floating_point():
        raise ValueError(
            "hidden_states must be a floating [N, d_model] tensor, got "
            f"{list(hidden.shape) if isinstance(hidden, Tensor) else type(hidden).__name__}"
        )
    if not weight.is_floating_point():
        raise TypeError(
            "output_embeddings (the LM head's weight) must have a floating dtype, got "
            f"{weight.dtype}"
        )
    if bias is not None and (not isinstance(bias, Tensor) or not bias.is_floating_point()):
        raise TypeError("the LM head's bias must be a floating tensor")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(
            f"output_embeddings must be [V, {hidden.shape[1]}] (d_model of hidden_states), got "
            f"{list(weight.shape)}"
        )
    vocab = weight.shape[0]
    if vocab == 0:
        raise ValueError("output_embeddings has no rows (a head of 0 tokens)")
    if bias is not None and tuple(bias.shape) != (vocab,):
        raise ValueError(f"the LM head's bias must be [{vocab}], got {list(bias.shape)}")
    if table is not None and (table.dim() != 2 or table.shape[0] != vocab):
        raise ValueError(
            f"table must be [{vocab}, c] (one row per LM-head token), got {list(table.shape)}"
        )
    if targets is not None:
        if targets.dtype not in (torch.long, torch.int):
            raise ValueError(f"target_ids must be torch.long or torch.int, got {targets.dtype}")
        check_targets_shape(targets, "target_ids", hidden, "hidden_states")
        if check_targets:
            check_target_ids(targets, vocab)
    if softcap is not None:
        check_temperature(softcap, "softcap")
    check_temperature(temperature, "temperature")


def _sdpa_expectation(hidden: Tensor, weight: Tensor, table: Tensor, o: _Options) -> Tensor | None:
    """``softmax(h W^T / T) E`` by the memory-efficient SDPA kernel on CUDA; ``None``, with a
    warning, where no kernel takes these shapes (the chunked path runs instead). Running out of
    memory is raised, not taken for a missing kernel: the caller's memory is short either way,
    and the chunked pass retried after it would hide that (or fail deeper)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dtype = o.matmul_dtype if o.matmul_dtype != torch.float64 else None
    if dtype is None:
        return None

    def padded(x: Tensor) -> Tensor:
        # the kernel wants head dims aligned to 8 elements; zero columns change no dot product
        extra = (-x.shape[-1]) % 8
        return F.pad(x.to(dtype), (0, extra))[None, None]

    q, k, v = padded(hidden), padded(weight), padded(table.detach())
    try:
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
            out = F.scaled_dot_product_attention(q, k, v, scale=1.0 / o.temperature)
    except torch.OutOfMemoryError:
        raise
    except RuntimeError as error:
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        warnings.warn(
            f"fused_expected_inputs(use_sdpa=True): no SDPA kernel for these inputs ({reason}); "
            "the chunked pass computes them instead",
            stacklevel=3,
        )
        return None
    return out[0, 0, :, : table.shape[1]].to(o.dtype)


def fused_expected_inputs(
    hidden_states: Tensor,
    output_embeddings: Tensor | nn.Module,
    table: Tensor | None,
    *,
    bias: Tensor | None = None,
    target_ids: Tensor | None = None,
    softcap: float | None = None,
    temperature: float = 1.0,
    top_k: int | None = None,
    straight_through: bool = False,
    gumbel_temperature: float | None = None,
    gumbel_seed: int | Tensor | None = None,
    row_ids: Tensor | None = None,
    chunk_elements: int | None = None,
    use_sdpa: bool = False,
    backend: str = "auto",
    check_finite: bool = True,
    check_targets: bool = True,
) -> FusedHeadOutput:
    """``softmax(softcap(h W^T + b) / T) E`` and the targets' log-likelihood, chunked.

    Args:
        hidden_states: ``[N, d_model]`` final hidden states (the LM head's input).
        output_embeddings: the LM head's weight ``[V, d_model]``, or the module (its ``weight``
            and ``bias``). Differentiated when it requires grad.
        table: ``[V, c]`` values (not differentiated), e.g. an :func:`augment_table`; ``None``
            to compute only the log-likelihood.
        bias: ``[V]`` logit bias (overrides the module's).
        target_ids: ``[N]`` ids whose log-likelihood under the model's logits (soft-capped,
            temperature 1) is returned; ``-100`` is ignored (0).
        softcap: logit soft-cap ``kappa`` (logits ``kappa * tanh(z / kappa)``), e.g. Gemma 2's.
        temperature: the generator temperature ``T`` of the distribution (not of the CE).
        top_k, straight_through, gumbel_temperature: as in
            :func:`bsloss.distributions.token_distribution`.
        gumbel_seed: the seed of the Gumbel noise (:mod:`bsloss.functional.gumbel_noise`;
            an int or a 0-d int64 tensor; ``None``: drawn from torch's generator).
        row_ids: ``[N]`` int64 position ids of the rows, which address the noise (default
            ``0 .. N - 1``; the loss passes each row's flat index in its ``[B, L]`` grid, so
            that the dense path's noise for the same seed is the same).
        chunk_elements: positions x vocabulary entries of one logits chunk of the PyTorch
            pass (memory bound); ``None`` (default): chosen by device,
            :data:`DEFAULT_CHUNK_ELEMENTS` (~16 MB of float32) on the CPU, up to 16,384 rows by
            vocabulary chunks of up to 256 MiB on CUDA.
        use_sdpa: on CUDA, try the memory-efficient SDPA kernel in the plain case (of the
            ``"torch"`` backend; where no kernel takes the inputs, a warning and the chunked
            pass; running out of memory is raised); off by default: slower than the chunked
            pass on an H200 (module docstring).
        backend: ``"auto"`` (the Triton kernels on CUDA for bfloat16 products where the
            options allow, else the PyTorch pass; module docstring), ``"triton"`` (the
            kernels of
            :mod:`bsloss.functional.triton_fused_head`, without ``top_k``,
            ``straight_through``, ``gumbel_temperature`` or float64, or an error; CPU tensors
            need Triton's interpreter, ``TRITON_INTERPRET=1`` before triton's import) or
            ``"torch"`` (the chunked PyTorch pass, the reference).
        check_finite: read the rows' finiteness at the end of the pass and raise for a
            non-finite one (the default); ``False``: return it as ``finite`` unread, for a
            caller that reads it later (on a GPU, a read waits for the whole pass: the loss
            reads after it has queued the scorer's forward) and refuses non-finite rows itself.
        check_targets: refuse ``target_ids`` outside the vocabulary (the default; one read of
            the device); ``False`` for a caller that has checked them (:func:`check_target_ids`)
            where it can name their positions, such as a ``[B, L]`` grid the rows were
            selected from. Unchecked bad ids fail inside the pass, or read out of bounds.

    Returns:
        :class:`FusedHeadOutput` ``(expected [N, c] | None, log_likelihood [N] | None,
        tokens [N])``.

    Raises:
        ValueError: for shapes that do not fit together, ids outside the vocabulary, a head
            of no rows, non-positive ``softcap``, ``temperature`` or ``chunk_elements``, an
            unknown ``backend``, or ``backend="triton"`` where its kernels cannot run.
        TypeError: when ``output_embeddings`` is neither a tensor nor a module with a weight,
            or ``chunk_elements``, ``gumbel_seed`` or ``row_ids`` is not an integer (a 0-d
            int64 tensor for the seed).

    Differentiable once: a second derivative (``create_graph=True``) is refused at
    ``.backward()`` (both backends' backwards are ``once_differentiable``).

    >>> import torch
    >>> h, W, E = torch.randn(5, 8), torch.randn(50, 8), torch.randn(50, 3)
    >>> out = fused_expected_inputs(h, W, E, chunk_elements=64)
    >>> torch.allclose(out.expected, torch.softmax(h @ W.T, -1) @ E, atol=1e-6)
    True
    """
    weight, bias = _split_head(output_embeddings, bias)
    _check(hidden_states, weight, bias, table, target_ids, softcap, temperature, check_targets)
    candidates = CandidateOptions(top_k, straight_through, gumbel_temperature)
    candidates.check(weight.shape[0])
    if gumbel_temperature is not None:
        if gumbel_seed is not None:
            gumbel_seed = check_seed(gumbel_seed)
        if row_ids is None:
            row_ids = torch.arange(hidden_states.shape[0], device=hidden_states.device)
        elif not isinstance(row_ids, Tensor) or row_ids.dtype not in (torch.long, torch.int):
            kind = row_ids.dtype if isinstance(row_ids, Tensor) else type(row_ids).__name__
            raise TypeError(f"row_ids must be a torch.long or torch.int tensor, got {kind}")
        elif tuple(row_ids.shape) != (hidden_states.shape[0],):
            raise ValueError(
                f"row_ids must be [{hidden_states.shape[0]}], got {list(row_ids.shape)}"
            )
        row_ids = row_ids.to(device=hidden_states.device, dtype=torch.long)
    else:
        row_ids = None
    if chunk_elements is not None:
        if isinstance(chunk_elements, bool) or not isinstance(chunk_elements, int):
            raise TypeError(f"chunk_elements must be an int, got {type(chunk_elements).__name__}")
        if chunk_elements < 1:
            raise ValueError(f"chunk_elements must be >= 1, got {chunk_elements}")
    width = None if table is None else table.shape[1]
    table = None if table is None else table.detach()
    # zero columns change no product; each backend reads the table chunk by chunk, padded,
    # and the result is cut back to `width`
    table_pad = 8 if _pads_table_rows(hidden_states) else 1
    if _runs_on_triton(backend, hidden_states, weight, candidates.keywords()):
        out = _triton_pass(
            hidden_states,
            weight,
            bias,
            table,
            target_ids,
            softcap,
            temperature,
            table_pad,
            check_finite,
        )
        # a new tuple, not ``out._replace``: after the graph break at the kernels, torch 2.11's
        # Dynamo rebuilt ``_replace``'s result as an empty tuple (IndexError in the caller's
        # resumed frame, under ``loss.compile()``); 2.8 and 2.13 did not
        expected = None if table is None else out.expected[:, :width]
        return FusedHeadOutput(expected, out.log_likelihood, out.tokens, out.finite)
    n, vocab = hidden_states.shape[0], weight.shape[0]
    dtype = _accumulate_dtype(hidden_states, weight)
    row_block, vocab_chunk = _chunk_shape(
        n, vocab, hidden_states.device.type, chunk_elements, torch.finfo(dtype).bits // 8
    )
    options = _Options(
        softcap=None if softcap is None else float(softcap),
        temperature=float(temperature),
        candidates=candidates,
        seed=(draw_seed() if gumbel_seed is None else gumbel_seed)
        if gumbel_temperature is not None
        else 0,
        row_block=row_block,
        vocab_chunk=vocab_chunk,
        matmul_dtype=_matmul_dtype(hidden_states, weight),
        dtype=dtype,
        table_pad=table_pad,
        check_finite=check_finite,
    )
    plain = (
        top_k is None
        and softcap is None
        and not straight_through
        and target_ids is None
        and gumbel_temperature is None
    )
    if (
        plain
        and use_sdpa
        and table is not None
        and bias is None
        and hidden_states.is_cuda
        and n > 0
    ):
        expected = _sdpa_expectation(hidden_states, weight, table, options)
        # non-finite logits give a non-finite result here: the chunked pass names the row
        if expected is not None and bool(torch.isfinite(expected).all()):
            return FusedHeadOutput(expected[:, :width], None)
    with torch.autocast(device_type=hidden_states.device.type, enabled=False):
        if n == 0:
            # nothing to compute, but on the graph of the inputs: backward() works (zero grads),
            # and every parameter of the head gets a gradient, the bias too, as a call with rows
            # gives it (DDP without find_unused_parameters fails at the next step otherwise)
            anchor = hidden_states.sum() + weight[:0].sum()
            if bias is not None:
                anchor = anchor + bias[:0].sum()
            anchor = anchor.to(options.dtype)
            empty = anchor.expand(0, width) if table is not None else None
            ll = anchor.expand(0) if target_ids is not None else None
            tokens = torch.zeros(0, dtype=torch.long, device=hidden_states.device)
            finite = None if check_finite else tokens.bool()  # what the caller reads: [0]
            return FusedHeadOutput(empty, ll, tokens, finite)
        # With top_k the table product runs on the k gathered rows only; the pass then finds the
        # top k (and the CE's normaliser when asked) without the V-wide expectation.
        full_table = table if top_k is None else None
        if full_table is None and target_ids is None and top_k is not None:
            with torch.no_grad():
                _, _, argmax, top, finite = _FusedHead.apply(
                    hidden_states.detach(),
                    weight.detach(),
                    _detach(bias),
                    None,
                    None,
                    row_ids,
                    options,
                )
            log_likelihood = None
        else:
            expected, log_likelihood, argmax, top, finite = _FusedHead.apply(
                hidden_states, weight, bias, full_table, target_ids, row_ids, options
            )
            log_likelihood = log_likelihood if target_ids is not None else None
            expected = expected[:, :width] if full_table is not None else expected
        finite = None if check_finite else finite
        if table is None:
            return FusedHeadOutput(None, log_likelihood, argmax, finite)
        if top_k is not None:
            expected = _top_k_expectation(hidden_states, weight, bias, table, top, row_ids, options)
        elif straight_through:
            # forward: the argmax row exactly (x + (y - y) == x); backward: the soft expectation's
            hard = table[argmax].to(expected.dtype)
            expected = hard + (expected - expected.detach())
    return FusedHeadOutput(expected, log_likelihood, argmax, finite)


def _pads_table_rows(hidden: Tensor) -> bool:
    """Whether the table's rows are padded with zeros to a multiple of 8 entries (chunk by
    chunk, :class:`~bsloss.functional.table_chunks.TableChunks`): on CUDA, for cuBLAS's
    aligned kernels."""
    return hidden.is_cuda


# Looked up once: under torch 2.8 Dynamo refuses to trace ``find_spec`` (a graph break at every
# compiled call that reaches the fused pass, the PyTorch pass's too).
_TRITON_INSTALLED = importlib.util.find_spec("triton") is not None


def _runs_on_triton(backend: str, hidden: Tensor, weight: Tensor, sampling: dict) -> bool:
    """Whether the Triton kernels take this call (see ``backend`` in
    :func:`fused_expected_inputs`); ``backend="triton"`` where they cannot is an error."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        return False
    # no rows: the PyTorch pass's empty result, once "triton" was found able to run (a call
    # without rows that passed would only move the error to the first batch with rows)
    rows = hidden.shape[0] > 0
    unhandled = [name for name, value in sampling.items() if value not in (None, False)]
    if torch.float64 in (hidden.dtype, weight.dtype):
        unhandled.append("float64 inputs")
    installed = _TRITON_INSTALLED
    if backend == "auto":
        # the kernels where they were measured faster (module docstring): CUDA, bfloat16
        # products, a card with bfloat16 tensor cores; the PyTorch pass elsewhere
        return (
            rows
            and not unhandled
            and installed
            and hidden.is_cuda
            and _matmul_dtype(hidden, weight) == torch.bfloat16
            and _has_bf16_tensor_cores(hidden.device)
        )
    if unhandled:
        raise ValueError(
            f"backend='triton' does not handle {', '.join(unhandled)}; use backend='auto' "
            "(the PyTorch pass for them) or 'torch'"
        )
    if not installed:
        raise ValueError("backend='triton' needs the triton package (pip install triton)")
    from bsloss.functional.triton_fused_head import interpreter_active, interpreter_problem

    if not hidden.is_cuda and not interpreter_active():
        raise ValueError(
            f"backend='triton' with hidden_states on {hidden.device} runs only under "
            "Triton's interpreter: set TRITON_INTERPRET=1 before triton is first imported "
            "(or use backend='auto' / 'torch')"
        )
    if not hidden.is_cuda and (problem := interpreter_problem()) is not None:
        raise ValueError(f"backend='triton' with hidden_states on {hidden.device}: {problem}")
    return rows


@cache
def _has_bf16_tensor_cores(device: torch.device) -> bool:
    """Compute capability 8.0 or later (Ampere on), where Triton's bfloat16 ``tl.dot`` runs."""
    return torch.cuda.get_device_capability(device)[0] >= 8


# Outside any compiled graph: the kernels are fused already, and the chunk loop launches them
# from the host either way; Dynamo skips the pass (a graph break) rather than trace the
# autotuned kernels' launches (traced under the interpreter, it failed).
@torch.compiler.disable
def _triton_pass(
    hidden, weight, bias, table, targets, softcap, temperature, table_pad, check_finite
) -> FusedHeadOutput:
    """The Triton kernels' pass, with the PyTorch pass's dtype rule (the autocast dtype for
    the products, float32 results) and its error for non-finite logits (or, without
    ``check_finite``, the rows' finiteness returned)."""
    from bsloss.functional.triton_fused_head import triton_fused_head

    compute_dtype = _matmul_dtype(hidden, weight)
    with torch.autocast(device_type=hidden.device.type, enabled=False):
        out = triton_fused_head(
            hidden,
            weight,
            bias,
            table,
            targets,
            softcap=None if softcap is None else float(softcap),
            temperature=float(temperature),
            compute_dtype=compute_dtype,
            table_pad=table_pad,
            self_normalised=temperature < SELF_NORMALISED_BELOW,
        )
    if not check_finite:
        return FusedHeadOutput(out.expected, out.log_likelihood, out.tokens, out.finite)
    if not bool(out.finite.all()):
        raise NonFiniteLogitsError(int((~out.finite).nonzero()[0]))
    return FusedHeadOutput(out.expected, out.log_likelihood, out.tokens)


def _detach(x: Tensor | None) -> Tensor | None:
    return None if x is None else x.detach()


def _top_k_expectation(hidden, weight, bias, table, indices, row_ids, o: _Options):
    """The candidate weights over the k selected tokens (:func:`candidate_weights`: the same
    Gumbel noise at the k tokens, the softmax, the one-hot), recomputed from k gathered rows of
    the head (differentiable in ``h`` and ``W``), times k gathered rows of the table. The k
    tokens are taken in token order, as the dense path's: the one-hot picks the smallest id
    among tied scores, as an argmax over the whole vocabulary does."""
    indices = indices.sort(dim=-1).values
    head_rows = weight[indices]  # [N, k, d]
    z = torch.einsum("nd,nkd->nk", hidden.to(o.matmul_dtype), head_rows.to(o.matmul_dtype))
    z = z.to(o.dtype)
    if bias is not None:
        z = z + bias[indices].to(o.dtype)
    if o.softcap is not None:
        z = torch.tanh(z / o.softcap) * o.softcap
    noise = None
    if o.gumbel is not None:
        noise = partial(
            gumbel_scores, temperature=o.gumbel, seed=o.seed, rows=row_ids[:, None], tokens=indices
        )
    p, _ = candidate_weights(z / o.temperature, o.candidates, perturb=noise)  # k columns: no cut
    summed = F.embedding_bag(indices, table.to(o.dtype), per_sample_weights=p, mode="sum")
    return summed


def fused_token_log_likelihood(
    hidden_states: Tensor,
    output_embeddings: Tensor | nn.Module,
    target_ids: Tensor,
    *,
    bias: Tensor | None = None,
    softcap: float | None = None,
    chunk_elements: int | None = None,
    check_targets: bool = True,
) -> Tensor:
    """``log softmax(softcap(h W^T + b))[target]`` per position ``[N]`` (0 where the target is
    ``-100``), chunked: a cross-entropy without full logits. ``check_targets``: as
    :func:`fused_expected_inputs`.

    >>> import torch
    >>> h, W, y = torch.randn(4, 8), torch.randn(30, 8), torch.tensor([1, 2, -100, 29])
    >>> ll = fused_token_log_likelihood(h, W, y, chunk_elements=16)
    >>> ref = -torch.nn.functional.cross_entropy(h @ W.T, y, reduction="none")
    >>> torch.allclose(ll, ref, atol=1e-6)
    True
    """
    return fused_expected_inputs(
        hidden_states,
        output_embeddings,
        None,
        bias=bias,
        target_ids=target_ids,
        softcap=softcap,
        chunk_elements=chunk_elements,
        check_targets=check_targets,
    ).log_likelihood
