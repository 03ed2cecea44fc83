"""Writes notebooks/soft_vs_hard.ipynb from the cells below and, with --execute, runs it in place.

    python notebooks/build_soft_vs_hard.py --execute            # full run (STS-B dev, 1,500 pairs)
    BSLOSS_NOTEBOOK_SMALL=1 python notebooks/build_soft_vs_hard.py --execute --out /tmp/nb.ipynb

The notebook reads the committed correlation study (benchmarks/results/correlation.csv) and the
recipe logs (recipes/results/), and computes the rest itself.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent

CELLS: list[tuple[str, str]] = [
    (
        "md",
        """# Soft vs hard matching in BERTScore

What soft matching (softmax, logsumexp "TRWMD", Sinkhorn "TWMD"; Chen et al., 2020) does compared
with BERTScore's hard greedy max (Zhang et al., 2020, Eq. 1):

- **(a)** the similarity matrix of a paraphrase pair and the hard and soft matching plans;
- **(b)** the soft − hard gap of F against the temperature T;
- **(c)** gradient density: which similarity cells, candidate positions and vocabulary entries
  receive gradient from a generator's distributions;
- **(d)** agreement with human judgments (STS-B), from `benchmarks/correlation.py`;
- **(e)** the recipe study on a real generator (Gemma 3 270M): CE vs CE + hard vs soft loss.

Everything runs offline on the CPU with the embedded all-MiniLM-L6-v2 scorer (layer 6).
`BSLOSS_NOTEBOOK_SMALL=1` runs it on a small subset (the CI test does).""",
    ),
    (
        "code",
        """import csv
import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import matplotlib.pyplot as plt
import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence

import bsloss
from bsloss.functional import bert_score
from bsloss.functional.matching import Hard, LogSumExp, Sinkhorn, Softmax
from bsloss.functional.matching.sinkhorn import sinkhorn_log_plan
from bsloss import Logits, TopK, plot_example
from bsloss.plot import pair_similarity

SMALL = os.environ.get("BSLOSS_NOTEBOOK_SMALL") == "1"
REPO = Path.cwd() if (Path.cwd() / "bsloss").is_dir() else Path.cwd().parent
DATA = Path(os.environ.get("BSLOSS_DATA_DIR", REPO.parent / "shared/data"))
torch.manual_seed(0)
scorer = bsloss.BERTScorer(device="cpu")
print(scorer.hash, "| small run" if SMALL else "| full run")""",
    ),
    ("md", "## (a) One paraphrase pair: similarities and matching plans"),
    (
        "code",
        """candidate = "A man is playing a large flute."
reference = "A man is playing a flute."
sim, cand_tokens, ref_tokens = pair_similarity(scorer, candidate, reference)
T = 0.05
ones_c = torch.ones(1, len(cand_tokens), dtype=torch.bool)
ones_r = torch.ones(1, len(ref_tokens), dtype=torch.bool)
plans = {
    "hard (row argmax)": torch.nn.functional.one_hot(sim.argmax(1), len(ref_tokens)).float(),
    f"softmax, T={T}": torch.softmax(sim / T, dim=1),
    f"Sinkhorn 20 steps, T={T}": sinkhorn_log_plan(
        sim[None], ones_c, ones_r, T, 20, "candidate"
    )[0].exp(),
}
fig, axes = plt.subplots(1, 4, figsize=(17, 3.8))
for ax, (title, matrix) in zip(axes, [("cosine similarity", sim), *plans.items()]):
    image = ax.imshow(matrix, cmap="viridis")
    ax.set_xticks(range(len(ref_tokens)), ref_tokens, rotation=60, fontsize=8)
    ax.set_yticks(range(len(cand_tokens)), cand_tokens, fontsize=8)
    ax.set_title(title)
    fig.colorbar(image, ax=ax, fraction=0.046)
fig.tight_layout()
plt.show()
for title, matrix in plans.items():
    rows = matrix / matrix.sum(1, keepdim=True)
    print(f"{title:28s} candidate-side score (mean over rows of sum_j plan_ij s_ij): "
          f"{(rows * sim).sum(1).mean():.4f}")""",
    ),
    (
        "md",
        "The package's plot helper (`bsloss.plot_example`, CLI `bsloss plot`) draws the same "
        "pair with each token's best match marked:",
    ),
    ("code", """plot_example(candidate, reference, scorer=scorer)\nplt.show()"""),
    ("md", "## (b) Soft − hard gap of F against the temperature (STS-B dev)"),
    (
        "code",
        """with open(DATA / "stsb-dev.tsv", newline="", encoding="utf-8") as handle:
    rows = list(csv.reader(handle, delimiter="\\t", quoting=csv.QUOTE_NONE))[1:]
