"""The benchmark harness (``benchmarks/harness.py``): worker processes, the memory meter, the
alternating timer, goals and tables (fast: no model is loaded), and the revisions benchmark's
worker (one model load)."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import harness  # noqa: E402


# ----------------------------------------------------------------------------- worker process
def test_run_isolated_round_trips_a_result_from_another_process():
    assert harness.run_isolated("json:loads", '{"x": [1, 2.5, "a"], "y": null}') == {
        "x": [1, 2.5, "a"],
        "y": None,
    }
    assert harness.run_isolated("os:getpid") != os.getpid()


def test_run_isolated_reports_the_childs_exception_with_its_traceback():
    with pytest.raises(harness.WorkerError) as info:
        harness.run_isolated("math:sqrt", -1.0)
    message = str(info.value)
    assert "math:sqrt" in message
    assert "ValueError" in message and "Traceback" in message


def test_a_child_that_dies_without_answering_is_reported_with_its_exit_code():
    with pytest.raises(harness.WorkerError, match="exited with 3"):
        harness.run_isolated("os:_exit", 3)


def test_worker_keeps_its_state_between_calls_and_survives_an_error():
    with harness.Worker("collections:Counter", "abracadabra") as worker:
        assert worker.call("most_common", 1) == [["a", 5]]
        with pytest.raises(harness.WorkerError, match="AttributeError"):
            worker.call("no_such_method")
        worker.call("update", "zzzzzz")
        assert worker.call("most_common", 1) == [["z", 6]]
    assert worker.process.returncode == 0


def test_target_name_of_a_callable_and_of_a_script_run_as_main(monkeypatch):
    assert harness.target_name(harness.markdown_table) == "benchmarks.harness:markdown_table"
    assert harness.target_name("a.b:c") == "a.b:c"

    class Main:
        __file__ = str(harness.REPO_ROOT / "benchmarks" / "loss_cost.py")

    def session():
        pass

    session.__module__ = "__main__"
    monkeypatch.setitem(sys.modules, "__main__", Main)
    assert harness.target_name(session) == "benchmarks.loss_cost:" + session.__qualname__


# ----------------------------------------------------------------------------- memory meter
def test_memory_meter_reads_positive_rss_and_sees_an_allocation():
    with harness.MemoryMeter() as meter:
        block = bytearray(64 * 2**20)
        block[::4096] = b"\x01" * len(block[::4096])  # touch every page
    del block
    assert meter.rss_before > 0 and meter.peak_rss > 0
    assert meter.peak_rss >= meter.rss_before
    assert meter.method in ("VmHWM after clear_refs", "ru_maxrss")
    if meter.reset_worked:  # a peak since the reset: the 64 MiB block shows
        assert meter.extra_peak >= 48 * 2**20
    readings = meter.as_dict()
    assert readings["rss_before_mb"] > 0 and readings["peak_rss_mb"] > 0
    assert "cuda_peak_mb" not in readings


def test_memory_meter_lifetime_peak_without_reset():
    with harness.MemoryMeter(reset_peak=False) as meter:
        pass
    assert not meter.reset_worked and meter.method == "ru_maxrss"
    assert meter.peak_rss >= meter.rss_before > 0


# ----------------------------------------------------------------------------- alternating timer
def test_alternating_timer_runs_a_b_a_b_and_takes_medians_with_a_fake_clock():
    calls = []
    durations = {"A": iter([3.0, 1.0, 2.0]), "B": iter([10.0, 30.0, 20.0])}
    now = [0.0]

    def clock() -> float:
        return now[0]

    def variant(name: str):
        def run():
            calls.append(name)
            now[0] += next(durations[name])
            return name.lower()

        return run

    timer = harness.AlternatingTimer(3, clock=clock, prepare=lambda: None, report=None)
    series = timer.run({"A": variant("A"), "B": variant("B")})
    assert calls == ["A", "B", "A", "B", "A", "B"]
    assert series["A"].seconds == [3.0, 1.0, 2.0]
    assert series["B"].seconds == [10.0, 30.0, 20.0]
    assert series["A"].values == ["a", "a", "a"]
    assert series["A"].median() == 2.0 and series["B"].median() == 20.0
    assert harness.ratio_range(series["B"].seconds, series["A"].seconds) == (10 / 3, 30.0)


def test_series_median_of_a_value_measured_by_the_call():
    series = harness.Series(seconds=[9.0, 9.0, 9.0], values=[{"s": 1}, {"s": 5}, {"s": 2}])
    assert series.median(key=lambda v: v["s"]) == 2


def test_alternating_timer_reports_each_call():
    lines = []
    timer = harness.AlternatingTimer(2, "[x]", prepare=lambda: None, report=lines.append)
    timer.run({"A": lambda: None})
    assert [line.split(":")[0] for line in lines] == ["[x] round 1/2 A", "[x] round 2/2 A"]


# ----------------------------------------------------------------------------- goals and report
def test_goal_rows_say_met_or_not_met_in_either_direction():
    at_most = harness.Goal("time ratio", 1.2, "<=")
    at_least = harness.Goal("speed-up", 10, ">=")
    assert at_most.row(1.2)["result"] == "met" and at_most.row(1.21)["result"] == "NOT met"
    assert at_least.row(10.0)["result"] == "met" and at_least.row(4.5)["result"] == "NOT met"
    row = at_least.row(4.5, size="8x128")
    assert row == {
        "goal": "speed-up",
        "size": "8x128",
        "ratio": 4.5,
        "target": "≥ 10",
        "pass": False,
        "result": "NOT met",
    }
    assert at_most.target == "≤ 1.2"
    with pytest.raises(ValueError, match="direction"):
        harness.Goal("bad", 1.0, "<")


def test_markdown_table_aligns_columns():
    table = harness.markdown_table(["a", "b", "c"], [(1, "x", 2.5)], "lr")
    assert table.splitlines() == ["| a | b | c |", "|---|---:|---|", "| 1 | x | 2.5 |"]


def test_header_lines_name_command_cpu_load_versions_and_commit():
    env = {
        "command": "python benchmarks/x.py --quick",
        "date": "2026-01-01 00:00",
        "cpu": "Some CPU",
        "logical_cpus": 2,
        "torch_threads": 2,
        "load_average": [1.0, 2.5, 3.0],
        "git": "abc1234",
        "versions": {"python": "3.11", "torch": "2.0"},
    }
    text = "\n".join(harness.header_lines(env, "torch default"))
    assert "`python benchmarks/x.py --quick`" in text
    assert "Some CPU (2 logical CPUs); torch threads: 2 (torch default)" in text
    assert "1.0, 2.5, 3.0" in text
    assert "python 3.11, torch 2.0; git abc1234" in text


def test_environment_records_the_run():
    env = harness.environment(extra="1.0")
    assert env["versions"]["extra"] == "1.0" and env["versions"]["torch"]
    assert env["cpu"] and env["command"] and env["git"]
    assert len(env["load_average"]) == 3


# ----------------------------------------------------------------------------- revisions.py
def test_revisions_worker_imports_bsloss_from_its_tree_and_refuses_another(tmp_path, stsb_dev):
    """``benchmarks/revisions.py``'s worker scores with the tree it is given (here this one:
    a finite loss), and refuses to measure when bsloss would come from elsewhere (an empty
    folder holds no bsloss). It scores the STS-B dev pairs: skipped where they are not."""
    with harness.Worker("benchmarks.revisions:TreeScoring", str(harness.REPO_ROOT), 1) as worker:
        value = worker.call("loss")
    assert 0.0 < value < 1.0
    elsewhere = harness.Worker("benchmarks.revisions:TreeScoring", str(tmp_path), 1)
    with elsewhere, pytest.raises(harness.WorkerError, match="not from"):
        elsewhere.ready()


def test_revisions_narrow_scorer_is_a_loadable_scorer_of_minilms_vocabulary(tmp_path):
    """``revisions.py --narrow``: a 32-wide random BERT that both trees can load by folder, with
    MiniLM's tokenizer and vocabulary."""
    import torch

    import bsloss
    from benchmarks.revisions import narrow_scorer

    scorer = bsloss.BERTScorer(narrow_scorer(tmp_path), 6, device="cpu")
    assert scorer.encoder.model.config.hidden_size == 32
    assert scorer.vocab_size == 30_522
    P, R, F = scorer.score(["a cat sat"], ["the cat sat down"], progress=False)
    assert F.shape == (1,) and 0.0 < float(F[0]) <= 1.0
    again = bsloss.BERTScorer(narrow_scorer(tmp_path), 6, device="cpu")  # written over itself
    assert torch.equal(again.score(["a cat sat"], ["the cat sat down"], progress=False)[2], F)


