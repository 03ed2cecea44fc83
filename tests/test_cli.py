"""The `bsloss` command: score and baseline."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

import bsloss
from bsloss.baseline import read_baseline
from bsloss.cli import main

EXAMPLES = Path(bsloss.__file__).parent / "examples"


def test_score_prints_signature_corpus_and_per_line(capsys):
    main(
        [
            "score",
            "-c",
            str(EXAMPLES / "candidates.txt"),
            "-r",
            str(EXAMPLES / "references.txt"),
            "--per-line",
            "--rescale",
            "--progress",
            "off",
        ]
    )
    out = capsys.readouterr().out.strip().splitlines()
    cands = (EXAMPLES / "candidates.txt").read_text().splitlines()
    refs = (EXAMPLES / "references.txt").read_text().splitlines()
    assert out[0] == "P\tR\tF" and len(out) == len(cands) + 2
    P, R, F = bsloss.BERTScorer(rescale_with_baseline=True).score(cands, refs)
    first = [float(x) for x in out[1].split("\t")]
    assert abs(first[2] - F[0].item()) < 1e-5
    assert "all-MiniLM-L6-v2_L6_no-idf" in out[-1] and "-rescaled" in out[-1]
    assert f"F1: {F.mean():.6f}" in out[-1]


def test_score_multiple_reference_files(tmp_path, capsys):
    cands = tmp_path / "c.txt"
    cands.write_text("a cat sat on the mat\nhello world\n")
    (tmp_path / "r1.txt").write_text("a cat sat on the mat\ngoodbye\n")
    (tmp_path / "r2.txt").write_text("the dog barked\nhello world\n")
    main(
        [
            "score",
            "-c",
            str(cands),
            "-r",
            str(tmp_path / "r1.txt"),
            str(tmp_path / "r2.txt"),
            "--per-line",
            "--progress",
            "off",
        ]
    )
    lines = capsys.readouterr().out.strip().splitlines()
    assert [float(line.split("\t")[2]) for line in lines[1:3]] == [1.0, 1.0]


def test_baseline_command_writes_bert_score_format(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(f"sentence number {i} is about topic {i % 7}" for i in range(50)))
    out = tmp_path / "baseline.tsv"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "bsloss",
            "baseline",
            "--corpus",
            str(corpus),
            "-o",
            str(out),
            "--num-pairs",
            "20",
            "--progress",
            "off",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "layers 0..6" in result.stdout
    assert out.read_text().splitlines()[0] == "LAYER,P,R,F"
    assert len(out.read_text().splitlines()) == 8
    baseline = read_baseline(out, 6)
    assert torch.all(baseline < 1) and torch.all(baseline > -1)


def test_a_text_given_to_c_is_told_that_c_takes_a_file(capsys):
    """bert-score's -c also takes one sentence; bsloss's takes a file, and says so."""
    status = main(["score", "-c", "a cat sat on the mat", "-r", str(EXAMPLES / "references.txt")])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1, err
    assert (
        "-c/--candidates expects a file of candidate lines, one per line; "
        "got 'a cat sat on the mat', which is not a file"
    ) in err[0]


def test_a_layer_out_of_range_is_named_by_its_flag(capsys):
    """`-l 99` on a 6-layer scorer: the error names -l/--num_layers, the flag the user typed."""
    lines = str(EXAMPLES / "references.txt")
    status = main(["score", "-c", lines, "-r", lines, "-l", "99"])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1, err
    assert err[0].startswith("bsloss: error: -l/--num_layers must be between 0 and 6"), err[0]
    assert "got 99" in err[0]
