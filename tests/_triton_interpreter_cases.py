"""Run by tests/test_triton_fused_head.py in a subprocess with ``TRITON_INTERPRET=1`` (triton
reads it once, at its import, so the interpreter cannot be switched on inside the test process
without leaking into other tests): each case of ``CASES`` through ``fused_expected_inputs``
with ``backend="triton"`` (the kernels under Triton's CPU interpreter) and ``backend="torch"``
(the PyTorch reference, on float32 copies of half-precision inputs), values and gradients of a
random linear function of the outputs, saved to ``OUT`` (``torch.save``).

    TRITON_INTERPRET=1 python tests/_triton_interpreter_cases.py OUT
"""

from __future__ import annotations

import contextlib
import sys

import torch

from bsloss.functional import fused_expectation
from bsloss.functional.fused_expectation import NonFiniteLogitsError, fused_expected_inputs

# Shapes ragged against the interpreter's blocks (16 rows, 32 vocabulary entries, 16 of d and
# of c, splits of 64 entries): partial row, vocabulary, d and column blocks everywhere.
CASES = {
    "plain": {"n": 8, "d": 16, "vocab": 50, "c": 5},
    "bias-targets": {"n": 17, "d": 24, "vocab": 257, "c": 9, "bias": True, "targets": True},
    "softcap-temperature-targets": {
        "n": 33,
        "d": 40,
        "vocab": 300,
        "c": 20,
        "bias": True,
        "targets": True,
        "softcap": 3.0,
        "temperature": 0.7,
    },
    "cross-entropy-only": {
        "n": 12,
        "d": 20,
        "vocab": 130,
        "c": None,
        "targets": True,
        "softcap": 2.5,
    },
    "bf16": {
        "n": 20,
        "d": 32,
        "vocab": 200,
        "c": 12,
        "bias": True,
        "targets": True,
        "softcap": 4.0,
        "temperature": 1.3,
        "dtype": torch.bfloat16,
    },
    # CUDA's layout of the table under the interpreter: rows padded to 8 entries (12 -> 16),
    # read chunk by chunk into a padded buffer, the result cut back to c
    "bf16-padded-table": {
        "n": 20,
        "d": 32,
        "vocab": 200,
        "c": 12,
        "targets": True,
        "dtype": torch.bfloat16,
        "pad_table": True,
    },
    "bf16-autocast": {"n": 9, "d": 16, "vocab": 70, "c": 6, "targets": True, "autocast": True},
    # small integer operands: exact logits with many ties across blocks and splits, where the
    # argmax must be the first maximal token, as torch's
    "tied-logits": {"n": 16, "d": 8, "vocab": 200, "c": 4, "integer": True},
    # audit h17, finding 1: the term alone at T != 1 (no targets) with logits near -60, where
    # z - log Z(z / T) passed float32's exp range; the kernel multiplied exp() of it by the
    # unused normaliser's zero gradient: NaN in every gradient. Integer operands: both
    # backends' logits are exact (at |z| ~ 60 their float32 sums in two orders differ by ulps,
    # which 1 / T amplifies in the gradient; docs/loss.md)
    "temperature-without-targets": {
        "n": 6,
        "d": 8,
        "vocab": 70,
        "c": 4,
        "bias": True,
        "shift": -60.0,
        "temperature": 0.3,
        "integer": True,
    },
    # audit h17, finding 3: a cap far above the logits (1 - exp(-2|z / kappa|) cancelled: at
    # 1e7 the logits came out in steps of ~1)
    "large-softcap": {"n": 8, "d": 16, "vocab": 90, "c": 4, "targets": True, "softcap": 1e7},
    # audit h17, finding 2: float32 at a low temperature. The backward's p came from cuBLAS's
    # logits and <g, e> from the kernels' tiles, whose last bits differ; the gradient, a
    # difference of the two divided by T, was ~1e-3 of its size off the PyTorch pass here (19%
    # of it in the audit's case)
    "low-temperature": {"n": 20, "d": 40, "vocab": 150, "c": 4, "bias": True, "temperature": 0.01},
}