def test_torch_pass_revisions_counts_a_chunks_operations_in_its_tree(tmp_path):
    """``benchmarks/torch_pass_revisions.py``'s worker: the PyTorch pass cut into the chunks
    asked for (more operations at more chunks, the policy restored after), finite values with
    gradients for every call, and a refusal where bsloss would come from elsewhere."""
    from benchmarks.torch_pass_revisions import CALLS, largest_difference

    tree = str(harness.REPO_ROOT)
    with harness.Worker("benchmarks.torch_pass_revisions:TreePass", tree, 8, 4, 4, 8, 3, 1) as w:
        for name in CALLS:
            counts = w.call("count", name)
            assert counts["full"] > counts["half"] > 0, (name, counts)
            result = w.call("results", name)
            assert math.isfinite(result["value"]) and any(result["grad_w"]), name
            assert largest_difference(result, result) == 0.0
        assert math.isfinite(w.call("call", "CE + term"))
    elsewhere = harness.Worker(
        "benchmarks.torch_pass_revisions:TreePass", str(tmp_path), 8, 4, 4, 8, 3, 1
    )
    with elsewhere, pytest.raises(harness.WorkerError, match="not from"):
        elsewhere.ready()


def test_fused_memory_measures_the_fused_pass_with_cudas_chunk_shape():
    """``benchmarks/fused_memory.py`` at a small size: CUDA's chunk policy (all the rows; a
    64 MiB chunk holds this whole vocabulary), finite CE and term, a non-negative peak."""
    from benchmarks.fused_memory import measure

    result = measure(2, 8, vocab=4096, dim=64)
    assert result["chunk_shape"] == [16, 4096]
    assert result["peak_extra_mib"] >= 0
    assert 0 < result["cross_entropy"] < 20 and 0 < result["term"] < 1


