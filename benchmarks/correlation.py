"""Soft vs hard matching against human judgments: Pearson and Spearman on STS-B.

For every layer of the embedded scorer (all-MiniLM-L6-v2, layers 0-6), idf on and off, centering
none or batch (Chen et al., 2020, Sec. 5: the mean of the real token vectors of each batch of 64
pairs, candidates and references separately), and matching in {hard, softmax, logsumexp,
sinkhorn (1 step), sinkhorn (20 steps, "converged")} x T in {0.01, 0.02, 0.05, 0.1, 0.15}, it
scores STS-B train and dev with :func:`bsloss.functional.bert_score` and correlates P, R and F
with the human scores. Each sentence is encoded once (all hidden states in one pass); idf comes
from the split's second sentences. Choices (best temperature, best layer) are made on train and
reported on dev.

Reproduce::

    HF_HUB_OFFLINE=1 python benchmarks/correlation.py \\
        --out-csv benchmarks/results/correlation.csv --out-md benchmarks/results/correlation.md
"""

from __future__ import annotations

import csv
import itertools
import time
from pathlib import Path

if not __package__:  # run as `python benchmarks/correlation.py`
    import _path  # noqa: F401

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence

from benchmarks import harness
from benchmarks._data import load_stsb
from bsloss.functional import batch_center, bert_score, idf_table
from bsloss.scorer.encoder import ScorerEncoder

TEMPERATURES = (0.01, 0.02, 0.05, 0.1, 0.15)
MATCHINGS = {  # name -> (functional matching, sinkhorn iterations)
    "hard": ("hard", 1),
    "softmax": ("softmax", 1),
    "logsumexp": ("logsumexp", 1),
    "sinkhorn-1": ("sinkhorn", 1),
    "sinkhorn-20": ("sinkhorn", 20),
}
PAIRS_PER_BATCH = 64


def pearson(x: np.ndarray, y: np.ndarray) -> float:
    return float(np.corrcoef(x, y)[0, 1])


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    def ranks(v: np.ndarray) -> np.ndarray:  # average ranks for ties
        order = np.argsort(v, kind="mergesort")
        r = np.empty(len(v))
        r[order] = np.arange(len(v))
        _, inverse, counts = np.unique(v, return_inverse=True, return_counts=True)
        sums = np.bincount(inverse, weights=r)
        return sums[inverse] / counts[inverse]

    return pearson(ranks(x), ranks(y))


@torch.inference_mode()
def encode_all_layers(encoder: ScorerEncoder, texts: list[str]) -> tuple[list, list]:
    """Per text: hidden states ``[layers + 1, L, d]`` (float32) and token ids ``[L]``."""
    ids = encoder.tokenization(texts)
    order = sorted(range(len(texts)), key=lambda i: len(ids[i]))
    hidden: list = [None] * len(texts)
    for start in range(0, len(order), 128):
        batch = order[start : start + 128]
        rows = [torch.tensor(ids[i]) for i in batch]
        input_ids = pad_sequence(
            rows, batch_first=True, padding_value=encoder.tokenization.pad_token_id
        )
        lengths = [len(r) for r in rows]
        mask = torch.arange(input_ids.shape[1])[None] < torch.tensor(lengths)[:, None]
        out = encoder.model(
            input_ids=input_ids, attention_mask=mask.long(), output_hidden_states=True
        )
        states = torch.stack(out.hidden_states, dim=1)  # [B, layers + 1, L, d]
        for row, i in enumerate(batch):
            hidden[i] = states[row, :, : lengths[row]].clone()
    return hidden, [torch.tensor(x) for x in ids]


