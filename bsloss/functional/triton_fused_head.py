r"""The fused LM-head pass of :mod:`bsloss.functional.fused_expectation` as Triton kernels.

The same mathematics (that module's docstring): for hidden states :math:`h \in \mathbb{R}^{N
\times d}`, a head :math:`W \in \mathbb{R}^{V \times d}` (bias :math:`b`), a table :math:`E \in
\mathbb{R}^{V \times c}`, a soft-cap :math:`\kappa` and a temperature :math:`T`,

.. math::

    z = \kappa \tanh\big((h W^\top + b) / \kappa\big), \quad s = z / T, \quad
    e = \mathrm{softmax}(s)\, E, \quad \log Z = \mathrm{logsumexp}(s), \quad
    \log Z_1 = \mathrm{logsumexp}(z),

computed without an ``[N, V]`` tensor of logits, as flash attention computes attention with
queries :math:`h`, keys :math:`W` and values :math:`E` (no :math:`1/\sqrt{d}` scale).

Forward, two passes over the logits. The statistics kernel, a grid of (row blocks, vocabulary
splits), walks its split in ``BLOCK_V`` blocks; each logits tile ``[BLOCK_N, BLOCK_V]`` is built
in registers by an inner loop over ``d`` (``d = 640`` does not fit one tile), soft-capped, and
folded into an online softmax (running maximum and normaliser); the running argmax (the tokens
that ``bridge_mode="retokenize"`` decodes) and a per-row finiteness check come from the same
tile. The splits' partial statistics are merged on the host (flash-decoding's split-K), which
keeps a GPU full when ``N`` is small. With ``log Z`` known, the probabilities kernel writes
``p = exp(s - log Z)`` of one vocabulary chunk in the head's dtype, and cuBLAS multiplies it by
the chunk's table rows. (For float32 products the kernel reads the chunk's logits from
cuBLAS's ``h W^T``, the backward's own numbers, and ``e`` is renormalised by their ``p``: the
backward's gradient is then self-consistent, ``_expectation``.) Flash attention's single pass,
which carries the ``p E`` accumulator through the online softmax, was the first design: with
MiniLM's ``c = 385`` columns (a ``[64, 512]`` float32 accumulator) it did not fit the registers
and took 111 ms at Gemma 3's sizes on an H200, against ~17 ms for the two passes and the
products.

Backward, per chunk of the vocabulary: cuBLAS makes the chunk's ``h W^\top`` and ``g E^\top``
in float32 (the kernels' own tiles of them ran at ~150 TFLOP/s), and one elementwise kernel
forms

.. math::

    \frac{\partial L}{\partial z} = \Big[\frac{p \odot (g E^\top - \langle g, e\rangle)}{T}
    + g_{Z_1}\, \mathrm{softmax}(z)\Big] \odot \big(1 - (z/\kappa)^2\big),

writes it to a ``[N, chunk]`` buffer in the head's dtype and adds its column sums to the bias
gradient (atomics); ``dh += dz W_{chunk}`` and ``dW_{chunk} = dz^\top h`` are then two cuBLAS
matrix products. Holding ``dh`` or ``dW`` in registers instead (flash attention's ``dQ`` /
``dK, dV`` kernels) needs a ``[BLOCK, d]`` float32 accumulator, 160 KiB at ``d = 640`` and 64
rows; accumulating them with atomics from every ``[128, 128]`` tile (Cut Cross-Entropy's
scheme) moves ``N V d (1/BLOCK_N + 1/BLOCK_V) * 4`` bytes, about 86 GB at Gemma 3's sizes
(``N`` = 8,192, ``V`` = 262,144, ``d`` = 640), against about 30 GB for the chunks here.

The target log-likelihood is :math:`z_{y} - \log Z_1` with :math:`z_y` from a gathered row of
the head (``N d`` work); the one-hot part of its gradient is added to ``dz`` at the target's
column by the backward kernel, so the head's gradient is only ever the chunks' products (the
gradient of a gather would be another ``[V, d]`` tensor, and its sum with them a third).
Tiles and products accumulate in float32; they read bfloat16 /
float16 operands when the head is in that dtype (the table and the upstream gradient are cast to
it, as flash attention's ``P V`` and ``dO V^\top`` are; on CUDA each chunk of the table is
read with its rows padded to 8 entries for cuBLAS's aligned kernels,
:mod:`bsloss.functional.table_chunks`) and float32 ones otherwise (``"ieee"``
precision unless :func:`torch.get_float32_matmul_precision` allows TF32).

CPU tensors run under Triton's interpreter, which must be switched on before triton is first
imported (``TRITON_INTERPRET=1`` in the environment): the tests' path, slow, for small shapes.
"""

import contextlib
from typing import NamedTuple

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from bsloss.functional.chunk_budget import logits_share
from bsloss.functional.table_chunks import TableChunks

try:
    import triton
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
except ImportError:  # the torch path serves; fused_expected_inputs checks before importing us
    triton = None

__all__ = ["TritonHeadOutput", "interpreter_active", "triton_fused_head"]

# Vocabulary entries per split is a multiple of every tuned BLOCK_V.
_SPLIT_ALIGN = 256
# Elements of one vocabulary chunk's buffers [N, chunk]: 8,192 vocabulary entries at 8,192
# positions (32 chunks at Gemma 3's sizes). The whole call is bound by the host's launches on
# an H200 (run 4, benchmarks/README.md: 90 ms of wall time over 59 ms of kernels at 8 x 1024
# positions, with 64 chunks of half this size), and a chunk costs ~13 launches whatever its
# width. Forward: p in the head's dtype (128 MiB in bfloat16); backward: the two float32
# products and dz (640 MiB). Fewer positions get narrower chunks, down to half: at most 1/32
# of the [N, V] logits, at least 1 << 25 elements (8 x 256 positions: 16 chunks, backward
# buffers 320 MiB, where the dense path holds 9 GiB).
_CHUNK_ELEMENTS = 1 << 26
_MIN_CHUNK_ELEMENTS = 1 << 25
# The interpreter runs one small configuration, with splits of two blocks so that the host
# merge of the splits is exercised at the tests' vocabulary sizes.
_INTERPRETER_BLOCKS = {"BLOCK_N": 16, "BLOCK_V": 32, "BLOCK_D": 16}
_INTERPRETER_SPLIT = 64
# ... and vocabulary chunks (p forward, dz backward) ragged against those blocks
_INTERPRETER_CHUNK = 80


