"""The recipes end to end on tiny settings: 2-step smoke runs, resume after an interruption, a
random T5 generator through the vocabulary bridge, and batch centering over 2 processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SUMMARIZATION = REPO / "recipes/configs/xsum-bert2bert.yaml"
TRANSLATION = REPO / "recipes/configs/bible-es-en-bert2bert.yaml"
TINY = [
    "--set", "data.max_train=8",
    "--set", "data.max_validation=2",
    "--set", "data.max_test=2",
    "--set", "data.max_source_length=48",
    "--set", "data.max_target_length=12",
    "--set", "eval.max_new_tokens=6",
    "--set", "train.batch_size=2",
    "--set", "train.steps=2",
    "--set", "train.eval_every=2",
    "--set", "train.save_every=0",
    "--set", "train.lr_warmup_steps=0",
]  # fmt: skip
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}

pytest.importorskip("rouge_score")
pytest.importorskip("sacrebleu")


def run_recipe(
    script: str, *args: str, timeout: int = 300, expect_failure: bool = False
) -> subprocess.CompletedProcess:
    """Run ``recipes/<script>`` in a fresh process; it must succeed (or, with
    ``expect_failure``, fail)."""
    command = [sys.executable, str(REPO / "recipes" / script), *map(str, args)]
    done = subprocess.run(
        command, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=timeout
    )
    assert (done.returncode != 0) == expect_failure, done.stderr[-4000:]
    return done


def read_log(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "log.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(
    ("config", "matching", "candidates"),
    [(SUMMARIZATION, "hard", "teacher_forced"), (TRANSLATION, "softmax", "greedy")],
)
def test_finetune_two_steps(tmp_path, config, matching, candidates):
    out = tmp_path / "run"
    done = run_recipe(
        "finetune.py", "--config", config, "--output_dir", out, *TINY,
        "--set", "loss.weight=1.0", "--set", f"loss.matching={matching}",
        "--set", f"loss.candidates={candidates}",
    )  # fmt: skip
    log = read_log(out)
    train = [e for e in log if e["kind"] == "train"]
    assert [e["step"] for e in train] == [1, 2]
    for entry in train:
        assert 0.0 < entry["bertscore_loss"] <= 2.0
        assert entry["loss"] == pytest.approx(entry["ce"] + entry["bertscore_loss"], rel=1e-5)
    evals = [e for e in log if e["kind"] == "eval"]
    assert {e["split"] for e in evals} == {"test", "validation"}
    metric = "rougeL" if config == SUMMARIZATION else "bleu"
    assert all(metric in e and 0.0 <= e["f_bert"] <= 1.0 for e in evals)
    results = json.loads((out / "results.json").read_text())
    assert set(results) >= {"before", "after", "steps", "seed", "train_seconds"}
    assert (out / "curves.png").stat().st_size > 10_000
    assert (out / "model/config.json").exists()
    assert "| f_bert |" in done.stdout


def test_loss_weight_zero_is_cross_entropy_only(tmp_path):
    out = tmp_path / "ce"
    run_recipe("finetune.py", "--config", SUMMARIZATION, "--output_dir", out, *TINY,
               "--set", "eval.before=false")  # fmt: skip
    train = [e for e in read_log(out) if e["kind"] == "train"]
    assert all("bertscore_loss" not in e and e["loss"] == e["ce"] for e in train)


@pytest.mark.parametrize("script", ["finetune.py", "rl_scst.py"])
def test_resume_loses_only_the_steps_since_the_checkpoint(script, tmp_path):
    """4 steps straight vs. interrupted after step 3 (checkpoint at 2) then --resume: the resumed
    run restarts at step 3 and ends with the same log and the same weights (for SCST the same
    sampled answers too: the trainer's checkpoint holds the RNG states)."""
    # the BERTScore term for finetune.py (rl_scst.py refuses finetune.py's loss.weight)
    term = ["--set", "loss.weight=0.5"] if script == "finetune.py" else []
    settings = [
        "--config", SUMMARIZATION, *TINY, "--set", "train.steps=4", "--set", "train.save_every=2",
        "--set", "train.eval_every=0", "--set", "eval.before=false", *term,
    ]  # fmt: skip
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    run_recipe(script, *settings, "--output_dir", straight)
    done = run_recipe(script, *settings, "--output_dir", interrupted, "--stop_after", "3")
    assert "stopped after step 3" in done.stdout
    assert not (interrupted / "model").exists()
    assert [e["step"] for e in read_log(interrupted) if e["kind"] == "train"] == [1, 2, 3]
    run_recipe(script, *settings, "--output_dir", interrupted, "--resume")
    resumed = [e for e in read_log(interrupted) if e["kind"] == "train"]
    reference = [e for e in read_log(straight) if e["kind"] == "train"]
    assert [e["step"] for e in resumed] == [1, 2, 3, 4]  # step 3 redone once, not logged twice
    for a, b in zip(resumed, reference, strict=True):
        assert a.keys() == b.keys()
        for key in ("loss", "reward", "greedy_reward"):
            if key in b:
                assert a[key] == pytest.approx(b[key], abs=1e-5), key
    from safetensors.torch import load_file

    weights_a = load_file(straight / "model/model.safetensors")
    weights_b = load_file(interrupted / "model/model.safetensors")
    assert weights_a.keys() == weights_b.keys()
    assert max(float((weights_a[k] - weights_b[k]).abs().max()) for k in weights_a) < 1e-5


def test_checkpoints_rotate_and_resume_continues_their_numbering(tmp_path):
    out = tmp_path / "run"
    settings = [
        "--config", SUMMARIZATION, *TINY, "--set", "train.save_every=1",
        "--set", "eval.before=false", "--set", "train.checkpoints_total_limit=2",
        "--output_dir", out,
    ]  # fmt: skip
    run_recipe("finetune.py", *settings, "--set", "train.steps=3", "--stop_after", "3")
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    # the trainer's checkpoints, named by step: step 1's was rotated out
    assert names == ["checkpoint-2", "checkpoint-3"]
    run_recipe("finetune.py", *settings, "--set", "train.steps=4", "--resume")
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert names == ["checkpoint-3", "checkpoint-4"]
    assert [e["step"] for e in read_log(out) if e["kind"] == "train"] == [1, 2, 3, 4]
    # the run's settings are kept; a resume may train longer, not with another seed (it went
    # on with both, and a new learning rate was dropped unsaid; audit h32)
    started = json.loads((out / "run_config.json").read_text())
    assert started["settings"]["train.steps"] == 3 and started["script"] == "finetune.py"
    assert "started_with" in json.loads((out / "results.json").read_text())
    refused = run_recipe("finetune.py", *settings, "--set", "train.steps=5", "--set",
                         "train.seed=7", "--resume", expect_failure=True)  # fmt: skip
    assert "train.seed 0 -> 7" in refused.stderr


class _RunsCode:
    """A pickle that runs code when it is unpickled (writes the file it names)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "CODE RAN"))


def test_resume_refuses_a_checkpoint_that_would_run_code(tmp_path):
    """--resume reads the trainer's optimizer, scheduler and RNG files with
    torch.load(weights_only=True): a tampered one is refused, and its code never runs."""
    out, marker = tmp_path / "run", tmp_path / "marker.txt"
    settings = [
        "--config", SUMMARIZATION, *TINY, "--set", "train.save_every=1", "--set",
        "train.eval_every=0", "--set", "eval.before=false", "--output_dir", out,
    ]  # fmt: skip
    run_recipe("finetune.py", *settings, "--stop_after", "1")
    torch.save(_RunsCode(marker), out / "checkpoints/checkpoint-1/rng_state.pth")
    done = run_recipe("finetune.py", *settings, "--resume", expect_failure=True)
    assert "UnpicklingError" in done.stderr or "Weights only load failed" in done.stderr
    assert not marker.exists()


def test_rl_scst_two_steps(tmp_path):
    out = tmp_path / "scst"
    run_recipe("rl_scst.py", "--config", SUMMARIZATION, "--output_dir", out, *TINY,
               "--set", "eval.before=false")  # fmt: skip
    train = [e for e in read_log(out) if e["kind"] == "train"]
    assert [e["step"] for e in train] == [1, 2]
    assert all(0.0 <= e["reward"] <= 1.0 and 0.0 <= e["greedy_reward"] <= 1.0 for e in train)
    assert (out / "model/config.json").exists()


def test_random_t5_generator_through_the_bridge(tmp_path):
    """A T5 built from a config with a tokenizer trained on Brown sentences: its vocabulary is
    not the scorer's, so the loss goes through a VocabularyBridge."""
    from _tokenizers import brown_lines, train_sentencepiece_bpe

    tokenizer = train_sentencepiece_bpe(brown_lines(3000), tmp_path / "raw", vocab_size=2000)
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    config = tmp_path / "t5.yaml"
    config.write_text(
        SUMMARIZATION.read_text().replace(
            "generator_config: null",
            "generator_config: {model_type: t5, d_model: 64, d_ff: 128, num_layers: 2, "
            "num_heads: 2, d_kv: 32}",
        )
    )
    out = tmp_path / "t5run"
    run_recipe(
        "finetune.py", "--config", config, "--output_dir", out, *TINY,
        "--set", f"model.tokenizer={tmp_path / 'tokenizer'}", "--set", "loss.weight=1.0",
        "--set", "loss.top_k=16",
    )  # fmt: skip
    log = read_log(out)
    setup = next(e for e in log if e["kind"] == "setup")
    assert setup["generator"] == "T5ForConditionalGeneration"
    assert setup["bridge"] is not None and 0.3 < setup["bridge"]["single_piece_share"] < 1.0
    train = [e for e in log if e["kind"] == "train"]
    assert all(0.0 < e["bertscore_loss"] <= 2.0 for e in train)


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed missing")
def test_two_processes_center_with_the_global_batch_mean(tmp_path):
    command = [
        # accelerate's own --cpu starts one process without MPI; --multi_gpu starts torchrun,
        # and the recipe's --cpu makes each process a gloo CPU worker
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        "--num_cpu_threads_per_process", "1",
        str(REPO / "tests/_distributed_centering.py"), str(tmp_path), "--",
        "--config", str(SUMMARIZATION), "--output_dir", str(tmp_path / "run"), "--cpu", *TINY,
        "--set", "loss.weight=1.0", "--set", "loss.center=true", "--set", "train.eval_every=0",
        "--set", "eval.before=false",
    ]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-4000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for result in results:
        assert result["world_size"] == 2
        assert result["calls"] == 4  # 2 steps x (candidates, references)
        # 2 steps x 2 processes x 2 rows: each step brings both processes new examples of the
        # 8 (the list of batches was one process's: step 2 repeated step 1, 4 distinct rows)
        assert result["rows_trained"] == 8
        assert result["distinct_rows_trained"] == 8
        assert result["max_error_vs_global_mean"] < 1e-5
        assert result["min_gap_to_local_mean"] > 1e-4  # the local mean would differ


def test_loss_section_goes_straight_to_the_loss(scorer):
    from config import load_config
    from finetune import build_loss

    config = load_config(SUMMARIZATION, ["loss.matching=sinkhorn", "loss.temperature=0.2"])
    loss = build_loss(config, scorer.encoder, scorer.encoder.tokenizer)
    assert repr(loss.matching) == "Sinkhorn(temperature=0.2, iterations=1)"
    config.loss["temprature"] = 0.1  # a misspelt keyword is named, not ignored
    with pytest.raises(ValueError, match=r"config loss: unknown key\(s\) \['temprature'\]"):
        build_loss(config, scorer.encoder, scorer.encoder.tokenizer)
