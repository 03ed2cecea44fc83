"""The `bsloss` command: score, baseline and plot, and its user errors (one line, exit 2)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import bsloss
from bsloss.baseline import read_baseline
from bsloss.cli import build_parser, main

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


def run_cli(argv, capsys):
    status = main(argv)
    captured = capsys.readouterr()
    return status, captured.err.strip().splitlines(), captured.out


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cli")
    (folder / "c.txt").write_text("a cat sat\na dog ran\n")
    (folder / "r.txt").write_text("the cat sat\nthe dog ran\n")
    (folder / "one.txt").write_text("only one sentence here\n")
    (folder / "empty.txt").write_text("")
    (folder / "latin1.txt").write_bytes("café au lait\n".encode("latin-1"))
    (folder / "dir").mkdir()
    return folder


def cli_cases(f):
    """(argv, the text the one error line must contain) for each user error."""
    score = ["score", "--progress", "off"]
    ok = ["-c", str(f / "c.txt"), "-r", str(f / "r.txt")]
    return {
        "missing-candidates": (
            [*score, "-c", str(f / "nope.txt"), "-r", str(f / "r.txt")],
            "--candidates",
        ),
        "missing-references": (
            [*score, "-c", str(f / "c.txt"), "-r", str(f / "nope.txt")],
            "--references",
        ),
        "invalid-utf8": (
            [*score, "-c", str(f / "latin1.txt"), "-r", str(f / "one.txt")],
            "not UTF-8",
        ),
        "directory-input": ([*score, "-c", str(f / "dir"), "-r", str(f / "r.txt")], "directory"),
        "num-layers-too-big": ([*score, *ok, "--num-layers", "99"], "num_layers"),
        "device-cuda": ([*score, *ok, "--device", "cuda:99"], "cuda:99"),
        "device-unknown": ([*score, *ok, "--device", "gpu"], "'gpu'"),
        "bad-model": (
            [*score, *ok, "--model", str(f / "no-model"), "--num-layers", "2"],
            "no-model",
        ),
        "missing-baseline-path": (
            [*score, *ok, "--rescale", "--baseline-path", str(f / "nope.tsv")],
            "nope.tsv",
        ),
        "two-stdin": ([*score, "-c", "-", "-r", "-"], "standard input"),
        "empty-files": ([*score, "-c", str(f / "empty.txt"), "-r", str(f / "empty.txt")], "empty"),
        "line-counts": ([*score, "-c", str(f / "c.txt"), "-r", str(f / "one.txt")], "2 lines"),
        "baseline-one-sentence": (
            ["baseline", "--corpus", str(f / "one.txt"), "-o", str(f / "b.csv")],
            "at least two",
        ),
        "baseline-output-directory": (
            ["baseline", "--corpus", str(f / "c.txt"), "-o", str(f / "dir")],
            "directory",
        ),
        # audit h29: -o under a file failed after the whole computation, naming no flag
        "baseline-output-under-a-file": (
            ["baseline", "--corpus", str(f / "c.txt"), "-o", str(f / "c.txt" / "b.csv")],
            "-o " + str(f / "c.txt" / "b.csv") + ": its folder cannot be made",
        ),
        # audit h29: a bare "'utf-8' codec can't decode byte 0xe9", no file named
        "baseline-file-not-utf8": (
            [*score, *ok, "--rescale", "--baseline-path", str(f / "latin1.txt")],
            "baseline file " + str(f / "latin1.txt") + " is not UTF-8 text",
        ),
        "baseline-missing-corpus": (
            ["baseline", "--corpus", str(f / "nope.txt"), "-o", str(f / "b.csv")],
            "--corpus",
        ),
        "plot-output-directory": (
            ["plot", "-c", "a", "-r", "b", "-o", str(f / "dir")],
            "directory",
        ),
        "plot-unknown-extension": (
            ["plot", "-c", "a", "-r", "b", "-o", str(f / "x.docx")],
            "cannot write .docx",
        ),
    }


CLI_CASES = list(cli_cases(Path("unused")))


@pytest.mark.parametrize("case", CLI_CASES)
def test_rc11_cli_user_error_is_one_line_and_exit_2(files, capsys, case):
    if case.startswith("plot"):
        pytest.importorskip("matplotlib")
    argv, text = cli_cases(files)[case]
    status, err, out = run_cli(argv, capsys)
    assert status == 2, (status, err)
    assert len(err) == 1 and err[0].startswith("bsloss: error: "), err
    assert text in err[0], err
    assert "Traceback" not in err[0] and out == ""


@pytest.mark.parametrize(
    "argv, option",
    [
        (["score", "-c", "c", "-r", "r", "--batch-size", "0"], "--batch-size"),
        (["score", "-c", "c", "-r", "r", "--num-layers", "-1"], "--num-layers"),
        (["baseline", "--corpus", "c", "-o", "o", "--num-pairs", "0"], "--num-pairs"),
        (["plot", "-c", "a", "-r", "b", "-o", "o.png", "--temperature", "0"], "--temperature"),
    ],
    ids=["batch-size-0", "num-layers-negative", "rc13-num-pairs-0", "rc14-temperature-0"],
)
def test_rc11_cli_bad_numbers_are_argparse_errors(capsys, argv, option):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option}" in err and "Traceback" not in err


@pytest.mark.parametrize("option", [["--batch-size", "8"], ["--progress", "on"]])
def test_plot_takes_no_options_it_would_ignore(capsys, option):
    """``bsloss plot`` scores one pair: it had ``--batch-size`` and ``--progress`` from the
    options it shares with ``score`` and ``baseline`` and did nothing with them. Now an argparse
    error names the option; ``score`` and ``baseline`` keep both."""
    with pytest.raises(SystemExit) as exit_info:
        main(["plot", "-c", "a", "-r", "b", "-o", "o.png", *option])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments" in err and option[0] in err and "Traceback" not in err
    for command in (["score", "-c", "c", "-r", "r"], ["baseline", "--corpus", "c", "-o", "o"]):
        args = build_parser().parse_args([*command, *option])
        assert str(getattr(args, option[0][2:].replace("-", "_"))) == option[1]


def test_plot_takes_bert_score_shows_rescaling_flags(tmp_path, capsys, monkeypatch):
    """``bert-score-show`` takes ``--rescale_with_baseline``, ``--baseline_path`` and ``-v``;
    ``bsloss plot`` refused them as unrecognized (audit h29). The scorer it draws with now
    rescales with the baseline given."""
    import bsloss.plot

    drawn = []
    monkeypatch.setattr(bsloss.plot, "draw_pair", lambda scorer, *rest: drawn.append(scorer))
    baseline = tmp_path / "baseline.csv"
    rows = "".join(f"{layer},0.8{layer},0.7{layer},0.75\n" for layer in range(7))
    baseline.write_text("LAYER,P,R,F\n" + rows)
    plot = ["plot", "-c", "the cat sat", "-r", "a cat sat", "-f", str(tmp_path / "x.png")]
    flags = ["--rescale_with_baseline", "--baseline_path", str(baseline), "-v"]
    assert main([*plot, *flags]) == 0, capsys.readouterr().err
    assert main(plot) == 0
    rescaled, plain = drawn
    assert rescaled.baseline.tolist() == [0.86, 0.76, 0.75] and plain.baseline is None


def test_rc12_cli_empty_files_do_not_print_nan(files, capsys):
    status, err, out = run_cli(
        ["score", "-c", str(files / "empty.txt"), "-r", str(files / "empty.txt")], capsys
    )
    assert status == 2 and "nan" not in out.lower() and "empty" in err[0]


def test_rc11_cli_debug_shows_the_traceback(files):
    with pytest.raises(ValueError, match="does not exist"):
        main(["--debug", "score", "-c", str(files / "nope.txt"), "-r", str(files / "r.txt")])
    with pytest.raises(ValueError, match="does not exist"):
        main(["score", "-c", str(files / "nope.txt"), "-r", str(files / "r.txt"), "--debug"])


def test_rc11_cli_reads_standard_input(files, capsys, monkeypatch):
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("a cat sat\na dog ran\n"))
    status, err, out = run_cli(
        ["score", "-c", "-", "-r", str(files / "r.txt"), "--progress", "off"], capsys
    )
    from_files = run_cli(
        ["score", "-c", str(files / "c.txt"), "-r", str(files / "r.txt"), "--progress", "off"],
        capsys,
    )
    assert status == 0 and out == from_files[2] and "F1:" in out


def test_standard_input_that_is_not_utf8_is_named_as_a_file_is(files, capsys, monkeypatch):
    """Audit h29: Latin-1 bytes on standard input came through as lone surrogates and were
    refused as ``cands[0] is not valid Unicode``, where a file says it is not UTF-8."""
    import io

    stdin = io.TextIOWrapper(io.BytesIO("café au lait\n".encode("latin-1")))
    monkeypatch.setattr("sys.stdin", stdin)
    status, err, _ = run_cli(["score", "-c", "-", "-r", str(files / "one.txt")], capsys)
    assert status == 2 and len(err) == 1, err
    assert "-c/--candidates - (standard input) is not UTF-8 text" in err[0], err[0]
    crlf = io.TextIOWrapper(io.BytesIO(b"a cat sat\r\na dog ran\r\n"))
    monkeypatch.setattr("sys.stdin", crlf)
    status, _, out = run_cli(
        ["score", "-c", "-", "-r", str(files / "r.txt"), "--progress", "off"], capsys
    )
    from_file = run_cli(
        ["score", "-c", str(files / "c.txt"), "-r", str(files / "r.txt"), "--progress", "off"],
        capsys,
    )
    assert status == 0 and out == from_file[2]


def test_a_warning_prints_as_the_command_lines(files, tmp_path, capsys):
    """The empty-line warning printed as Python's (``<frozen runpy>:88: UserWarning: ...``, or
    the launcher's ``bin/bsloss:8`` with its source line ``sys.exit(main())``)."""
    cands = tmp_path / "blank.txt"
    cands.write_text("a cat sat\n\n")
    status, err, out = run_cli(
        ["score", "-c", str(cands), "-r", str(files / "r.txt"), "--progress", "off"], capsys
    )
    assert status == 0 and "F1" in out
    assert err == [
        "bsloss: warning: 1 empty or whitespace-only candidate/reference pair(s) (or a text "
        "with nothing the tokenizer keeps, such as a zero-width space) score 0: candidate index 1"
    ], err
