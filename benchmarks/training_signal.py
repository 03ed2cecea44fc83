"""Does the loss's gradient descend its own value on a real generator?

Loss-only training (no CE) of a decoder-only generator on one fixed batch of es->en verses,
repeated: for each bridge mode and matching, the loss and the hard F_BERT gap (1 - F, the metric)
of the decoded teacher-forced argmax text at every step, and the CE of the same batch.

    HF_HUB_OFFLINE=1 python benchmarks/training_signal.py --model gemma-3-270m --steps 12 \\
        --modes retokenize average --matchings softmax hard --out benchmarks/results/signal.json

The CI test (``tests/test_training_signal.py``) runs the same experiment on a small Gemma 3 with
the real 262,144-token tokenizer.
"""

from __future__ import annotations

import argparse
import csv
import json
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "recipes" / "data" / "bible-es-en-sample.tsv"


def verses(count: int, offset: int = 0, split: str = "train") -> list[tuple[str, str]]:
    with SAMPLE.open(encoding="utf-8") as f:
        rows = [r for r in csv.DictReader(f, delimiter="\t") if r["split"] == split]
    return [(r["spanish"], r["english"]) for r in rows[offset : offset + count]]


def load_generator(name: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bsloss.pretrained import resolve_model

    folder = resolve_model(name)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return model, tokenizer


def build_batch(tokenizer, pairs):
    """Prompt + completion ids, the completion's labels, and the positions whose logits predict
    the completion (prompt's last token .. completion's second-to-last)."""
    rows, labels = [], []
    for es, en in pairs:
        prompt = tokenizer(f"Spanish: {es}\nEnglish:", add_special_tokens=True)["input_ids"]
        completion = tokenizer(" " + en, add_special_tokens=False)["input_ids"][:40]
        completion = completion + [tokenizer.eos_token_id]
        rows.append(prompt + completion)
        labels.append([-100] * len(prompt) + completion)
    width = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    lab = torch.tensor([[-100] * (width - len(r)) + x for r, x in zip(rows, labels, strict=True)])
    attention = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    # logits at t predict token t + 1
    targets = torch.cat([lab[:, 1:], torch.full_like(lab[:, :1], -100)], dim=1)
    return ids, attention, targets


def run(model, tokenizer, scorer, loss_fn, batch, refs, steps: int, lr: float) -> list[dict]:
    from bsloss import Logits

    ids, attention, targets = batch
    mask = targets != -100
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    history = []
    for step in range(steps + 1):
        # logits at the completion positions only: the LM head over 262k tokens is the cost
        hidden = model.model(input_ids=ids, attention_mask=attention).last_hidden_state
        logits = model.lm_head(hidden[mask])
        ce = torch.nn.functional.cross_entropy(logits, targets[mask])
        # the candidate: the completion positions' distributions, left-aligned
        counts = mask.sum(1).tolist()
        rows = logits.split(counts)
        width = max(counts)
        cand = torch.stack([torch.nn.functional.pad(r, (0, 0, 0, width - len(r))) for r in rows])
        cmask = torch.arange(width)[None] < torch.tensor(counts)[:, None]
        loss = loss_fn(Logits(cand), refs, candidate_mask=cmask)
        with torch.no_grad():
            argmax = cand.argmax(-1)
            texts = [
                tokenizer.decode(argmax[b][cmask[b]].tolist(), skip_special_tokens=True)
                for b in range(len(refs))
            ]
            _, _, f = scorer.score(texts, refs)
        entry = {
            "step": step,
            "loss": loss.item(),
            "metric_gap": 1 - f.mean().item(),
            "ce": ce.item(),
            "text0": texts[0][:80],
        }
        history.append(entry)
        print(json.dumps(entry), flush=True)
        if step == steps:
            break
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return history


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--offset", type=int, default=0)
    parser.add_argument("--modes", nargs="+", default=["retokenize", "average"])
    parser.add_argument("--matchings", nargs="+", default=["softmax"])
    parser.add_argument("--temperature", type=float, default=0.05)
    parser.add_argument("--freeze_embeddings", action="store_true")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    from bsloss import BERTScoreLoss, BERTScorer, Bridge
    from bsloss.functional.matching import resolve_matching

    scorer = BERTScorer()
    pairs = verses(args.batch, args.offset)
    refs = [en for _, en in pairs]
    results = {"args": {k: str(v) for k, v in vars(args).items()}, "runs": []}
    state = None
    for mode in args.modes:
        for matching in args.matchings:
            model, tokenizer = load_generator(args.model)
            if state is None:
                state = {k: v.clone() for k, v in model.state_dict().items()}
            model.load_state_dict(state)
            if args.freeze_embeddings:
                model.get_input_embeddings().weight.requires_grad_(False)
            model.train()
            loss_fn = BERTScoreLoss(
                model=scorer.encoder,
                # "hard" has no temperature (it ignores one, as the legacy keyword did)
                matching=resolve_matching(matching, temperature=args.temperature),
                bridge=Bridge(tokenizer, mode=mode),
            )
            batch = build_batch(tokenizer, pairs)
            start = time.perf_counter()
            print(f"== {mode} {matching}", flush=True)
            history = run(model, tokenizer, scorer, loss_fn, batch, refs, args.steps, args.lr)
            seconds = time.perf_counter() - start
            results["runs"].append(
                {"mode": mode, "matching": matching, "seconds": seconds, "history": history}
            )
            if args.out:
                args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
