"""Builds the vendored recipe samples from ../shared/data (see DATA.md), with fixed splits.

    python recipes/data/make_samples.py [--data-dir ../shared/data] [--xsum-study PATH]

- xsum-sample.jsonl: 400 XSum test articles (id, document, summary, split), shuffled with seed 0:
  300 train, 50 validation, 50 test.
- bible-es-en-sample.tsv: 2,400 verses (ref, spanish, english, split) of the Reina-Valera 1909 /
  King James Bible, shuffled with seed 0: 2,000 train, 200 validation, 200 test.
- with --xsum-study PATH, instead of the samples: the efficacy study's second task's file (not
  vendored: all of XSum; recipes/configs/xsum-gemma-stage1.yaml), the 1,001 articles in the same
  seed-0 order, 701 train, 100 validation, 200 test.
"""

from __future__ import annotations

import argparse
import csv
import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent


def splits(n: int, validation: int, test: int) -> list[str]:
    return ["train"] * (n - validation - test) + ["validation"] * validation + ["test"] * test


def write_articles(path: Path, articles: list[dict], names: list[str]) -> None:
    with open(path, "w", encoding="utf-8") as out:
        for row, split in zip(articles, names, strict=True):
            record = {k: row[k] for k in ("id", "document", "summary")} | {"split": split}
            out.write(json.dumps(record, ensure_ascii=False) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, default=HERE.parents[2] / "shared/data")
    parser.add_argument("--xsum-study", type=Path, help="write the study's XSum file here (only)")
    args = parser.parse_args()

    with open(args.data_dir / "xsum-test.jsonl", encoding="utf-8") as handle:
        articles = [json.loads(line) for line in handle if line.strip()]
    random.Random(0).shuffle(articles)
    if args.xsum_study:
        args.xsum_study.parent.mkdir(parents=True, exist_ok=True)
        write_articles(args.xsum_study, articles, splits(len(articles), 100, 200))
        return
    write_articles(HERE / "xsum-sample.jsonl", articles[:400], splits(400, 50, 50))

    with open(args.data_dir / "bible-es-en.tsv", newline="", encoding="utf-8") as handle:
        verses = [r for r in csv.DictReader(handle, delimiter="\t", quoting=csv.QUOTE_NONE)]
    verses = [v for v in verses if v["spanish"].strip() and v["english"].strip()]
    random.Random(0).shuffle(verses)
    with open(HERE / "bible-es-en-sample.tsv", "w", newline="", encoding="utf-8") as out:
        writer = csv.writer(out, delimiter="\t", quoting=csv.QUOTE_NONE, escapechar="\\")
        writer.writerow(["ref", "spanish", "english", "split"])
        for row, split in zip(verses[:2400], splits(2400, 200, 200), strict=True):
            writer.writerow([row["ref"], row["spanish"], row["english"], split])


if __name__ == "__main__":
    main()
