"""The study's arms (``arms.yaml``) as command lines, for ``harness.py`` and the tests.

An arm is a mapping of ``--set`` overrides of the stage-2 config, plus two optional keys of its
own: ``script`` (default ``recipes/finetune.py``) and ``config`` (default: the driver's).

    python recipes/study/arms.py names recipes/study/arms.yaml         # the arms, in order
    python recipes/study/arms.py args recipes/study/arms.yaml ce C.yaml  # SCRIPT --config ...
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

DEFAULT_SCRIPT = "recipes/finetune.py"
OWN_KEYS = ("script", "config")  # an arm's keys that are not --set overrides


def load_arms(path: Path) -> dict[str, dict]:
    """The arms of ``path``, each a mapping; refuses a value that would not survive the shell
    (a space in it) and an arm that is not a mapping, naming the arm."""
    arms = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    for name, arm in arms.items():
        if not isinstance(arm, dict):
            raise ValueError(f"{path}: arm {name!r} must be a mapping of overrides, got {arm!r}")
        for key, value in arm.items():
            if " " in override_value(value):
                raise ValueError(f"{path}: arm {name!r}, {key}: a value with a space: {value!r}")
    return arms


def override_value(value) -> str:
    """A YAML value as ``--set`` writes it (the recipe parses it back as YAML)."""
    return yaml.safe_dump(value).splitlines()[0]


def overrides(arm: dict) -> list[str]:
    """The arm's ``KEY=VALUE`` overrides (its own keys left out)."""
    return [f"{k}={override_value(v)}" for k, v in arm.items() if k not in OWN_KEYS]


def command(arm: dict, default_config: str) -> list[str]:
    """``SCRIPT --config CONFIG --set KEY=VALUE ...``: what the driver runs for the arm (its
    own ``config``, else ``default_config``)."""
    words = [arm.get("script", DEFAULT_SCRIPT), "--config", arm.get("config", default_config)]
    for pair in overrides(arm):
        words += ["--set", pair]
    return words


def main(argv: list[str]) -> None:
    what, path, *rest = argv
    arms = load_arms(Path(path))
    if what == "names":
        print(" ".join(arms))
    elif what == "args":
        name, default_config = rest
        if name not in arms:
            raise SystemExit(f"no arm {name!r} in {path} (arms: {', '.join(arms)})")
        print(" ".join(command(arms[name], default_config)))
    else:
        raise SystemExit(f"usage: arms.py names FILE | args FILE ARM CONFIG (got {what!r})")


if __name__ == "__main__":
    main(sys.argv[1:])
