"""The Triton kernels of the fused LM-head pass (bsloss.functional.triton_fused_head) against the
PyTorch pass (backend="torch", the reference): values, argmax tokens and gradients of h, W and
b, in float32 and with bfloat16 operands; the backend dispatch and its errors.

Triton's interpreter (the kernels on CPU) is switched on by TRITON_INTERPRET=1 at triton's
import and cannot be switched off again in a process, so the interpreted cases run once, in a
subprocess (tests/_triton_interpreter_cases.py), and this process only compares the results."""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _triton_interpreter_cases import CASES, inputs

from bsloss.functional.fused_expectation import fused_expected_inputs

REPO = Path(__file__).resolve().parents[1]
needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed"
)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> dict:
    """Every case of CASES through both backends, under the interpreter (a few seconds);
    skipped, with the reason, where the installed triton's interpreter cannot run them."""
    from bsloss.functional.triton_fused_head import interpreter_problem

    if (problem := interpreter_problem()) is not None:
        pytest.skip(problem)
    out = tmp_path_factory.mktemp("triton") / "cases.pt"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    script = str(REPO / "tests" / "_triton_interpreter_cases.py")
    done = subprocess.run(
        [sys.executable, script, str(out)], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return torch.load(out)


# float32: the kernels and torch sum the same float32 products in other orders (blocked
# tl.dot against one matmul); over d <= 40 and V <= 300 terms of size <= ~20 that moves
# results by a few 1e-7, so 1e-5 (relative and absolute) leaves a margin and still catches
# any wrong term (a missing bias, temperature or soft-cap factor is >= 1e-2 here).
FLOAT32 = {"rtol": 1e-5, "atol": 1e-5}
# bfloat16 operands: the reference is the PyTorch pass on their float32 values, so the logits
# agree to float32 order (the log-likelihood: FLOAT32); what the kernels round in addition is
# one bfloat16 step (2^-9 relative) per rounding: the table and p in p E (two: <= 2^-8 of
# max |E|, since the p sum to 1), and for the gradients the upstream gradient in g E^T, dz,
# each chunk's dz W, and the returned bfloat16 gradient (four: 2^-7 of the largest entry).
BF16_ROUNDINGS_EXPECTED = 2
BF16_ROUNDINGS_GRADIENT = 4


@needs_triton
@pytest.mark.parametrize("name", list(CASES))
def test_interpreted_kernels_match_torch_pass(interpreted, name):
    case = CASES[name]
    kernels, reference = interpreted[name]["triton"], interpreted[name]["torch"]
    half = case.get("dtype") == torch.bfloat16 or case.get("autocast", False)
    assert torch.equal(kernels["tokens"], reference["tokens"])
    if case["c"] is None:
        assert kernels["expected"] is None and reference["expected"] is None
    else:
        table = inputs(**case)[3]
        step = BF16_ROUNDINGS_EXPECTED * 2.0**-9 * float(table.abs().max()) if half else None
        tolerance = {"rtol": 0.0, "atol": step} if half else FLOAT32
        torch.testing.assert_close(kernels["expected"], reference["expected"], **tolerance)
    if case.get("targets"):
        ll = kernels["log_likelihood"]
        torch.testing.assert_close(ll, reference["log_likelihood"], **FLOAT32)
        ignored = inputs(**case)[4] == -100
        assert ignored.any() and (ll[ignored] == 0).all()
    for grad in ("grad_h", "grad_w", "grad_b"):
        if reference.get(grad) is None:
            assert kernels.get(grad) is None
            continue
        expected = reference[grad]
        got = kernels[grad].float()
        if half:
            bound = BF16_ROUNDINGS_GRADIENT * 2.0**-9
            tolerance = {"rtol": bound, "atol": bound * float(expected.abs().max())}
        elif _max_score(case) > 100:
            # scores s = z / T of 200 to 1,500: the kernels' p = exp(s - log Z) carries
            # ~ulp(max |s|) (1.5e-5 to 1.2e-4 there) where the PyTorch pass's shifted sum does
            # not; a few of those
            tolerance = {
                "rtol": 0.0,
                "atol": 4 * _ulp(_max_score(case)) * float(expected.abs().max()),
            }
        else:
            tolerance = FLOAT32
        torch.testing.assert_close(got, expected, **tolerance, msg=lambda m, g=grad: f"{g}: {m}")


def _max_score(case: dict) -> float:
    h, weight, bias, *_ = inputs(**case)
    logits = h.float() @ weight.float().T + (0.0 if bias is None else bias.float())
    return float(logits.abs().max()) / case.get("temperature", 1.0)


def _ulp(x: float) -> float:
    return 2.0 ** (math.floor(math.log2(x)) - 23)


@needs_triton
def test_float16_near_one_hot_rows_get_no_gradient_from_rounding(interpreted):
    """float16 operands at T = 1e-3, every row's softmax one-hot: the exact gradient is ~1e-13
    (float64), float16's rounding of p must not turn into one (audit h20: 0.91 when the
    float32 path's renormalisation served float16 too)."""
    assert interpreted["float16_near_one_hot"] < 1e-6


@needs_triton
@pytest.mark.parametrize("temperature", [1e-3, 1e-4])
@pytest.mark.parametrize("extras", [False, True], ids=["plain", "bias-softcap"])
def test_interpreted_kernels_cancel_at_small_temperature(interpreted, temperature, extras):
    """Near one-hot rows at a small generator temperature: the kernels' backward normalises
    its own recomputed p, so h's gradient is as close to float64 as the dense float32
    softmax's (audit h33: 2.9e-4 off at T = 1e-3 where the dense path is 1.5e-6 off, 2.9e-3
    at 1e-4 where it is exact), the bound of test_fused's test of the PyTorch pass."""
    errors = interpreted["small_temperature"][(temperature, extras)]
    bound = 2 * errors["dense"] + 1e-6 * errors["size"] + 1e-12
    assert errors["triton"] <= bound, errors


@needs_triton
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled kernels need CUDA")
def test_compiled_kernels_cancel_at_small_temperature():
    """The case above through the compiled kernels (float32: cuBLAS's products, TF32 off)."""
    from _triton_interpreter_cases import small_temperature

    allowed = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        results = small_temperature("cuda")
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allowed
    for key, errors in results.items():
        bound = 2 * errors["dense"] + 1e-6 * errors["size"] + 1e-12
        assert errors["triton"] <= bound, (key, errors)


@needs_triton
def test_interpreted_kernels_name_the_non_finite_row(interpreted):
    # a NaN in hidden_states row 5: NonFiniteLogitsError(row=5), as the PyTorch pass raises
    assert interpreted["non_finite_row"] == 5


@needs_triton
def test_a_compiled_caller_runs_the_kernels_outside_its_graph(interpreted):
    """Under ``torch.compile`` (a compiled loss) Dynamo skips the Triton pass, a graph break:
    the kernels' entry point is called with real tensors, not while Dynamo traces, and the
    caller's value and gradient are the eager ones. (Torch 2.11 and later name the skipped
    pass among ``explain``'s break reasons; 2.8 leaves it out, hence the calls.)"""
    compiled = interpreted["compiled"]
    assert compiled["calls"] == [("Tensor", False)], (compiled["calls"], compiled["reasons"])
    torch.testing.assert_close(*compiled["value"], rtol=0, atol=0)
    torch.testing.assert_close(*compiled["grad"], rtol=1e-6, atol=1e-7)


def test_backend_is_checked():
    h, weight, _, table, *_ = inputs(n=3, d=4, vocab=10, c=2)
    with pytest.raises(ValueError, match="backend must be one of"):
        fused_expected_inputs(h, weight, table, backend="cuda")
    with pytest.raises(ValueError, match="backend='triton' does not handle top_k"):
        fused_expected_inputs(h, weight, table, top_k=2, backend="triton")
    with pytest.raises(ValueError, match="backend='triton' does not handle float64"):
        fused_expected_inputs(h.double(), weight, table, backend="triton")


@needs_triton
def test_triton_backend_on_cpu_needs_the_interpreter():
    from bsloss.functional.triton_fused_head import interpreter_active

    if interpreter_active():
        pytest.skip("this process imported triton with TRITON_INTERPRET=1")
    h, weight, _, table, *_ = inputs(n=3, d=4, vocab=10, c=2)
    # without rows too (audit h17, note 10: it ran the PyTorch pass's empty result, so the
    # error came at the first batch with rows)
    for rows in (h, h[:0]):
        with pytest.raises(ValueError, match=r"backend='triton' .* TRITON_INTERPRET=1"):
            fused_expected_inputs(rows, weight, table, backend="triton")


# Triton before 3.4 (torch 2.6's 3.2, torch 2.7's 3.3) on a machine without a GPU, as
# ``triton.autotune`` behaves there when it is applied
_AUTOTUNE_WITHOUT_A_GPU = """
import triton
def needs_a_gpu(*args, **kwargs):
    raise RuntimeError("0 active drivers ([]). There should only be one.")
triton.autotune = needs_a_gpu
import torch
from bsloss.functional import triton_fused_head
from bsloss.functional.fused_expectation import fused_expected_inputs
h, weight, table = torch.randn(3, 4), torch.randn(10, 4), torch.randn(10, 2)
try:
    fused_expected_inputs(h, weight, table, backend="triton")
except ValueError as error:
    print("refused:", error)
"""


@needs_triton
def test_the_kernels_module_imports_where_autotune_needs_a_gpu():
    """Where applying ``triton.autotune`` asks for a GPU driver (triton < 3.4 without a GPU),
    importing the kernels' module failed with triton's "0 active drivers", so backend='triton'
    on the CPU met that instead of its own refusal; the launchers are made at the first launch
    on a GPU now."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO)
    done = subprocess.run(
        [sys.executable, "-c", _AUTOTUNE_WITHOUT_A_GPU],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "refused: backend='triton' with hidden_states on cpu" in done.stdout


@needs_triton
def test_each_kernels_launcher_is_autotuned_once_at_its_first_launch(monkeypatch):
    from bsloss.functional import triton_fused_head as kernels

    made = []

    def autotune(configs, **tuning):
        def launcher(kernel):
            made.append((kernel, configs, tuning))
            return object()

        return launcher

    monkeypatch.setattr(kernels.triton, "autotune", autotune)
    monkeypatch.setattr(kernels, "_TUNED", {})
    for kernel in kernels._CONFIGS:
        assert kernels._tuned(kernel) is kernels._tuned(kernel)
    assert [kernel for kernel, *_ in made] == list(kernels._CONFIGS)
    for kernel, configs, tuning in made:
        assert configs is kernels._CONFIGS[kernel] and set(tuning["key"]) <= set(kernel.arg_names)
    assert made[-1][2]["reset_to_zero"] == ["db_ptr"]  # the bias gradient, summed by atomics


@pytest.mark.parametrize(
    "triton_version, numpy_version, refused",
    [("3.6.0", "2.4.6", True), ("3.6.0", "2.3.5", False), ("3.7.0", "2.4.6", False),
     ("3.10.1", "2.10.0", False), ("3.2.0", "2.4.0rc1", True)],
)  # fmt: skip
@needs_triton
def test_an_interpreter_that_cannot_run_the_kernels_is_named(
    monkeypatch, triton_version, numpy_version, refused
):
    """Triton before 3.7 with NumPy 2.4 or later: the interpreter fails inside triton at the
    first kernel loop (triton 3.6 and NumPy 2.4.6 tried), so backend='triton' on the CPU is
    refused first, naming both versions and the way out; other pairs run."""
    import numpy
    import triton

    from bsloss.functional import triton_fused_head

    monkeypatch.setattr(triton, "__version__", triton_version)
    monkeypatch.setattr(numpy, "__version__", numpy_version)
    problem = triton_fused_head._find_interpreter_problem()  # (read once, at import)
    monkeypatch.setattr(triton_fused_head, "_INTERPRETER_PROBLEM", problem)
    assert triton_fused_head.interpreter_problem() == problem
    if not refused:
        assert problem is None
        return
    assert triton_version in problem and numpy_version in problem and "triton>=3.7" in problem
    monkeypatch.setattr(triton_fused_head, "interpreter_active", lambda: True)
    h, weight, _, table, *_ = inputs(n=3, d=4, vocab=10, c=2)
    with pytest.raises(ValueError, match=r"backend='triton' with hidden_states on cpu: Triton"):
        fused_expected_inputs(h, weight, table, backend="triton")


def _compile_for_hopper(kernel, config, constexprs: dict, pointer_types: dict):
    """``kernel`` compiled for sm_90a by triton's own toolchain (its bundled ptxas), which runs
    without a GPU; its arguments typed by name (pointers bfloat16 unless told)."""
    from triton import compile as triton_compile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    constexprs = {**constexprs, **config.kwargs}
    if "UPCAST_DOT" in kernel.arg_names:
        constexprs["UPCAST_DOT"] = False
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = pointer_types.get(name, "*bf16")
        else:
            signature[name] = "fp32" if name in ("softcap", "inv_temperature") else "i32"
    # triton < 3.3 names the constant arguments ``constants``
    named = "constexprs" if "constexprs" in inspect.signature(ASTSource).parameters else "constants"
    source = ASTSource(fn=kernel, signature=signature, **{named: constexprs})
    options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    return triton_compile(source, target=GPUTarget("cuda", 90, 32), options=options)


@needs_triton
def test_kernels_compile_for_hopper():
    """What the interpreter cannot check (types, layouts, shared memory of the compiled
    kernels), on a CPU: every kernel, all its options on, builds for an H100."""
    from bsloss.functional import triton_fused_head as kernels

    if kernels.interpreter_active():
        pytest.skip("this process imported triton with TRITON_INTERPRET=1")
    float32 = "*fp32"
    statistics_pointers = {name: float32 for name in ("b_ptr", "max_ptr", "norm_ptr", "check_ptr")}
    statistics_pointers.update(max1_ptr=float32, norm1_ptr=float32, arg_ptr="*i64")
    options = {"HAS_BIAS": True, "HAS_SOFTCAP": True, "Z_STATS": True, "DOT_PRECISION": "ieee"}
    for config in kernels._STATISTICS_CONFIGS:
        compiled = _compile_for_hopper(
            kernels._statistics_kernel, config, options, statistics_pointers
        )
        assert compiled.metadata.shared <= 228 * 1024  # an H100's shared memory per block
    options = {"HAS_BIAS": True, "HAS_SOFTCAP": True, "DOT_PRECISION": "ieee"}
    pointers = {"b_ptr": float32, "log_z_ptr": float32, "hw_ptr": float32, "p_sum_ptr": float32}
    # half-precision heads take the logits tiles; float32 ones cuBLAS's product
    # (and, below SELF_NORMALISED_BELOW, the backward's own sums write float32 p from the
    # product for any head)
    for head, p_type, from_product in (
        ("*bf16", "*bf16", False),
        ("*fp16", "*fp16", False),
        ("*fp32", "*fp32", True),
        ("*bf16", "*fp32", True),
        ("*fp16", "*fp32", True),
    ):
        typed = {**pointers, "h_ptr": head, "w_ptr": head, "p_ptr": p_type}
        for config in kernels._PROBABILITY_CONFIGS:
            compiled = _compile_for_hopper(
                kernels._probabilities_kernel,
                config,
                {**options, "FROM_PRODUCT": from_product},
                typed,
            )
            assert compiled.metadata.shared <= 228 * 1024
    backward_pointers = {
        name: float32
        for name in (
            "hw_ptr",
            "ge_ptr",
            "b_ptr",
            "g_dot_e_ptr",
            "log_z_ptr",
            "inv_p_sum_ptr",
            "g_log_z1_ptr",
            "log_z1_ptr",
            "g_target_ptr",
            "db_ptr",
        )
    }
    backward_pointers["targets_ptr"] = "*i64"
    options = {"HAS_BIAS": True, "HAS_SOFTCAP": True, "TABLE_GRAD": True, "LOG_Z1_GRAD": True}
    options.update(TARGET_GRAD=True, BIAS_GRAD=True, SELF_NORMALISED=True)
    for config in kernels._BACKWARD_CONFIGS:
        compiled = _compile_for_hopper(
            kernels._grad_logits_kernel, config, options, backward_pointers
        )
        assert compiled.metadata.shared <= 228 * 1024


@needs_triton
@pytest.mark.parametrize(
    "case, temperature",
    [
        ("softcap-temperature-targets", 0.7),
        ("softcap-temperature-targets", 0.01),  # the backward's own sums (_own_sums)
        ("cross-entropy-only", 0.7),
    ],
)
def test_compiled_launches_get_exactly_each_kernels_arguments(monkeypatch, case, temperature):
    """What the interpreter cannot check: the compiled launcher raises on a keyword its kernel
    lacks, where the interpreter ignores it (a stray UPCAST_DOT passed every CPU test and failed
    every GPU call). The host code runs as on a GPU, the autotuned launchers replaced by
    recorders; every launch must name each parameter once, tuned blocks aside."""
    from bsloss.functional import triton_fused_head as kernels

    if kernels.interpreter_active():
        pytest.skip("this process imported triton with TRITON_INTERPRET=1")
    launched = []

    class Recorder:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                assert guarded, f"{self.kernel.__name__} launched outside the device guard"
                launched.append(self.kernel.__name__)
                tuned = {k for c in kernels._CONFIGS[self.kernel] for k in c.kwargs}
                names = self.kernel.arg_names[: len(args)] + list(kwargs)
                assert sorted(names + sorted(tuned)) == sorted(self.kernel.arg_names)
                assert grid({k: 16 for k in tuned})  # the grid reads only tuned blocks

            return launch

    monkeypatch.setattr(kernels, "_TUNED", {k: Recorder(k) for k in kernels._CONFIGS})
    # every launch inside the guard that makes the tensors' GPU the current device
    guarded = []

    @contextlib.contextmanager
    def device_guard(tensor):
        guarded.append(tensor)
        try:
            yield
        finally:
            guarded.pop()

    monkeypatch.setattr(kernels, "_device_guard", device_guard)
    monkeypatch.setattr(kernels, "_vocab_splits", lambda n, vocab, device: 64)
    h, weight, bias, table, targets, grad_e, grad_ll = inputs(**CASES[case])
    h.requires_grad_(), weight.requires_grad_()
    out = kernels.triton_fused_head(
        h, weight, bias, table, targets, softcap=3.0, temperature=temperature,
        compute_dtype=torch.float32,
    )  # fmt: skip
    loss = out.log_likelihood.sum()
    if table is not None:
        loss = loss + (out.expected * grad_e).sum()
    loss.backward()
    expected = {"_statistics_kernel", "_grad_logits_kernel"}
    if table is not None:
        expected.add("_probabilities_kernel")
    assert set(launched) == expected


@needs_triton
def test_an_accumulator_the_autotuner_zeroes_shares_no_other_arguments_memory():
    """The autotuner zeroes a ``reset_to_zero`` argument before each timed run and after
    tuning, on a GPU's first call: the probabilities kernel's ``p`` sums, unused for bfloat16
    heads, once stood in as ``log Z``, which tuning would have zeroed (the interpreter, which
    does not tune, computed right). Every launch now refuses such an alias, named."""
    from bsloss.functional import triton_fused_head as kernels

    log_z, part = torch.zeros(4), torch.zeros(4, 8)
    args = {name: 0 for name in kernels._probabilities_kernel.arg_names}
    args.update(h_ptr=part, w_ptr=part, b_ptr=log_z, log_z_ptr=log_z, p_ptr=part, hw_ptr=log_z)
    aliased = [args[name] if name != "p_sum_ptr" else log_z[1:] for name in args]
    with pytest.raises(RuntimeError, match="p_sum_ptr, which the autotuner zeroes, shares"):
        kernels._check_zeroed_apart(kernels._probabilities_kernel, aliased)
    own = [args[name] if name != "p_sum_ptr" else torch.zeros(4) for name in args]
    kernels._check_zeroed_apart(kernels._probabilities_kernel, own)
    unused = [args[name] if name != "p_sum_ptr" else torch.zeros(0) for name in args]
    kernels._check_zeroed_apart(kernels._probabilities_kernel, unused)


def test_the_device_guard_makes_the_tensors_gpu_current(monkeypatch):
    """Audit h19, finding 1: Triton launches on the current device, not on its arguments', so
    a head on ``cuda:1`` under ``cuda:0`` (``device_map="auto"``) was launched on the wrong
    GPU. Forward and backward launch inside :func:`_device_guard` (checked launch by launch in
    ``test_compiled_launches_get_exactly_each_kernels_arguments``), which enters
    ``torch.cuda.device`` of a CUDA tensor (a stand-in here) and nothing for a CPU one."""
    from bsloss.functional import triton_fused_head as kernels

    entered = []
    monkeypatch.setattr(
        torch.cuda, "device", lambda device: entered.append(device) or contextlib.nullcontext()
    )

    class OnSecondGpu:
        is_cuda = True
        device = torch.device("cuda", 1)

    with kernels._device_guard(OnSecondGpu()):
        pass
    with kernels._device_guard(torch.zeros(1)):
        pass
    assert entered == [torch.device("cuda", 1)]


@needs_triton
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_the_kernels_run_on_a_second_gpu_that_is_not_current():
    """The head and its hidden states on ``cuda:1`` while ``cuda:0`` is current: the kernels'
    values and gradients are the PyTorch pass's (which switches devices by itself)."""
    g = torch.Generator(device="cuda:1").manual_seed(0)
    h = torch.randn(64, 64, device="cuda:1", generator=g).bfloat16()
    weight = (torch.randn(3000, 64, device="cuda:1", generator=g) / 8).bfloat16()
    table = torch.randn(3000, 16, device="cuda:1", generator=g)
    grad_e = torch.randn(64, 16, device="cuda:1", generator=g)
    results = {}
    with torch.cuda.device(0):
        for backend in ("triton", "torch"):
            # the PyTorch pass on the float32 values of the same operands
            hh, ww = (h, weight) if backend == "triton" else (h.float(), weight.float())
            hh = hh.clone().requires_grad_()
            out = fused_expected_inputs(hh, ww, table, backend=backend)
            results[backend] = (
                out.expected,
                torch.autograd.grad((out.expected * grad_e).sum(), hh),
            )
    step = BF16_ROUNDINGS_EXPECTED * 2.0**-9 * float(table.abs().max())
    torch.testing.assert_close(results["triton"][0], results["torch"][0], rtol=0.0, atol=step)
    bound = BF16_ROUNDINGS_GRADIENT * 2.0**-9
    expected_grad = results["torch"][1][0]
    torch.testing.assert_close(
        results["triton"][1][0].float(),
        expected_grad,
        rtol=bound,
        atol=bound * float(expected_grad.abs().max()),
    )


def test_an_error_of_a_float32_output_product_reaches_the_caller(monkeypatch):
    """Audit h19, note 3: whether ``torch.mm`` takes ``out_dtype`` was learnt from the first
    product that failed, so one out-of-memory error (a ``RuntimeError``) turned the fast
    product off for the process, silently, every later one upcasting both operands. Now asked
    once with 1 x 1 pieces; a product's own error is raised. (CUDA emulated: a tensor that
    reports it, ``torch.mm(out_dtype=)`` as a stub that fails once at full size.)"""
    from bsloss.functional import triton_fused_head as kernels

    class ReportsCuda(torch.Tensor):
        @property
        def device(self):
            return torch.device("cuda", 0)

    real_mm, calls = torch.mm, []

    def mm(a, b, *args, out_dtype=None, **kwargs):
        if out_dtype is None:
            return real_mm(a, b, *args, **kwargs)
        calls.append(tuple(a.shape))
        if a.shape[0] > 1 and len(calls) == 2:  # the first full-size product
            raise torch.OutOfMemoryError("CUDA out of memory (emulated)")
        return real_mm(a.float(), b.float())

    monkeypatch.setattr(kernels, "_FLOAT32_OUTPUT", {})
    monkeypatch.setattr(torch, "mm", mm)
    a = torch.randn(8, 4).bfloat16().as_subclass(ReportsCuda)
    b = torch.randn(4, 3).bfloat16().as_subclass(ReportsCuda)
    with pytest.raises(torch.OutOfMemoryError):
        kernels._float32_product(a, b)
    product = kernels._float32_product(a, b)  # the fast product again, not the fallback
    assert calls == [(1, 1), (8, 4), (8, 4)]
    torch.testing.assert_close(product, a.float() @ b.float(), rtol=0, atol=0)
    # a torch whose mm has no out_dtype: asked once, the operands upcast from then on
    monkeypatch.setattr(kernels, "_FLOAT32_OUTPUT", {})
    asked = []

    def mm_without_out_dtype(a, b, *args, **kwargs):
        if kwargs:
            asked.append(tuple(a.shape))
            raise TypeError("mm() got an unexpected keyword argument 'out_dtype'")
        return real_mm(a, b, *args)

    monkeypatch.setattr(torch, "mm", mm_without_out_dtype)
    for _ in range(2):
        product = kernels._float32_product(a, b)
        torch.testing.assert_close(product, a.float() @ b.float(), rtol=0, atol=0)
    assert asked == [(1, 1)]


def test_auto_backend_takes_the_kernels_only_on_cuda_for_bf16_products(monkeypatch):
    """``"auto"``: the kernels for CUDA tensors whose products run in bfloat16 (a bf16 head or
    autocast to it) on a card with bf16 tensor cores, options permitting; the PyTorch pass for
    float32 / float16 products, the CPU, top-k and older cards (fake CUDA tensors: the rule
    reads only the device, dtypes and options)."""
    from bsloss.functional import fused_expectation as fe

    class FakeCuda:
        is_cuda = True

        def __init__(self, dtype, n=4):
            self.dtype, self.shape, self.device = dtype, (n, 8), torch.device("cuda", 0)

    installed = importlib.util.find_spec("triton") is not None
    monkeypatch.setattr(fe, "_has_bf16_tensor_cores", lambda device: True)
    monkeypatch.setattr(torch, "is_autocast_enabled", lambda device=None: False)
    plain = {"top_k": None, "straight_through": False, "gumbel_temperature": None}
    bf16, fp32 = FakeCuda(torch.bfloat16), FakeCuda(torch.float32)
    assert fe._runs_on_triton("auto", bf16, bf16, plain) is installed
    assert not fe._runs_on_triton("auto", fp32, fp32, plain)
    assert not fe._runs_on_triton("auto", FakeCuda(torch.float16), bf16, plain)  # fp16 products
    assert not fe._runs_on_triton("auto", bf16, bf16, {**plain, "top_k": 5})
    assert not fe._runs_on_triton("auto", FakeCuda(torch.bfloat16, n=0), bf16, plain)
    assert not fe._runs_on_triton("torch", bf16, bf16, plain)
    monkeypatch.setattr(fe, "_has_bf16_tensor_cores", lambda device: False)
    assert not fe._runs_on_triton("auto", bf16, bf16, plain)


def test_auto_backend_on_cpu_is_the_torch_pass():
    h, weight, _, table, *_ = inputs(n=5, d=8, vocab=40, c=3)
    auto = fused_expected_inputs(h, weight, table)
    torch_pass = fused_expected_inputs(h, weight, table, backend="torch")
    assert torch.equal(auto.expected, torch_pass.expected)
    assert torch.equal(auto.tokens, torch_pass.tokens)


@needs_triton
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled kernels need CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_compiled_kernels_match_torch_pass_on_cuda(dtype):
    """Gemma-like head at a medium size: the kernels (autotuned) against the PyTorch pass on
    the float32 values of the same operands. The vocabulary makes several chunks of the
    kernels' buffers, the last one narrower (its row stride is the buffer's). bfloat16: the
    logits tiles; float32, at a low temperature: ``p`` from cuBLAS's products, summed by
    atomics into an accumulator the autotuner zeroes."""
    from bsloss.functional.triton_fused_head import _vocab_chunk

    g = torch.Generator(device="cuda").manual_seed(0)
    n, d, vocab, c = 1000, 640, 100_000 + 37, 385
    half = dtype == torch.bfloat16
    temperature = 1.0 if half else 0.05
    chunk = _vocab_chunk(n, vocab)
    assert vocab // chunk >= 2 and vocab % chunk  # ragged
    h = torch.randn(n, d, device="cuda", generator=g).to(dtype)
    weight = (torch.randn(vocab, d, device="cuda", generator=g) / math.sqrt(d)).to(dtype)
    table = torch.randn(vocab, c, device="cuda", generator=g)
    targets = torch.randint(0, vocab, (n,), device="cuda", generator=g)
    targets[::7] = -100
    grad_e = torch.randn(n, c, device="cuda", generator=g)
    results = {}
    for backend, (hh, ww) in {
        "triton": (h, weight),
        "torch": (h.float(), weight.float()),
    }.items():
        hh, ww = hh.clone().requires_grad_(), ww.clone().requires_grad_()
        out = fused_expected_inputs(
            hh,
            ww,
            table,
            target_ids=targets,
            softcap=30.0,
            temperature=temperature,
            backend=backend,
        )
        loss = (out.expected * grad_e).sum() + out.log_likelihood.sum()
        results[backend] = (out, torch.autograd.grad(loss, [hh, ww]))
    (kernels, kernel_grads), (reference, reference_grads) = results["triton"], results["torch"]
    assert (kernels.tokens == reference.tokens).float().mean() > 0.999  # near-ties may flip
    if half:
        step = BF16_ROUNDINGS_EXPECTED * 2.0**-9 * float(table.abs().max())
        torch.testing.assert_close(kernels.expected, reference.expected, rtol=0.0, atol=step)
        bound = BF16_ROUNDINGS_GRADIENT * 2.0**-9
    else:
        # what the card adds to the interpreter's float32 cases (which bound the accuracy):
        # the compiled path runs, its p sums neither zeroed by the autotuner nor counted
        # twice (either is off by O(1)); cuBLAS's products of other chunk widths differ in
        # their last bits, which 1 / T = 20 amplifies, hence a loose bound
        bound = 1e-3
        torch.testing.assert_close(kernels.expected, reference.expected, rtol=bound, atol=bound)
    torch.testing.assert_close(kernels.log_likelihood, reference.log_likelihood, **FLOAT32)
    for got, expected in zip(kernel_grads, reference_grads, strict=True):
        atol = bound * float(expected.abs().max())
        torch.testing.assert_close(got.float(), expected, rtol=bound, atol=atol)


@needs_triton
def test_compiled_chunks_follow_the_positions(monkeypatch):
    """The compiled kernels' [N, chunk] buffers: 1/32 of the [N, V] logits, between 1 << 25
    and 1 << 26 elements (32 chunks at Gemma 3's 8 x 1024 positions: the host's launches bound
    the call; 16 at 8 x 256)."""
    from bsloss.functional import triton_fused_head

    monkeypatch.setattr(triton_fused_head, "interpreter_active", lambda: False)
    vocab = 262_144
    assert triton_fused_head._vocab_chunk(16_384, vocab) == 4096  # the ceiling: 1 << 26
    assert triton_fused_head._vocab_chunk(8192, vocab) == 8192  # 1/32 of the logits
    assert triton_fused_head._vocab_chunk(2048, vocab) == 16_384  # the floor: 1 << 25
    assert triton_fused_head._vocab_chunk(256, vocab) == 131_072
    assert triton_fused_head._vocab_chunk(16, 1000) == 1000  # the whole vocabulary