def test_launch_counter_counts_kernels_not_views():
    """``benchmarks/launches.py``'s counter: a product and a sum launch, a view and an
    unsqueeze do not."""
    import torch

    from benchmarks.launches import LaunchCounter

    x = torch.ones(4, 4)
    with LaunchCounter() as counter:
        (x @ x).view(16).unsqueeze(0).sum()
    assert sum(counter.by_caller.values()) == 2
    assert set(counter.by_caller) == {"autograd engine or caller"}  # no bsloss frame called them


def test_head_ce_launches_cuts_the_vocabulary_as_a_card_would():
    """``benchmarks/head_ce_launches.py`` (its own process: it switches Triton's interpreter on
    before triton's import): each backend's fused CE cut into CUDA's chunk count at the Gemma
    step's sizes, one backward kernel a chunk for the Triton pass, and more dispatcher
    operations for a chunked pass than for the dense CE."""
    import re
    import subprocess

    from bsloss.functional.triton_fused_head import interpreter_problem

    if (problem := interpreter_problem()) is not None:
        pytest.skip(problem)
    repo = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "benchmarks/head_ce_launches.py"],
        cwd=repo,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    chunks = re.search(r"PyTorch pass (\d+), Triton kernels (\d+)", done.stdout)
    assert chunks is not None, done.stdout
    torch_chunks, triton_chunks = map(int, chunks.groups())
    assert torch_chunks > 1 and triton_chunks > 1  # 262,144 tokens do not fit one chunk
    rows = {
        cells[1]: [int(c) for c in cells[2:5]]
        for line in done.stdout.splitlines()
        if line.startswith("| ") and (cells := [c.strip() for c in line.split("|")])[2].isdigit()
    }
    dense = rows["dense CE on the logits (the model's own head and loss)"]
    torch_pass = rows[f"fused CE, PyTorch pass, {torch_chunks} chunks"]
    kernels = rows[f"fused CE, Triton kernels, {triton_chunks} chunks"]
    assert kernels[1] == triton_chunks + 1  # the statistics kernel, then one per chunk
    assert dense[0] < kernels[0] < torch_pass[0] and torch_pass[1] == 0


@pytest.mark.parametrize("script", ["launches.py", "head_ce_launches.py", "fused_head_profile.py"])
def test_a_benchmark_scripts_help_prints_usage_and_runs_nothing(script):
    """``--help`` (or a mistyped flag) ran the whole benchmark of the two launch counters (13 s
    and 6 s); it prints the usage now, and a mistyped flag is an error."""
    import subprocess

    path = Path(__file__).resolve().parents[1] / "benchmarks" / script
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    shown = subprocess.run([sys.executable, str(path), "--help"], capture_output=True, text=True,
                           env=env, timeout=60)  # fmt: skip
    assert shown.returncode == 0 and shown.stdout.startswith("usage:"), shown.stderr[-500:]
    assert "|" not in shown.stdout  # no table: nothing measured
    wrong = subprocess.run([sys.executable, str(path), "--no-such-flag"], capture_output=True,
                           text=True, env=env, timeout=60)  # fmt: skip
    assert wrong.returncode == 2 and "error:" in wrong.stderr