class TritonHeadOutput(NamedTuple):
    """``expected [N, c]`` float32 (``None`` without a table), ``log_likelihood [N]`` (``None``
    without targets), ``tokens [N]`` the argmax of each row, ``finite [N]`` whether every
    logit of the row was finite."""

    expected: Tensor | None
    log_likelihood: Tensor | None
    tokens: Tensor
    finite: Tensor


def interpreter_active() -> bool:
    """Whether triton was imported with its interpreter on (``TRITON_INTERPRET=1``): the only
    way its kernels run on CPU tensors."""
    return triton is not None and isinstance(tl.sum, InterpretedFunction)


def interpreter_problem() -> str | None:
    """Why Triton's interpreter cannot run these kernels with the installed packages, or None.

    Read once, at import: a compiled caller asks it inside its graph, and Dynamo tracing
    ``packaging``'s version parser failed (torch 2.8 under Python 3.10).
    """
    return _INTERPRETER_PROBLEM


def _find_interpreter_problem() -> str | None:
    """:func:`interpreter_problem`'s answer.

    Before triton 3.7 the interpreter turns a loop bound (a kernel argument, held as a
    one-element array) into a Python int with ``int(array)``, which NumPy 2.4 refuses: every
    kernel here loops, so each failed inside triton (found with triton 3.6, the version torch
    2.11's CUDA wheels pin, and NumPy 2.4.6; triton 3.7 with NumPy 2.4, and triton 3.6 with
    NumPy 2.3, run them)."""
    if triton is None:
        return None
    import numpy
    from packaging.version import Version  # (transformers' dependency)

    def release(text: str) -> tuple[int, ...]:
        return Version(text).release[:2]

    if release(triton.__version__) < (3, 7) and release(numpy.__version__) >= (2, 4):
        return (
            f"Triton {triton.__version__}'s interpreter cannot run kernel loops under NumPy "
            f"{numpy.__version__} (it converts a one-element array with int()); install "
            "triton>=3.7 or numpy<2.4"
        )
    return None


_INTERPRETER_PROBLEM = _find_interpreter_problem()