def pad(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    padded = pad_sequence(rows, batch_first=True)
    lengths = torch.tensor([len(r) for r in rows])
    return padded, torch.arange(padded.shape[1])[None] < lengths[:, None]


def score_split(encoder, split: str, layers: int, limit: int | None = None) -> list[dict]:
    human, first, second = (column[:limit] for column in load_stsb(split))
    hidden1, ids1 = encode_all_layers(encoder, first)
    hidden2, ids2 = encode_all_layers(encoder, second)
    vocab = encoder.input_embeddings.num_embeddings
    tables = {
        False: torch.ones(vocab).index_fill_(
            0, torch.tensor(encoder.tokenization.special_token_ids), 0.0
        ),
        True: idf_table(
            [x.tolist() for x in ids2], vocab, encoder.tokenization.special_token_ids
        ).float(),
    }
    y = np.asarray(human)
    results = []
    configs = [("hard", None)] + [(m, t) for m in MATCHINGS if m != "hard" for t in TEMPERATURES]
    for layer, use_idf, center in itertools.product(
        range(layers + 1), (False, True), (False, True)
    ):
        table = tables[use_idf]
        batches = []
        for start in range(0, len(first), PAIRS_PER_BATCH):
            span = range(start, min(start + PAIRS_PER_BATCH, len(first)))
            cand, cand_mask = pad([hidden1[i][layer] for i in span])
            ref, ref_mask = pad([hidden2[i][layer] for i in span])
            cand_ids, _ = pad([ids1[i] for i in span])
            ref_ids, _ = pad([ids2[i] for i in span])
            if center:
                cand = batch_center(cand, cand_mask, distributed=False)
                ref = batch_center(ref, ref_mask, distributed=False)
            batches.append(
                (
                    cand,
                    ref,
                    cand_mask,
                    ref_mask,
                    table[cand_ids] * cand_mask,
                    table[ref_ids] * ref_mask,
                )
            )
        for name, temperature in configs:
            matching, iterations = MATCHINGS[name]
            prf = [
                bert_score(
                    *batch,
                    matching=matching,
                    temperature=temperature or 0.1,
                    sinkhorn_iterations=iterations,
                )
                for batch in batches
            ]
            row = {
                "split": split,
                "layer": layer,
                "idf": use_idf,
                "centering": "batch" if center else "none",
                "matching": name,
                "temperature": "" if temperature is None else temperature,
            }
            for k, metric in enumerate("PRF"):
                values = torch.cat([p[k] for p in prf]).numpy()
                row[f"pearson_{metric}"] = pearson(values, y)
                row[f"spearman_{metric}"] = spearman(values, y)
            results.append(row)
    return results


def summary(rows: list[dict]) -> str:
    """Dev Pearson of F: for each matching x centering x idf, the temperature and layer chosen
    on train (best train Pearson F), and the same for hard."""
    by_key: dict = {}
    for row in rows:
        by_key.setdefault((row["matching"], row["centering"], row["idf"]), []).append(row)
    lines = [
        "| matching | centering | idf | layer (train-chosen) | T (train-chosen) | train Pearson F "
        "| dev Pearson F | dev Spearman F | dev Pearson P | dev Pearson R |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for (matching, centering, use_idf), group in sorted(
        by_key.items(), key=lambda kv: list(MATCHINGS).index(kv[0][0])
    ):
        train = [r for r in group if r["split"] == "train"]
        best = max(train, key=lambda r: r["pearson_F"])
        dev = next(
            r
            for r in group
            if r["split"] == "dev"
            and r["layer"] == best["layer"]
            and r["temperature"] == best["temperature"]
        )
        lines.append(
            f"| {matching} | {centering} | {'on' if use_idf else 'off'} | {best['layer']} | "
            f"{best['temperature'] or '–'} | {best['pearson_F']:.4f} | {dev['pearson_F']:.4f} "
            f"| {dev['spearman_F']:.4f} | {dev['pearson_P']:.4f} | {dev['pearson_R']:.4f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = harness.argument_parser(__doc__, out=False, json_out=False)
    parser.add_argument("--out-csv", type=Path, default=Path("benchmarks/results/correlation.csv"))
    parser.add_argument("--out-md", type=Path, default=Path("benchmarks/results/correlation.md"))
    parser.add_argument("--splits", nargs="+", default=["train", "dev"])
    parser.add_argument("--limit", type=int, default=None, help="first N pairs of each split")
    args = parser.parse_args()
    torch.manual_seed(0)
    started = time.perf_counter()
    env = harness.environment()
    encoder = ScorerEncoder.from_pretrained(None, device="cpu")
    layers = encoder.num_layers
    rows = [row for split in args.splits for row in score_split(encoder, split, layers, args.limit)]
    args.out_csv.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out_csv, "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        for row in rows:
            writer.writerow(
                {k: (f"{v:.6f}" if isinstance(v, float) else v) for k, v in row.items()}
            )
    report = (
        "# Correlation of BERTScore variants with STS-B human scores\n\n"
        + "\n".join(harness.header_lines(env))
        + f"\n- model: {encoder.describe()} (all layers 0-{layers}); runtime "
        f"{time.perf_counter() - started:.0f} s\n"
        "- every configuration is in the CSV; below, per matching x centering x idf, the layer "
        "and temperature with the best *train* Pearson of F, reported on *dev*\n\n"
        + summary(rows)
        + "\n"
    )
    args.out_md.write_text(report, encoding="utf-8")
    print(report)


if __name__ == "__main__":
    main()