rows = rows[:100] if SMALL else rows
human = np.array([float(r[0]) for r in rows])
first, second = [r[1] for r in rows], [r[2] for r in rows]
embedded = scorer.embed(first + second)
special = torch.tensor(scorer.encoder.tokenization.special_token_ids)


def padded(texts):
    hidden = pad_sequence([embedded[t][0] for t in texts], batch_first=True)
    ids = pad_sequence([embedded[t][1] for t in texts], batch_first=True)
    mask = pad_sequence([torch.ones(len(embedded[t][1]), dtype=torch.bool) for t in texts],
                        batch_first=True)
    return hidden, mask, (mask & ~torch.isin(ids, special)).float()


cand, cand_mask, cand_w = padded(first)
ref, ref_mask, ref_w = padded(second)


def f_scores(matching, temperature=0.05, iterations=1):
    return bert_score(cand, ref, cand_mask, ref_mask, cand_w, ref_w, matching=matching,
                      temperature=temperature, sinkhorn_iterations=iterations,
                      normalized=True).f1


hard = f_scores("hard")
temperatures = [0.005, 0.01, 0.02, 0.05, 0.1, 0.15, 0.25, 0.5]
variants = {"softmax": ("softmax", 1), "logsumexp": ("logsumexp", 1),
            "sinkhorn-1": ("sinkhorn", 1), "sinkhorn-20": ("sinkhorn", 20)}
gaps = {name: [float((f_scores(m, t, k) - hard).mean()) for t in temperatures]
        for name, (m, k) in variants.items()}
fig, ax = plt.subplots(figsize=(6.5, 4))
for name, values in gaps.items():
    ax.plot(temperatures, values, marker="o", label=name)
ax.axhline(0, color="grey", lw=0.8)
ax.set_xscale("log")
ax.set_xlabel("temperature T")
ax.set_ylabel("mean F(soft) − F(hard)")
ax.set_title(f"STS-B dev, {len(rows)} pairs, layer {scorer.encoder.num_layers}")
ax.legend()
plt.show()
print("T      " + "  ".join(f"{n:>11s}" for n in gaps))
for i, t in enumerate(temperatures):
    print(f"{t:<6} " + "  ".join(f"{gaps[n][i]:+11.4f}" for n in gaps))
# softmax is an average of the row, so it sits below the max and approaches it as T -> 0;
# logsumexp is a smooth max, above the max, approaching it as T -> 0.
assert gaps["softmax"][0] < 0 and gaps["softmax"][0] > gaps["softmax"][-1]
assert gaps["logsumexp"][0] > 0 and gaps["logsumexp"][0] < gaps["logsumexp"][-1]""",
    ),
    ("md", "## (c) Gradient density from generator distributions"),
    (
        "markdown-note",
        """A generator's next-token logits for a batch of candidates (STS-B first sentences, as
peaked logits `6·onehot + noise`) go through `BERTScoreLoss`: expected input embeddings → frozen
scorer → matching against the second sentences. We count what receives a non-zero gradient:
similarity cells (the matching itself), candidate positions (rows of the logits) and vocabulary
entries (logit columns), exactly non-zero and above 10⁻³ of the largest magnitude.""",
    ),
    (
        "code",
        """tokenizer = scorer.encoder.tokenizer
batch = 8 if SMALL else 32
ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in first[:batch]]
cand_ids = pad_sequence([torch.tensor(x) for x in ids], batch_first=True)
mask = pad_sequence([torch.ones(len(x), dtype=torch.bool) for x in ids], batch_first=True)
vocab = scorer.encoder.input_embeddings.num_embeddings
generator = torch.Generator().manual_seed(0)
base_logits = 6 * torch.nn.functional.one_hot(cand_ids, vocab).float()
base_logits += torch.randn(base_logits.shape, generator=generator)