def inputs(
    n,
    d,
    vocab,
    c,
    bias=False,
    targets=False,
    dtype=torch.float32,
    integer=False,
    seed=0,
    shift=0.0,
    **_,
):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g).to(dtype)
    weight = (0.5 * torch.randn(vocab, d, generator=g)).to(dtype)
    if integer:
        h = torch.randint(-1, 2, (n, d), generator=g).to(dtype)
        weight = torch.randint(-1, 2, (vocab, d), generator=g).to(dtype)
    table = None if c is None else torch.randn(vocab, c, generator=g)
    b = (torch.randn(vocab, generator=g) + shift).to(dtype) if bias else None
    y = None
    if targets:
        y = torch.randint(0, vocab, (n,), generator=g)
        y[::5] = -100
    # the upstream gradients of the expectation and of the log-likelihood
    grad_e = None if c is None else torch.randn(n, c, generator=g)
    grad_ll = torch.randn(n, generator=g)
    return h, weight, b, table, y, grad_e, grad_ll


def run(case: dict, backend: str, reference: bool) -> dict:
    """One pass and its gradients; the ``reference`` runs without autocast on the float32
    values of the half-precision operands that the kernels' products read."""
    h, weight, bias, table, y, grad_e, grad_ll = inputs(**case)
    if reference and case.get("autocast"):
        h, weight = h.bfloat16(), weight.bfloat16()
    if reference:
        h, weight = h.float(), weight.float()
        bias = None if bias is None else bias.float()
    leaves = [x.requires_grad_() for x in (h, weight, bias) if x is not None]
    autocast = case.get("autocast", False) and not reference
    padded = case.get("pad_table", False) and not reference
    with (
        torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast),
        padded_table_rows(padded),
    ):
        out = fused_expected_inputs(
            h,
            weight,
            table,
            bias=bias,
            target_ids=y,
            softcap=case.get("softcap"),
            temperature=case.get("temperature", 1.0),
            backend=backend,
        )
    loss = 0.0
    if out.expected is not None:
        loss = loss + (out.expected * grad_e).sum()
    if out.log_likelihood is not None:
        loss = loss + (out.log_likelihood * grad_ll).sum()
    grads = torch.autograd.grad(loss, leaves)
    result = {"expected": out.expected, "log_likelihood": out.log_likelihood}
    result["tokens"] = out.tokens
    result.update(zip(["grad_h", "grad_w", "grad_b"][: len(grads)], grads, strict=True))
    return {k: None if v is None else v.detach() for k, v in result.items()}


@contextlib.contextmanager
def padded_table_rows(on: bool):
    """The table's rows padded as on CUDA (``fused_expectation._pads_table_rows``) while on."""
    original = fused_expectation._pads_table_rows
    if on:
        fused_expectation._pads_table_rows = lambda hidden: True
    try:
        yield
    finally:
        fused_expectation._pads_table_rows = original


def non_finite_row() -> int | None:
    """The row that NonFiniteLogitsError names for a NaN in hidden_states row 5."""
    h, weight, _, table, *_ = inputs(n=9, d=16, vocab=40, c=3)
    h[5, 2] = float("nan")
    try:
        fused_expected_inputs(h, weight, table, backend="triton")
    except NonFiniteLogitsError as error:
        return error.row
    return None


def float16_near_one_hot() -> float:
    """The largest |dh| of the kernels for float16 operands at T = 1e-3, where every row's
    softmax is one-hot to float64's precision and the exact gradient is ~1e-13 (audit h20: the
    float32 path's renormalisation by the sum of the float16-rounded p, briefly used for float16
    too, gave 0.91)."""
    case = {"n": 12, "d": 16, "vocab": 70, "c": 4, "temperature": 1e-3, "seed": 1}
    h, weight, _, table, _, grad_e, _ = inputs(**case)
    h = h.half().requires_grad_()
    out = fused_expected_inputs(h, weight.half(), table, temperature=1e-3, backend="triton")
    (grad_h,) = torch.autograd.grad((out.expected * grad_e).sum(), [h])
    return float(grad_h.float().abs().max())


