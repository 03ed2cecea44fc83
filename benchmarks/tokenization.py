"""The metric's tokenisation: the Hugging Face call against bsloss's ``ScorerTokenizer``.

``ScorerTokenizer.encode`` goes straight through a private copy of the fast tokenizer's Rust
tokenizer, in pieces on up to 4 threads for a large batch (``bsloss/scorer/tokenization.py``).
This times, alternating in one process, on the same distinct Brown sentences (MiniLM's
tokenizer, the special tokens added, no truncation):

* **call**: ``tokenizer(texts, add_special_tokens=True)`` (the ids alone), what bsloss did before;
* **bsloss, 1 thread** and **bsloss** (its default threads): ``ScorerTokenizer.encode``;

each with the tokenizers library's own batch parallelism on (its default) and off
(``TOKENIZERS_PARALLELISM=false``: what the benchmarks' harness sets, and what the library
falls back to in a process forked after it was used). The ids are checked equal.

    HF_HUB_OFFLINE=1 python benchmarks/tokenization.py --texts 16384 --rounds 5
"""

from __future__ import annotations

import os
import statistics

if not __package__:  # run as `python benchmarks/tokenization.py`
    import _path  # noqa: F401

from benchmarks import harness
from benchmarks.revisions import brown_pairs_of


def main() -> None:
    parser = harness.argument_parser(__doc__)
    parser.add_argument("--texts", type=int, default=16384, help="distinct Brown sentences")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from bsloss.scorer.default import embedded_model_path
    from bsloss.scorer.tokenization import ScorerTokenizer

    cands, refs = brown_pairs_of(-(-args.texts // 2))
    texts = (cands + refs)[: args.texts]
    tokenizer = AutoTokenizer.from_pretrained(embedded_model_path())
    tokens = ScorerTokenizer(tokenizer, "MiniLM")
    prepared = tokens.prepare(texts)

    def call():
        return tokenizer(
            prepared,
            add_special_tokens=True,
            return_token_type_ids=False,
            return_attention_mask=False,
        )["input_ids"]

    variants = {
        "call": call,
        "bsloss, 1 thread": lambda: tokens.encode(texts, truncate=False, threads=1)[0],
        f"bsloss ({tokens._threads} threads)": lambda: tokens.encode(texts, truncate=False)[0],
    }
    env = harness.environment(tokenizers=harness.package_version("tokenizers"))
    rows, payload = [], {"texts": len(texts), "threads": tokens._threads, "results": {}}
    for parallelism in ("true", "false"):
        os.environ["TOKENIZERS_PARALLELISM"] = parallelism  # read by the library at each call
        expected = call()
        if any(run() != expected for run in variants.values()):
            raise AssertionError("bsloss's ids differ from the call's")
        timer = harness.AlternatingTimer(args.rounds, f"parallelism {parallelism}")
        series = timer.run(variants)
        base = series["call"].seconds
        for name, measured in series.items():
            low, high = harness.ratio_range(measured.seconds, base)
            median = statistics.median(measured.seconds)
            ratio = median / statistics.median(base)
            rows.append(
                (parallelism, name, f"{median:.3f}", f"{ratio:.2f}", f"{low:.2f}–{high:.2f}")
            )
            payload["results"][f"{parallelism}/{name}"] = measured.seconds
    lines = harness.header_lines(env)
    lines.append(f"- {len(texts):,} distinct Brown sentences, MiniLM's tokenizer; ids equal")
    table = harness.markdown_table(
        ["TOKENIZERS_PARALLELISM", "variant", "median s", "/ call", "per-round range"],
        rows,
        "llrrr",
    )
    payload["environment"] = env
    harness.write_outputs("\n".join(lines) + "\n\n" + table, args.out, args.json, payload)


if __name__ == "__main__":
    main()