# the similarity cells: the gradient of the matched score with respect to each cell
cells = {}
for name, matching in [("hard", Hard()), ("softmax T=0.05", Softmax(0.05)),
                       ("logsumexp T=0.05", LogSumExp(0.05)), ("sinkhorn T=0.05", Sinkhorn(0.05))]:
    s = sim[None].clone().requires_grad_(True)
    p, r = matching(s, ones_c, ones_r)
    (p.mean() + r.mean()).backward()
    cells[name] = float((s.grad != 0).float().mean())

density = []
for name, options in [("hard", dict(matching=Hard())),
                      ("softmax T=0.05", dict(matching=Softmax(0.05))),
                      ("sinkhorn T=0.05", dict(matching=Sinkhorn(0.05))),
                      ("hard, top_k=32", dict(matching=Hard(), candidate_transforms=TopK(32))),
                      ("softmax, top_k=32",
                       dict(matching=Softmax(0.05), candidate_transforms=TopK(32)))]:
    loss_fn = bsloss.BERTScoreLoss(model=scorer.encoder, **options)
    logits = base_logits.clone().requires_grad_(True)
    loss_fn(Logits(logits), candidate_mask=mask, references=second[:batch]).backward()
    grad = logits.grad.abs()
    big = grad > 1e-3 * grad.max()
    density.append({
        "loss": name,
        "positions (≠0)": float((grad.amax(-1)[mask] > 0).float().mean()),
        "vocab entries per position (≠0)": float(((grad > 0).float().mean(-1))[mask].mean()),
        "vocab entries per position (>1e-3·max)": float((big.float().mean(-1))[mask].mean()),
    })
print("share of similarity cells with a non-zero gradient, pair of (a):")
for name, share in cells.items():
    print(f"  {name:18s} {share:.3f}")
print()
header = list(density[0])
print(" | ".join(header))
for row in density:
    print(" | ".join([row["loss"]] + [f"{row[k]:.4f}" for k in header[1:]]))
fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
axes[0].bar(list(cells), list(cells.values()), color="tab:blue")
axes[0].set_title("similarity cells with gradient")
axes[0].tick_params(axis="x", rotation=20)
keys = header[1:]
width = 0.8 / len(density)
for i, row in enumerate(density):
    axes[1].bar(np.arange(len(keys)) + i * width, [row[k] for k in keys], width,
                label=row["loss"])
labels = [k.replace("per position ", "per position\\n") for k in keys]  # no overlap
axes[1].set_xticks(np.arange(len(keys)) + 0.4 - width / 2, labels, fontsize=8)
axes[1].set_yscale("log")
axes[1].set_title("logits receiving gradient")
axes[1].legend(fontsize=7)
fig.tight_layout()
plt.show()
assert cells["hard"] < cells["softmax T=0.05"] == 1.0""",
    ),
    ("md", "## (d) Agreement with human judgments (STS-B, `benchmarks/correlation.py`)"),
    (
        "code",
        """results = REPO / "benchmarks/results/correlation.csv"
with open(results, newline="", encoding="utf-8") as handle:
    table = list(csv.DictReader(handle))
dev = [r for r in table if r["split"] == "dev" and r["idf"] == "False"]
fig, axes = plt.subplots(1, 2, figsize=(12, 4))
for center, ax in zip(("none", "batch"), axes):
    for name in ("softmax", "logsumexp", "sinkhorn-1", "sinkhorn-20"):
        points = sorted(
            (float(r["temperature"]), float(r["pearson_F"])) for r in dev
            if r["matching"] == name and r["centering"] == center and r["layer"] == "6"
        )
        ax.plot(*zip(*points), marker="o", label=name)
    hard_value = next(float(r["pearson_F"]) for r in dev if r["matching"] == "hard"
                      and r["centering"] == center and r["layer"] == "6")
    ax.axhline(hard_value, color="black", ls="--", label="hard")
    ax.set_xscale("log")
    ax.set_xlabel("temperature T")
    ax.set_ylabel("Pearson r of F with human scores")
    ax.set_title(f"STS-B dev, layer 6, idf off, centering: {center}")
    ax.legend(fontsize=8)