def small_temperature(device: str = "cpu") -> dict:
    """Audit h33's case under the kernels: a generator temperature that makes rows near
    one-hot (n 6, d 16, V 100, c 4), float32. For each ``(T, options)``: the largest error of
    h's gradient, the kernels' and the dense float32 softmax's, against float64, and the true
    gradient's largest entry. The kernels' backward kept ``(S - 1) <g, e> / T`` (S the sum of
    its recomputed p): 2.9e-4 at T = 1e-3 where the dense path is 1.5e-6 off. ``device``:
    "cuda" for the compiled kernels (the inputs are drawn on the CPU either way)."""
    results = {}
    for temperature in (1e-3, 1e-4):
        for extras in (False, True):
            g = torch.Generator().manual_seed(0)
            h = torch.randn(6, 16, generator=g) * 0.7
            weight = torch.randn(100, 16, generator=g) * 0.5
            table, upstream = torch.randn(100, 4, generator=g), torch.randn(6, 4, generator=g)
            bias = torch.randn(100, generator=g) if extras else None
            softcap = 3.0 if extras else None

            def grad_h(dtype, backend, h=h, weight=weight, table=table, upstream=upstream,
                       bias=bias, softcap=softcap, temperature=temperature):  # fmt: skip
                hh = h.to(device, dtype, copy=True).requires_grad_()
                w = weight.to(device, dtype)
                b = None if bias is None else bias.to(device, dtype)
                table, upstream = table.to(device), upstream.to(device)
                if backend == "dense":
                    z = hh @ w.T + (0.0 if b is None else b)
                    if softcap is not None:
                        z = softcap * torch.tanh(z / softcap)
                    e = torch.softmax(z / temperature, dim=-1) @ table.to(dtype)
                else:
                    e = fused_expected_inputs(
                        hh, w, table.to(dtype), bias=b, softcap=softcap,
                        temperature=temperature, backend=backend,
                    ).expected  # fmt: skip
                (e * upstream.to(dtype)).sum().backward()
                return hh.grad.double().cpu()

            truth = grad_h(torch.float64, "dense")
            results[(temperature, extras)] = {
                "triton": float((grad_h(torch.float32, "triton") - truth).abs().max()),
                "dense": float((grad_h(torch.float32, "dense") - truth).abs().max()),
                "size": float(truth.abs().max()),
            }
    return results


def compiled_pass() -> dict:
    """The Triton pass inside a compiled function (Dynamo, AOT autograd): how the kernels'
    entry point was called (the type of its hidden states, and whether Dynamo was tracing),
    the reasons the graph breaks, and the value and gradient against the same function eager."""
    import torch._dynamo

    from bsloss.functional import triton_fused_head as kernels

    launch, calls = kernels.triton_fused_head, []

    def recording(hidden, *args, **kwargs):
        calls.append((type(hidden).__name__, torch.compiler.is_compiling()))
        return launch(hidden, *args, **kwargs)

    h, weight, _, table, y, grad_e, grad_ll = inputs(n=9, d=16, vocab=40, c=3, targets=True)

    def step(h):
        out = fused_expected_inputs(h, weight, table, target_ids=y, backend="triton")
        return (out.expected * grad_e).sum() + (out.log_likelihood * grad_ll).sum()

    eager_h = h.clone().requires_grad_()
    eager = step(eager_h)
    eager.backward()
    explained = torch._dynamo.explain(step)(h.clone().requires_grad_())
    torch._dynamo.reset()
    compiled_h = h.clone().requires_grad_()
    kernels.triton_fused_head = recording
    try:
        value = torch.compile(step, backend="aot_eager")(compiled_h)
        value.backward()
    finally:
        kernels.triton_fused_head = launch
    torch._dynamo.reset()
    return {
        "calls": calls,
        "reasons": [r.reason for r in explained.break_reasons],
        "value": (eager.detach(), value.detach()),
        "grad": (eager_h.grad, compiled_h.grad),
    }


def main(out_path: str) -> None:
    # imported here: the test process reads CASES without importing triton
    from bsloss.functional.triton_fused_head import interpreter_active

    assert interpreter_active(), "run with TRITON_INTERPRET=1 in the environment"
    results = {}
    for name, case in CASES.items():
        results[name] = {
            "triton": run(case, "triton", reference=False),
            "torch": run(case, "torch", reference=True),
        }
    results["non_finite_row"] = non_finite_row()
    results["float16_near_one_hot"] = float16_near_one_hot()
    results["small_temperature"] = small_temperature()
    results["compiled"] = compiled_pass()
    torch.save(results, out_path)


if __name__ == "__main__":
    main(sys.argv[1])
