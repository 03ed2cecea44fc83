"""Every ``>>>`` example in the bsloss package runs (doctest), and every public entry point has
one, with Args, Returns and Raises sections where it takes arguments."""

from __future__ import annotations

import doctest
import importlib
import inspect
import pkgutil

import pytest

import bsloss
import bsloss.integrations.huggingface as hf


def _modules() -> list[str]:
    names = ["bsloss"]
    for info in pkgutil.walk_packages(bsloss.__path__, "bsloss."):
        if not info.name.endswith("__main__"):  # importing it runs the command line
            names.append(info.name)
    return sorted(names)


def _examples() -> list[doctest.DocTest]:
    finder = doctest.DocTestFinder(exclude_empty=True)
    tests = []
    for name in _modules():
        module = importlib.import_module(name)
        tests += [t for t in finder.find(module, name) if t.examples]
    return sorted({t.name: t for t in tests}.values(), key=lambda t: t.name)


EXAMPLES = _examples()


@pytest.mark.parametrize("test", EXAMPLES, ids=[t.name for t in EXAMPLES])
def test_docstring_example(test):
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{test.name}: {result.failed} of {result.attempted} failed"


ENTRY_POINTS = [
    bsloss.score,
    bsloss.BERTScorer,
    bsloss.BERTScorer.score,
    bsloss.BERTScoreLoss,
    bsloss.BERTScoreReward,
    bsloss.VocabularyBridge,
    bsloss.plot_example,
    hf.BERTScoreTerm,
    hf.bertscore_compute_metrics,
]


@pytest.mark.parametrize("entry", ENTRY_POINTS, ids=lambda e: e.__qualname__)
def test_public_entry_points_are_documented(entry):
    doc = inspect.getdoc(entry) or ""
    missing = [part for part in (">>>", "Args:", "Raises:") if part not in doc]
    if not inspect.isclass(entry):
        missing += [] if "Returns:" in doc else ["Returns:"]
    assert not missing, f"{entry.__qualname__} lacks {missing}"
    assert any(t.name.endswith(entry.__qualname__) for t in EXAMPLES)