if triton is not None:

    @triton.jit
    def _row_dots(
        a_ptr,
        b_ptr,
        rows,
        cols,
        row_ok,
        col_ok,
        K,
        DOT_PRECISION: tl.constexpr,
        UPCAST_DOT: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_V: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """``A[rows] B[cols]^T`` in float32 for row-major ``A [., K]`` and ``B [., K]`` (``h
        W^T``), over ``K`` in ``BLOCK_K`` slices."""
        acc = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            a = tl.load(
                a_ptr + rows[:, None] * K + ks[None, :],
                mask=row_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            b = tl.load(
                b_ptr + cols[None, :] * K + ks[:, None],
                mask=col_ok[None, :] & k_ok[:, None],
                other=0.0,
            )
            if UPCAST_DOT:
                a, b = a.to(tl.float32), b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        return acc

    @triton.jit
    def _softcapped(z, softcap):
        """``kappa tanh(z / kappa)`` from one exp, stable for any sign and size of ``z``; for
        ``|z / kappa| < 1/8`` its Taylor series (``1 - t`` would cancel there: at a cap of 1e7
        the logits came out in steps of ~1), to ~1e-9 relative."""
        x = z / softcap
        t = tl.exp(-2.0 * tl.abs(x))
        far = tl.where(z < 0, -softcap, softcap) * (1.0 - t) / (1.0 + t)
        x2 = x * x
        near = z * (1.0 - x2 * (1.0 / 3.0 - x2 * (2.0 / 15.0 - x2 * (17.0 / 315.0))))
        return tl.where(tl.abs(x) < 0.125, near, far)

    @triton.jit
    def _logits_tile(
        h_ptr,
        w_ptr,
        b_ptr,
        rows,
        cols,
        row_ok,
        col_ok,
        D,
        softcap,
        HAS_BIAS: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        UPCAST_DOT: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_V: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        """Soft-capped logits ``z`` of rows x cols in float32."""
        z = _row_dots(
            h_ptr, w_ptr, rows, cols, row_ok, col_ok, D, DOT_PRECISION, UPCAST_DOT, BLOCK_N,
            BLOCK_V, BLOCK_D,
        )  # fmt: skip
        if HAS_BIAS:
            z += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if HAS_SOFTCAP:
            z = _softcapped(z, softcap)
        return z

    @triton.jit
    def _statistics_kernel(
        h_ptr,  # [N, D] the head's dtype
        w_ptr,  # [V, D]
        b_ptr,  # [V] float32 (unused without HAS_BIAS)
        max_ptr,  # [S, N] float32: running maximum of s per split
        norm_ptr,  # [S, N] float32: sum of exp(s - max)
        arg_ptr,  # [S, N] int64: first argmax of s
        check_ptr,  # [S, N] float32: 0, or NaN where some s is not finite
        max1_ptr,  # [S, N] float32: statistics of z (temperature 1), with Z_STATS
        norm1_ptr,
        N,
        V,
        D,
        vocab_per_split,
        softcap,
        inv_temperature,
        N_BUCKET,  # the autotuning key's stand-in for N
        HAS_BIAS: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr,
        Z_STATS: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        UPCAST_DOT: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_V: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        pid_n = tl.program_id(0)
        split = tl.program_id(1)
        rows = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        row_ok = rows < N
        v_begin = split * vocab_per_split
        v_end = tl.minimum(v_begin + vocab_per_split, V)
        running_max = tl.full([BLOCK_N], float("-inf"), dtype=tl.float32)
        norm = tl.zeros([BLOCK_N], dtype=tl.float32)
        argmax = tl.zeros([BLOCK_N], dtype=tl.int64)
        check = tl.zeros([BLOCK_N], dtype=tl.float32)
        max1 = tl.full([BLOCK_N], float("-inf"), dtype=tl.float32)
        norm1 = tl.zeros([BLOCK_N], dtype=tl.float32)
        for v0 in range(v_begin, v_end, BLOCK_V):
            cols = (v0 + tl.arange(0, BLOCK_V)).to(tl.int64)
            col_ok = cols < v_end
            z = _logits_tile(  # the logits tile, as in every kernel here
                h_ptr, w_ptr, b_ptr, rows, cols, row_ok, col_ok, D, softcap, HAS_BIAS,
                HAS_SOFTCAP, DOT_PRECISION, UPCAST_DOT, BLOCK_N, BLOCK_V, BLOCK_D,
            )  # fmt: skip
            s = z * inv_temperature
            # 0 * s is NaN exactly where s is NaN or infinite: one sum flags the row
            check += tl.sum(tl.where(col_ok[None, :], s * 0.0, 0.0), axis=1)
            # (NaN, already flagged, must not reach the argmax: s == s is false only for NaN)
            s = tl.where(col_ok[None, :] & (s == s), s, float("-inf"))
            tile_max, tile_arg = tl.max(s, axis=1, return_indices=True)
            # strict: the first maximum wins across blocks, as argmax over all of V
            argmax = tl.where(tile_max > running_max, v0 + tile_arg.to(tl.int64), argmax)
            new_max = tl.maximum(running_max, tile_max)
            norm = norm * tl.exp(running_max - new_max) + tl.sum(
                tl.exp(s - new_max[:, None]), axis=1
            )
            running_max = new_max
            if Z_STATS:
                zm = tl.where(col_ok[None, :], z, float("-inf"))
                new_max1 = tl.maximum(max1, tl.max(zm, axis=1))
                norm1 = norm1 * tl.exp(max1 - new_max1) + tl.sum(
                    tl.exp(zm - new_max1[:, None]), axis=1
                )
                max1 = new_max1
        at = split * N + rows
        tl.store(max_ptr + at, running_max, mask=row_ok)
        tl.store(norm_ptr + at, norm, mask=row_ok)
        tl.store(arg_ptr + at, argmax, mask=row_ok)
        tl.store(check_ptr + at, check, mask=row_ok)
        if Z_STATS:
            tl.store(max1_ptr + at, max1, mask=row_ok)
            tl.store(norm1_ptr + at, norm1, mask=row_ok)

    @triton.jit
    def _probabilities_kernel(
        h_ptr,  # [N, D]
        w_ptr,  # [V, D]
        b_ptr,  # [V] float32
        log_z_ptr,  # [N] float32: normaliser of s
        p_ptr,  # [N, v_end - v_begin] the head's dtype, rows out_stride apart
        hw_ptr,  # [N, v_end - v_begin] float32: h W^T of the chunk (cuBLAS; FROM_PRODUCT)
        p_sum_ptr,  # [N] float32: sum of the written p (FROM_PRODUCT)
        N,
        D,
        v_begin,
        v_end,
        in_stride,
        out_stride,
        softcap,
        inv_temperature,
        N_BUCKET,
        HAS_BIAS: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr,
        FROM_PRODUCT: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        UPCAST_DOT: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_V: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        """``p = exp(s - log Z)`` of one vocabulary chunk, from the logits tile and the
        statistics pass's normaliser: the operand of the cuBLAS product ``p E``. With
        ``FROM_PRODUCT`` the logits are the chunk's cuBLAS ``h W^T``, the backward's own
        numbers, and each row's sum of ``p`` is added up (``_expectation``)."""
        pid_n = tl.program_id(0)
        pid_v = tl.program_id(1)
        rows = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        row_ok = rows < N
        local = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
        cols = (v_begin + local).to(tl.int64)
        col_ok = cols < v_end
        ok = row_ok[:, None] & col_ok[None, :]
        if FROM_PRODUCT:  # as the backward kernel reads them
            z = tl.load(hw_ptr + rows[:, None] * in_stride + local[None, :], mask=ok, other=0.0)
            if HAS_BIAS:
                z += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            if HAS_SOFTCAP:
                z = _softcapped(z, softcap)
        else:
            z = _logits_tile(  # the logits tile, as in every kernel here
                h_ptr, w_ptr, b_ptr, rows, cols, row_ok, col_ok, D, softcap, HAS_BIAS,
                HAS_SOFTCAP, DOT_PRECISION, UPCAST_DOT, BLOCK_N, BLOCK_V, BLOCK_D,
            )  # fmt: skip
        log_z = tl.load(log_z_ptr + rows, mask=row_ok, other=0.0)
        p = tl.exp(z * inv_temperature - log_z[:, None]).to(p_ptr.dtype.element_ty)
        tl.store(p_ptr + rows[:, None] * out_stride + local[None, :], p, mask=ok)
        if FROM_PRODUCT:
            p_sum = tl.sum(tl.where(ok, p.to(tl.float32), 0.0), axis=1)
            tl.atomic_add(p_sum_ptr + rows, p_sum, mask=row_ok)

    @triton.jit
    def _grad_logits_kernel(
        hw_ptr,  # [N, width] float32: h W^T of the chunk (cuBLAS), rows in_stride apart
        ge_ptr,  # [N, width] float32: g E^T of the chunk (cuBLAS; unused without TABLE_GRAD)
        b_ptr,  # [V] float32
        g_dot_e_ptr,  # [N] float32: <g, e>
        log_z_ptr,  # [N] float32: normaliser of s
        inv_p_sum_ptr,  # [N] float32: 1 / sum of this pass's p (SELF_NORMALISED)
        g_log_z1_ptr,  # [N] float32: grad of log Z_1
        log_z1_ptr,  # [N] float32: normaliser of z
        targets_ptr,  # [N] int64: target ids (negative: none)
        g_target_ptr,  # [N] float32: grad of the target's logit z_y
        dz_ptr,  # [N, width] the head's dtype, rows out_stride apart
        db_ptr,  # [V] float32
        N,
        v_begin,
        v_end,
        in_stride,
        out_stride,
        softcap,
        inv_temperature,
        N_BUCKET,
        HAS_BIAS: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr,
        TABLE_GRAD: tl.constexpr,
        SELF_NORMALISED: tl.constexpr,
        LOG_Z1_GRAD: tl.constexpr,
        TARGET_GRAD: tl.constexpr,
        BIAS_GRAD: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_V: tl.constexpr,
    ):
        """``dL/dz`` of one vocabulary chunk, elementwise from the two products (which cuBLAS
        makes at its own pace: in-kernel tiles of them ran at ~150 TFLOP/s on an H200)."""
        pid_n = tl.program_id(0)
        pid_v = tl.program_id(1)
        rows = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        row_ok = rows < N
        local = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
        cols = (v_begin + local).to(tl.int64)
        col_ok = cols < v_end
        ok = row_ok[:, None] & col_ok[None, :]
        at = rows[:, None] * in_stride + local[None, :]
        z = tl.load(hw_ptr + at, mask=ok, other=0.0)
        if HAS_BIAS:
            z += tl.load(b_ptr + cols, mask=col_ok, other=0.0)[None, :]
        if HAS_SOFTCAP:
            z = _softcapped(z, softcap)
        dz = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)
        if TABLE_GRAD:
            g_e = tl.load(ge_ptr + at, mask=ok, other=0.0)
            log_z = tl.load(log_z_ptr + rows, mask=row_ok, other=0.0)
            g_dot_e = tl.load(g_dot_e_ptr + rows, mask=row_ok, other=0.0)
            p = tl.exp(z * inv_temperature - log_z[:, None])
            if SELF_NORMALISED:  # p / S, S this pass's own sum (``_own_sums``)
                p *= tl.load(inv_p_sum_ptr + rows, mask=row_ok, other=0.0)[:, None]
            dz = p * (g_e - g_dot_e[:, None]) * inv_temperature
        if LOG_Z1_GRAD:
            log_z1 = tl.load(log_z1_ptr + rows, mask=row_ok, other=0.0)
            g_log_z1 = tl.load(g_log_z1_ptr + rows, mask=row_ok, other=0.0)
            dz += g_log_z1[:, None] * tl.exp(z - log_z1[:, None])
        if TARGET_GRAD:  # the one-hot part of the CE's gradient, at the target's column
            target = tl.load(targets_ptr + rows, mask=row_ok, other=-1)
            g_target = tl.load(g_target_ptr + rows, mask=row_ok, other=0.0)
            dz += tl.where(cols[None, :] == target[:, None], g_target[:, None], 0.0)
        if HAS_SOFTCAP:  # d(kappa tanh(x / kappa)) / dx = 1 - (z / kappa)^2
            capped = z / softcap
            dz = dz * (1.0 - capped * capped)
        dz = tl.where(ok, dz, 0.0)
        if BIAS_GRAD:
            tl.atomic_add(db_ptr + cols, tl.sum(dz, axis=0), mask=col_ok)
        tl.store(
            dz_ptr + rows[:, None] * out_stride + local[None, :],
            dz.to(dz_ptr.dtype.element_ty),
            mask=ok,
        )

    def _config(n, v, d, warps, stages, **extra):
        blocks = {"BLOCK_N": n, "BLOCK_V": v, "BLOCK_D": d, **extra}
        return triton.Config(blocks, num_warps=warps, num_stages=stages)

    # Chosen among builds for sm_90a that spill nothing (triton.compile with its bundled ptxas,
    # on a CPU); the autotuner picks among them on the card. The first statistics one is the
    # configuration the earlier CE-alone forward measured at 0.89x a model's CE step (H200).
    _STATISTICS_CONFIGS = [
        _config(128, 64, 64, 8, 3),
        _config(64, 64, 64, 8, 3),
        _config(64, 128, 64, 8, 3),
        _config(128, 128, 32, 8, 3),
    ]
    _PROBABILITY_CONFIGS = [
        _config(64, 64, 64, 8, 3),
        _config(128, 64, 64, 8, 3),
        _config(64, 128, 64, 8, 3),
        _config(128, 128, 32, 8, 3),
        _config(64, 64, 32, 4, 3),
    ]
    # elementwise: tiles of 2^13 to 2^14 elements, 16 per thread at most
    _BACKWARD_CONFIGS = [
        triton.Config({"BLOCK_N": 32, "BLOCK_V": 256}, num_warps=4),
        triton.Config({"BLOCK_N": 64, "BLOCK_V": 256}, num_warps=8),
        triton.Config({"BLOCK_N": 16, "BLOCK_V": 512}, num_warps=4),
        triton.Config({"BLOCK_N": 64, "BLOCK_V": 128}, num_warps=4),
    ]
    # each kernel's configurations, and the keys its autotuned launcher tunes on (the
    # interpreter runs one small configuration instead)
    _CONFIGS = {
        _statistics_kernel: _STATISTICS_CONFIGS,
        _probabilities_kernel: _PROBABILITY_CONFIGS,
        _grad_logits_kernel: _BACKWARD_CONFIGS,
    }
    _TUNING = {
        _statistics_kernel: {"key": ["D", "N_BUCKET", "Z_STATS"]},
        _probabilities_kernel: {
            "key": ["D", "N_BUCKET", "FROM_PRODUCT"],
            "reset_to_zero": ["p_sum_ptr"],
        },
        _grad_logits_kernel: {
            "key": [
                "N_BUCKET",
                "TABLE_GRAD",
                "SELF_NORMALISED",
                "LOG_Z1_GRAD",
                "TARGET_GRAD",
                "HAS_SOFTCAP",
            ],
            "reset_to_zero": ["db_ptr"],
        },
    }

# Each kernel's autotuned launcher, made at its first launch on a GPU, not at import: before
# triton 3.4 (torch 2.6 and 2.7 pin 3.2 and 3.3), ``triton.autotune`` asks for the active GPU
# driver when it is applied, so on a machine without a GPU importing this module failed ("0
# active drivers"), and the CPU's clear refusals of ``backend="triton"`` with it.
_TUNED: dict = {}


def _tuned(kernel):
    launcher = _TUNED.get(kernel)
    if launcher is None:
        launcher = _TUNED[kernel] = triton.autotune(_CONFIGS[kernel], **_TUNING[kernel])(kernel)
    return launcher


def _launch(kernel, grid, *args, **kwargs) -> None:
    """The autotuned kernel on a GPU; the interpreter's one small configuration on CPU, with
    the products' half-precision operands converted to float32 first (exact), since the
    interpreter multiplies the bit patterns of bfloat16 ``tl.dot`` operands
    (triton-lang/triton#11584).

    The arguments are checked against the kernel's own in both modes: the interpreter ignores a
    keyword the kernel lacks, where the compiled launcher raises (a stray ``UPCAST_DOT`` once
    passed every CPU test and failed every GPU call)."""
    interpreted = interpreter_active()
    if "UPCAST_DOT" in kernel.arg_names:
        kwargs["UPCAST_DOT"] = interpreted
    if interpreted:
        kwargs.update((k, v) for k, v in _INTERPRETER_BLOCKS.items() if k in kernel.arg_names)
    signature = (kernel, len(args), tuple(kwargs), interpreted)
    if signature not in _CHECKED_LAUNCHES:  # once per call shape: the host's time is the GPU's
        tuned = {name for config in _CONFIGS.get(kernel, ()) for name in config.kwargs}
        given = kernel.arg_names[: len(args)] + list(kwargs)
        unknown = sorted(set(kwargs) - set(kernel.arg_names))
        missing = sorted(set(kernel.arg_names) - set(given) - (set() if interpreted else tuned))
        if unknown or missing or len(args) > len(kernel.arg_names):
            raise TypeError(
                f"{kernel.__name__}: arguments that are not the kernel's {unknown}, missing "
                f"{missing}, {len(args)} positional for {len(kernel.arg_names)} parameters"
            )
        _CHECKED_LAUNCHES.add(signature)
    _check_zeroed_apart(kernel, args)
    (kernel if interpreted else _tuned(kernel))[grid](*args, **kwargs)


_CHECKED_LAUNCHES: set = set()


def _check_zeroed_apart(kernel, args) -> None:
    """The autotuner zeroes each ``reset_to_zero`` argument (an accumulator of atomics) before
    every timed run and again after tuning: one that shared memory with another argument
    would zero that one as well, on a GPU's first call only, where the interpreter (which
    does not tune) shows nothing. Checked at every launch, in both modes (a stand-in for an
    unused accumulator once was the normaliser ``log Z``)."""
    zeroed = _TUNING.get(kernel, {}).get("reset_to_zero", ())
    bound = dict(zip(kernel.arg_names, args, strict=False))  # positional ones (tensors)
    for name in zeroed:
        target = bound.get(name)
        if not isinstance(target, Tensor) or target.numel() == 0:
            continue
        address = target.untyped_storage().data_ptr()
        for other_name, other in bound.items():
            if (
                other_name != name
                and isinstance(other, Tensor)
                and other.numel() > 0
                and other.untyped_storage().data_ptr() == address
            ):
                raise RuntimeError(
                    f"{kernel.__name__}: {name}, which the autotuner zeroes, shares memory "
                    f"with {other_name}"
                )


def _n_bucket(n: int) -> int:
    """Autotuning key for the number of rows: a power of two, so that the varying number of
    scored positions of a training run tunes a handful of times, not at every batch."""
    return min(triton.next_power_of_2(max(n, 1)), 1 << 16)


def _dot_precision(dtype: torch.dtype) -> str:
    if dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest":
        return "tf32"
    return "ieee"


def _vocab_splits(n: int, vocab: int, device: torch.device) -> int:
    """Vocabulary entries per split: enough splits for eight programs per multiprocessor at
    64-row blocks (the last of several waves of programs then idles little of the card: at two
    per multiprocessor, 8,192 rows in 128-row blocks made 1.45 waves, the statistics kernel
    ran at ~260 TFLOP/s on an H200), each split at least four 256-entry blocks."""
    if interpreter_active():
        return _INTERPRETER_SPLIT
    programs = triton.cdiv(n, 64)
    processors = torch.cuda.get_device_properties(device).multi_processor_count
    splits = max(1, min(triton.cdiv(8 * processors, programs), vocab // (4 * _SPLIT_ALIGN)))
    return triton.cdiv(triton.cdiv(vocab, splits), _SPLIT_ALIGN) * _SPLIT_ALIGN


class _Statistics(NamedTuple):
    expected: Tensor | None  # [N, c] float32
    log_z: Tensor  # [N] normaliser of s
    log_z1: Tensor  # [N] normaliser of z (log_z itself when not computed apart)
    tokens: Tensor
    finite: Tensor


def _vocab_chunk(n: int, vocab: int) -> int:
    """Vocabulary entries of one ``[N, chunk]`` buffer of at most :data:`_CHUNK_ELEMENTS`
    (1/32 of the ``[N, V]`` logits where that is fewer, down to :data:`_MIN_CHUNK_ELEMENTS`);
    under the interpreter a width ragged against its blocks, so that the tests' small vocabularies
    still make several chunks."""
    if interpreter_active():
        return min(vocab, _INTERPRETER_CHUNK)
    elements = min(_CHUNK_ELEMENTS, max(_MIN_CHUNK_ELEMENTS, logits_share(n, vocab)))
    return max(1, min(vocab, elements // max(n, 1)))


def _vocab_chunks(n: int, vocab: int, like: Tensor):
    """For each vocabulary chunk: ``(v0, v1, buffer, grid)``, the chunk's ``[N, v1 - v0]`` view
    of one ``[N, chunk]`` buffer in ``like``'s dtype (reused from chunk to chunk: its row
    stride is the full chunk's) and the kernels' grid of (row blocks, vocabulary blocks)."""
    chunk = _vocab_chunk(n, vocab)
    buffer = torch.empty(n, chunk, dtype=like.dtype, device=like.device)
    for v0 in range(0, vocab, chunk):
        v1 = min(v0 + chunk, vocab)

        def grid(meta, width=v1 - v0):
            return (triton.cdiv(n, meta["BLOCK_N"]), triton.cdiv(width, meta["BLOCK_V"]))

        yield v0, v1, buffer[:, : v1 - v0], grid


# (device type, dtype) -> whether torch.mm(..., out_dtype=torch.float32) runs there
_FLOAT32_OUTPUT: dict[tuple[str, torch.dtype], bool] = {}


def _float32_product(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` in float32 from half-precision operands without float32 copies of them:
    ``torch.mm(..., out_dtype=torch.float32)`` on CUDA (PyTorch 2.8 and later); elsewhere, and
    on older versions, the operands upcast (exact: a product of two bfloat16 or float16
    numbers fits a float32)."""
    if a.dtype == torch.float32:
        return a @ b
    if a.device.type == "cuda" and _outputs_float32(a, b):
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def _outputs_float32(a: Tensor, b: Tensor) -> bool:
    """Whether this torch's ``mm`` takes ``out_dtype`` for ``a``'s device and dtype, asked once
    with ``1 x 1`` pieces of the operands. It was learnt from the first failing product of
    full size instead, whose out-of-memory error (a ``RuntimeError``) or CUDA error turned the
    fast product off for the rest of the process, silently (audit h19); a real product's
    errors now reach the caller."""
    key = (a.device.type, a.dtype)
    known = _FLOAT32_OUTPUT.get(key)
    if known is None:
        try:
            torch.mm(a[:1, :1], b[:1, :1], out_dtype=torch.float32)
            known = True
        except (TypeError, RuntimeError, NotImplementedError):
            known = False
        _FLOAT32_OUTPUT[key] = known
    return known


def _statistics(hidden, weight, bias, softcap, temperature, z_stats) -> _Statistics:
    """``log Z`` (of ``s``), ``log Z_1`` (of ``z``, with ``z_stats``), argmax and finiteness:
    one kernel over (row blocks, vocabulary splits), the splits merged here."""
    n, d = hidden.shape
    vocab = weight.shape[0]
    per_split = _vocab_splits(n, vocab, hidden.device)
    splits = triton.cdiv(vocab, per_split)
    f32 = {"dtype": torch.float32, "device": hidden.device}
    running_max = torch.empty(splits, n, **f32)
    norm, check = torch.empty_like(running_max), torch.empty_like(running_max)
    argmax = torch.empty(splits, n, dtype=torch.long, device=hidden.device)
    max1 = torch.empty_like(running_max) if z_stats else running_max
    norm1 = torch.empty_like(running_max) if z_stats else running_max

    def grid(meta):
        return (triton.cdiv(n, meta["BLOCK_N"]), splits)

    _launch(
        _statistics_kernel,
        grid,
        hidden,
        weight,
        bias if bias is not None else running_max,
        running_max,
        norm,
        argmax,
        check,
        max1,
        norm1,
        n,
        vocab,
        d,
        per_split,
        float(softcap or 1.0),
        1.0 / temperature,
        _n_bucket(n),
        HAS_BIAS=bias is not None,
        HAS_SOFTCAP=softcap is not None,
        Z_STATS=z_stats,
        DOT_PRECISION=_dot_precision(hidden.dtype),
    )
    # flash-decoding's merge of the splits: rescale each to the overall maximum
    top = running_max.max(dim=0).values
    log_z = top + torch.log((norm * torch.exp(running_max - top)).sum(dim=0))
    # torch.argmax returns the first split holding the maximum: the first maximum over V
    tokens = argmax.gather(0, running_max.argmax(dim=0, keepdim=True))[0]
    finite = torch.isfinite(check.sum(dim=0)) & torch.isfinite(log_z)
    log_z1 = log_z
    if z_stats:
        top1 = max1.max(dim=0).values
        log_z1 = top1 + torch.log((norm1 * torch.exp(max1 - top1)).sum(dim=0))
    return _Statistics(None, log_z, log_z1, tokens, finite)


def _expectation(
    hidden, weight, bias, table, log_z, softcap, temperature, table_pad
) -> tuple[Tensor, Tensor]:
    """``sum_v p_v E_v`` with ``p = exp(s - log Z)`` known: chunk by chunk of the vocabulary, the
    kernel writes ``p`` in the head's dtype and cuBLAS multiplies it by the table's rows, read
    in that dtype and padded (each chunk's product rounded to that dtype, summed in float32, as
    ``dh`` is backward). The result has the padded width; with it, the normaliser the backward
    is to use.

    The backward's gradient ``p (g E^T - <g, e>) / T`` sums to zero over the vocabulary only if
    its ``p`` (from cuBLAS's ``h W^T``) are the ones that made ``e``: logits of the kernels'
    tiles differ from cuBLAS's in their last bits (far more where TF32 is allowed), and the
    residual, divided by ``T``, was 19% of ``dh`` at ``T = 0.01`` in float32 (audit h17). So
    for float32 products ``p`` is formed from the same cuBLAS ``h W^T`` as backward, and ``e``
    and ``log Z`` are renormalised by the sum of those ``p``: the backward's ``p`` then sum to
    1 and make ``e`` exactly. Half-precision products keep the logits tiles (one fewer product
    per chunk; bfloat16's speed measured on an H200): the ``p`` written for ``p E`` are
    rounded to the head's dtype, so their sum no longer normalises the backward's float32
    ``p`` (float16 near one-hot rows at ``T = 1e-3`` got ``|dh|`` ~0.9 where it is ~1e-13,
    audit h20), and that rounding is the larger error there anyway."""
    n = hidden.shape[0]
    vocab = weight.shape[0]
    values = TableChunks(table, hidden.dtype, table_pad)
    expected = torch.zeros(n, values.width, dtype=torch.float32, device=hidden.device)
    from_product = hidden.dtype == torch.float32
    # (unused without from_product: an empty stand-in, as the autotuner zeroes it)
    p_sum = torch.zeros(n if from_product else 0, dtype=torch.float32, device=hidden.device)
    for v0, v1, part, grid in _vocab_chunks(n, vocab, hidden):
        hw = _float32_product(hidden, weight[v0:v1].T) if from_product else log_z
        _probabilities(hidden, weight, bias, log_z, part, hw, p_sum, v0, v1, grid, softcap,
                       temperature, from_product)  # fmt: skip
        del hw
        expected += (part @ values.rows(v0, v1)).float()
    if from_product:
        return expected / p_sum[:, None], log_z + torch.log(p_sum)
    return expected, log_z


def _probabilities(
    hidden, weight, bias, log_z, part, hw, p_sum, v0, v1, grid, softcap, temperature, from_product
) -> None:
    """One vocabulary chunk's ``p = exp(s - log Z)`` into ``part`` (the probabilities kernel):
    from the logits tiles, or ``from_product`` from the chunk's float32 ``hw`` (cuBLAS's
    ``h W^T``), each row's sum of ``p`` then added to ``p_sum``."""
    n, d = hidden.shape
    _launch(
        _probabilities_kernel,
        grid,
        hidden,
        weight,
        bias if bias is not None else log_z,
        log_z,
        part,
        hw,
        p_sum,
        n,
        d,
        v0,
        v1,
        hw.stride(0) if from_product else 0,
        part.stride(0),
        float(softcap or 1.0),
        1.0 / temperature,
        _n_bucket(n),
        HAS_BIAS=bias is not None,
        HAS_SOFTCAP=softcap is not None,
        FROM_PRODUCT=from_product,
        DOT_PRECISION=_dot_precision(hidden.dtype),
    )


def _forward(hidden, weight, bias, table, softcap, temperature, z_stats, table_pad) -> _Statistics:
    """Two passes over the logits, each a matrix product's worth of work: the statistics, then
    (with a table) the probabilities that cuBLAS multiplies by the table. One fused pass that
    carries a ``[rows, c]`` float32 accumulator (c = 385 for MiniLM) through the softmax, as
    flash attention carries its output, measured 111 ms at Gemma 3's sizes on an H200 against
    ~6 ms for the statistics alone: the accumulator does not fit the registers."""
    stats = _statistics(hidden, weight, bias, softcap, temperature, z_stats)
    if table is None:
        return stats
    expected, log_z = _expectation(
        hidden, weight, bias, table, stats.log_z, softcap, temperature, table_pad
    )
    # log_z1, the CE's normaliser, stays the statistics' (at T = 1 the same tensor as their
    # log Z): the renormalised log Z is the expectation's, for the backward's p
    return stats._replace(expected=expected, log_z=log_z)


class _TritonFusedHead(torch.autograd.Function):
    """Forward: the expectation and ``log Z_1`` (the CE's normaliser). Backward: ``dz`` chunk
    by chunk from the kernel, then ``dh`` and ``dW`` by matrix products."""

    @staticmethod
    def forward(
        ctx, hidden, weight, bias, table, targets, softcap, temperature, z_stats, table_pad,
        self_normalised,
    ):  # fmt: skip
        with _device_guard(hidden):
            stats = _forward(hidden, weight, bias, table, softcap, temperature, z_stats, table_pad)
        ctx.softcap, ctx.temperature, ctx.z_stats = softcap, temperature, z_stats
        ctx.table_pad, ctx.self_normalised = table_pad, self_normalised
        target_logit = hidden.new_empty(0, dtype=torch.float32)
        if targets is not None:
            target_logit = _target_logits(hidden, weight, bias, targets, softcap)
        ctx.save_for_backward(
            hidden, weight, bias, table, targets, stats.expected, stats.log_z, stats.log_z1
        )
        ctx.mark_non_differentiable(stats.tokens, stats.finite)
        # an output nothing uses gets None, not zeros: its part of the kernel is skipped (the
        # CE's normaliser without targets is the expectation's, of z / T: exp(z - it), times a
        # zero gradient, overflowed to NaN for T != 1)
        ctx.set_materialize_grads(False)
        expected = stats.expected if table is not None else hidden.new_empty(0)
        return expected, stats.log_z1, target_logit, stats.tokens, stats.finite

    @staticmethod
    @once_differentiable  # a second derivative would need the kernels' graph: refused, named
    def backward(ctx, grad_expected, grad_log_z1, grad_target_logit, _tokens, _finite):
        with _device_guard(ctx.saved_tensors[0]):
            return _backward(ctx, grad_expected, grad_log_z1, grad_target_logit)


def _device_guard(tensor: Tensor):
    """The tensor's GPU as the current device while its kernels launch: Triton launches on the
    current device and stream, not on its arguments' (torch's own operations switch; a raw
    launch does not), so a head on ``cuda:1`` under ``cuda:0`` (``device_map="auto"`` puts
    the head on the last GPU) failed to read its pointers, or ran unordered with the stream
    that wrote them (audit h19)."""
    return torch.cuda.device(tensor.device) if tensor.is_cuda else contextlib.nullcontext()


def _backward(ctx, grad_expected, grad_log_z1, grad_target_logit):
    """:meth:`_TritonFusedHead.backward` on the tensors' device."""
    hidden, weight, bias, table, targets, expected, log_z, log_z1 = ctx.saved_tensors
    need_h, need_w, need_b = ctx.needs_input_grad[:3]
    table_grad = table is not None and grad_expected is not None
    # the CE's normaliser is only the CE's with targets (without, it stands in for it)
    log_z1_grad = targets is not None and grad_log_z1 is not None
    target_grad = targets is not None and grad_target_logit is not None
    grad_h = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    grad_w = torch.zeros_like(weight) if need_w else None
    grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=hidden.device)
    if not (table_grad or log_z1_grad or target_grad) or not (need_h or need_w or need_b):
        # nothing reaches the logits: zero gradients
        return _grads(grad_h if need_h else None, hidden, grad_w, grad_b if need_b else None)
    n, d = hidden.shape
    vocab = weight.shape[0]
    # the product g E^T reads g (of the padded width) and the table in the head's dtype;
    # <g, e> uses the same rounded g, so that the rounding moves g itself, not the
    # difference g E_v - <g, e>
    g = grad_expected.to(hidden.dtype).contiguous() if table_grad else hidden
    values = TableChunks(table, hidden.dtype, ctx.table_pad) if table_grad else None
    self_normalised = table_grad and ctx.self_normalised
    inv_p_sum = log_z  # (unread without SELF_NORMALISED)
    if self_normalised:
        p_sum, weighted = _own_sums(hidden, weight, bias, g, values, log_z, ctx)
        inv_p_sum, g_dot_e = 1.0 / p_sum, weighted / p_sum
    elif table_grad:
        g_dot_e = (g.float() * expected).sum(dim=1)
    else:
        g_dot_e = log_z
    g_log_z1 = grad_log_z1.float().contiguous() if log_z1_grad else log_z
    g_target = grad_target_logit.float().contiguous() if target_grad else log_z
    target_ids = targets if target_grad else log_z  # (unread without TARGET_GRAD)
    for v0, v1, part, grid in _vocab_chunks(n, vocab, hidden):
        # the chunk's logits and g E^T as float32 products of the half-precision operands:
        # the same numbers as the kernels' own float32 tiles, in another summation order
        hw = _float32_product(hidden, weight[v0:v1].T)
        g_e = _float32_product(g, values.rows(v0, v1).T) if table_grad else hw
        _launch(
            _grad_logits_kernel,
            grid,
            hw,
            g_e,
            bias if bias is not None else log_z,
            g_dot_e,
            log_z,
            inv_p_sum,
            g_log_z1,
            log_z1,
            target_ids,
            g_target,
            part,
            grad_b,
            n,
            v0,
            v1,
            hw.stride(0),
            part.stride(0),
            float(ctx.softcap or 1.0),
            1.0 / ctx.temperature,
            _n_bucket(n),
            HAS_BIAS=bias is not None,
            HAS_SOFTCAP=ctx.softcap is not None,
            TABLE_GRAD=table_grad,
            SELF_NORMALISED=self_normalised,
            LOG_Z1_GRAD=log_z1_grad,
            TARGET_GRAD=target_grad,
            BIAS_GRAD=need_b,
        )
        if need_h:  # each chunk's product rounds to the head's dtype, summed in float32
            grad_h += (part @ weight[v0:v1]).float()
        if need_w:
            torch.mm(part.T, hidden, out=grad_w[v0:v1])
        del hw, g_e  # freed before the next chunk's products are made, not after
    return _grads(grad_h if need_h else None, hidden, grad_w, grad_b if need_b else None)


def _own_sums(hidden, weight, bias, g, values, log_z, ctx) -> tuple[Tensor, Tensor]:
    """Per row, ``S = sum_v p_v`` and ``sum_v p_v (g E^T)_v``, with ``p = exp(s - log Z)``
    and ``g E^T`` the very numbers the backward kernel forms: one more pass over the chunks
    with ``self_normalised`` (below ``fused_expectation.SELF_NORMALISED_BELOW``), as the
    PyTorch pass's ``_recomputed_sums``. There
    ``s = z / T`` is large and ``log Z``, one float32 number, is off by ~ulp(max s): the p sum
    to 1 only within ~1e-5 and, against the forward's ``e``, ``dz`` kept ``(S - 1) <g, e> / T``
    (2.9e-4 in h's gradient at T = 1e-3 where the dense float32 one is 1.5e-6 off; audit h33's
    case). With ``p / S`` and this ``<g, e>`` a near one-hot row's ``dz`` sums to 0 as the dense
    softmax's does. The ``p`` come from the probabilities kernel on the same float32 products
    (its ``FROM_PRODUCT`` mode, which adds up ``S``), written in float32: the backward kernel's
    ``p`` to the bit, where a PyTorch ``exp`` and ``tanh`` differ in the last bits that ``1 / T``
    magnifies into the very error to be removed."""
    n = hidden.shape[0]
    p_sum = torch.zeros(n, dtype=torch.float32, device=hidden.device)
    weighted = torch.zeros(n, dtype=torch.float32, device=hidden.device)
    for v0, v1, part, grid in _vocab_chunks(n, weight.shape[0], p_sum):
        hw = _float32_product(hidden, weight[v0:v1].T)
        _probabilities(hidden, weight, bias, log_z, part, hw, p_sum, v0, v1, grid, ctx.softcap,
                       ctx.temperature, from_product=True)  # fmt: skip
        del hw
        weighted += (part * _float32_product(g, values.rows(v0, v1).T)).sum(dim=1)
    return p_sum, weighted


def _grads(grad_h, hidden, grad_w, grad_b):
    grad_h = None if grad_h is None else grad_h.to(hidden.dtype)
    return grad_h, grad_w, grad_b, None, None, None, None, None, None, None


def _target_logits(hidden, weight, bias, targets, softcap) -> Tensor:
    """``z`` at each row's target ``[N]`` float32 (any value where the target is negative):
    ``N`` gathered rows of the head. Its gradient is the one-hot part of the CE's, which the
    backward kernel adds at the target's column: no ``[V, d]`` gradient of a gather (two
    more head-sized tensors at the peak, 0.6 GiB at Gemma 3's sizes)."""
    ids = targets.clamp(min=0)
    target_logit = (hidden.float() * weight[ids].float()).sum(dim=1)
    if bias is not None:
        target_logit = target_logit + bias[ids]
    if softcap is not None:
        target_logit = softcap * torch.tanh(target_logit / softcap)
    return target_logit


def triton_fused_head(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    table: Tensor | None,
    targets: Tensor | None,
    *,
    softcap: float | None,
    temperature: float,
    compute_dtype: torch.dtype,
    table_pad: int = 1,
    self_normalised: bool = False,
) -> TritonHeadOutput:
    """``softmax(softcap(h W^T + b) / T) E``, the targets' log-likelihood under ``softcap(h W^T
    + b)`` and the argmax tokens, by the Triton kernels; differentiable in ``hidden``,
    ``weight`` and ``bias`` (the table is not).

    Inputs are those :func:`bsloss.functional.fused_expectation.fused_expected_inputs` has
    checked: ``hidden [N, d]``, ``weight [V, d]``, ``bias [V]``, ``table [V, c]`` (or
    ``None``), ``targets [N]`` (negative ids, the caller's ``-100``, are ignored: 0), and
    ``compute_dtype`` the dtype of the products (float32, bfloat16 or float16);
    ``table_pad``: the table's rows are read padded with zero columns to a multiple of it (8 on
    CUDA, :mod:`bsloss.functional.table_chunks`): ``expected`` then has the padded width.
    ``self_normalised``: the backward sums its own recomputed ``p`` and normalises by that sum
    (``_own_sums``; the caller's choice, below a generator temperature of 0.05).
    """
    hidden = hidden.to(compute_dtype).contiguous()
    weight = weight.to(compute_dtype).contiguous()
    bias32 = None if bias is None else bias.float().contiguous()
    # the products read the table chunk by chunk in the head's dtype (a bfloat16 P E, as flash
    # attention's), with no whole converted copy
    table = None if table is None else table.detach()
    wants_ll = targets is not None
    if table is None:  # the CE alone: its softmax is that of z (the argmax is the same)
        temperature = 1.0
    z_stats = wants_ll and temperature != 1.0
    targets = targets.long().contiguous() if wants_ll else None
    expected, log_z1, target_logit, tokens, finite = _TritonFusedHead.apply(
        hidden, weight, bias32, table, targets, softcap, float(temperature), z_stats, table_pad,
        self_normalised,
    )  # fmt: skip
    log_likelihood = None
    if wants_ll:
        # ignored rows get 0 and no gradient (their target_logit's gradient is 0)
        log_likelihood = torch.where(targets < 0, 0.0, target_logit - log_z1)
    return TritonHeadOutput(expected if table is not None else None, log_likelihood, tokens, finite)