fig.tight_layout()
plt.show()
fig, ax = plt.subplots(figsize=(7, 3.6))
# hard last, as large open markers: softmax at its best T lies on it (within 4e-4)
for name in ("softmax", "logsumexp", "sinkhorn-20", "hard"):
    for center, style in (("none", "-"), ("batch", "--")):
        best = {}
        for r in dev:
            if r["matching"] == name and r["centering"] == center:
                layer = int(r["layer"])
                best[layer] = max(best.get(layer, -1.0), float(r["pearson_F"]))
        layers = sorted(best)
        look = ({"ls": "none", "marker": "s", "ms": 9, "mfc": "none", "mew": 1.5}
                if name == "hard" else {"ls": style, "marker": "o", "ms": 4})
        ax.plot(layers, [best[k] for k in layers], **look, label=f"{name}, centering {center}")
ax.set_xlabel("layer")
ax.set_ylabel("best Pearson r of F over T")
ax.set_title("STS-B dev, idf off (softmax's best T lies on hard: open squares)")
ax.legend(fontsize=7, ncol=2)
fig.tight_layout()
plt.show()
print((REPO / "benchmarks/results/correlation.md").read_text())""",
    ),
    (
        "md",
        """## (e) The recipe study: Gemma 3 270M, CE vs CE + hard vs CE + soft BERTScore loss

From `recipes/results/fixed-gradient/` (`recipes/RESULTS.md`: 3 seeds, λ = 1 and 10,
teacher-forced candidates, the loss's current gradient): the training CE of seed 0 of each run,
and each seed's held-out F_BERT (training scorer). The first runs of this study, in
`recipes/results/{xsum,bible-es-en}`, used the 0.1.0 retokenize gradient, which was not a
descent direction (RESULTS.md's caveat): they are superseded and not plotted. On teacher-forced
candidates the term does not beat CE (soft λ = 10 is clearly worse on es→en); the later study on
the model's own sampled answers, where CE + the balanced soft term beats continued CE, is in
`recipes/results/study/` (RESULTS.md, "efficacy study").""",
    ),
    (
        "code",
        """runs = REPO / "recipes/results/fixed-gradient"
tasks = [runs / t for t in ("xsum", "bible-es-en") if (runs / t).is_dir()]
for task in tasks:
    folders = sorted(p for p in task.iterdir() if (p / "results.json").exists())
    names = sorted({p.name.rpartition("-s")[0] for p in folders}, key=lambda n: (n != "ce", n))
    fig, (curves, seeds) = plt.subplots(1, 2, figsize=(11, 3.4))
    for p in folders:
        if p.name.endswith("-s0"):
            log = [json.loads(x) for x in (p / "log.jsonl").read_text().splitlines()]
            train = [e for e in log if e.get("kind") == "train"]
            curves.plot([e["step"] for e in train], [e["ce"] for e in train], lw=0.8,
                        label=p.name[:-3])
    curves.set(title="train CE (seed 0)", xlabel="step")
    curves.legend(fontsize=7)
    after = {name: [json.loads((p / "results.json").read_text())["after"]["f_bert"]
                    for p in folders if p.name.rpartition("-s")[0] == name] for name in names}
    for i, name in enumerate(names):
        seeds.bar(i, np.mean(after[name]), color="lightgray")
        seeds.plot([i] * len(after[name]), after[name], "o", color="k", ms=3)
    seeds.set_xticks(range(len(names)), names, fontsize=8)
    seeds.set_ylim(min(min(v) for v in after.values()) - 0.03, None)
    seeds.set_title("held-out F_BERT per seed (bar: mean)")
    fig.suptitle(f"{task.name}: Gemma 3 270M fine-tuned from the same start")
    fig.tight_layout()
    plt.show()
if not tasks:
    print("no recipe results under recipes/results/fixed-gradient/ yet")""",
    ),
]


def build() -> nbformat.NotebookNode:
    cells = []
    for kind, source in CELLS:
        cells.append(new_code_cell(source) if kind == "code" else new_markdown_cell(source))
    notebook = new_notebook(cells=cells)
    notebook.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    return notebook


def execute(notebook: nbformat.NotebookNode, timeout: int = 1800) -> nbformat.NotebookNode:
    from nbclient import NotebookClient

    client = NotebookClient(
        notebook,
        timeout=timeout,
        kernel_name="python3",
        resources={"metadata": {"path": str(HERE)}},
    )
    client.execute()
    return notebook


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE / "soft_vs_hard.ipynb")
    parser.add_argument("--execute", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    notebook = build()
    if args.execute:
        notebook = execute(notebook)
    nbformat.write(notebook, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
