"""What a ``sampled`` training step costs against a cross-entropy step (issue 44, item 4).

The study's ``sampled`` arm (``recipes/RESULTS.md``): Gemma 3 270M with its stage-1 LoRA adapter
(rank 8), batch 8 es→en verses, answers of at most 40 new tokens, CE + the balanced soft
BERTScore term on the model's sampled answers. The step is the one
``BERTScoreTrainerMixin.compute_loss`` takes, cut into its parts and timed in CPU-seconds
(``time.process_time``, one thread): the answers' generation (``SampledAnswers.answer``), the
joint forward pass (the batch's rows and the answers' rows, stopping before the LM head), the
fused head pass (CE on the labels, the term on the answers: ``BERTScoreTerm``), backward and the
optimizer. The CE step is the same without answers (the term's weight 0: the fused CE alone).
Each cost is the median over ``--steps`` steps after one warm-up step; the ratios are to the CE
step's total, measured in the same run. A variant answering every k-th step costs on average
``(answering step + (k - 1) * CE step) / k`` (predicted, not measured).

    python benchmarks/sampled_step.py                      # the study's model (minutes)
    python benchmarks/sampled_step.py --variants full rows=2 max_new_tokens=20
    python benchmarks/sampled_step.py --tiny --steps 1     # a small random model (the test)

A variant is ``full`` (the study's ``sampled``) or ``SampledAnswers`` options joined by ``,``
(``rows=2``, ``rows=4,max_new_tokens=20``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):
    import _path  # noqa: F401

import torch

from bsloss.integrations.candidates import SampledAnswers
from bsloss.integrations.huggingface import BERTScoreTerm, _answer_tokens
from bsloss.integrations.lm_head import lm_head_inputs
from bsloss.integrations.term_weights import Balanced

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "recipes" / "data" / "bible-es-en-sample.tsv"
ADAPTER = ROOT / "recipes" / "results" / "study" / "stage1-seed0" / "best"
PARTS = ("generate", "forward", "head", "backward", "optimizer")


def gemma(adapter: Path):
    """(model, tokenizer, loss, pairs): the study's generator and scorer, its verses."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bsloss import BERTScoreLoss
    from bsloss.pretrained import resolve_model

    path = resolve_model("gemma-3-270m")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model = PeftModel.from_pretrained(model, str(adapter), is_trainable=True)
    loss = BERTScoreLoss(matching="softmax", temperature=0.05, generator_tokenizer=tokenizer)
    pairs = []
    for line in DATA.read_text().splitlines()[1:]:
        _, spanish, english, split = line.split("\t")
        if split == "train":
            pairs.append((spanish, english))
    return model, tokenizer, loss, pairs


def tiny():
    """A one-layer random GPT-2 over the embedded scorer's vocabulary, made-up pairs."""
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    from bsloss import BERTScoreLoss
    from bsloss.scorer.default import embedded_model_path

    tokenizer = AutoTokenizer.from_pretrained(embedded_model_path())
    tokenizer.eos_token = tokenizer.sep_token
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=128, n_embd=32, n_layer=1,
                        n_head=2, eos_token_id=tokenizer.sep_token_id,
                        bos_token_id=tokenizer.cls_token_id,
                        pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    words = "the cat sat on a mat and the dog ran in the long park today".split(" ")  # noqa: SIM905
    pairs = [(" ".join(words[i : i + 6]), " ".join(words[i + 1 : i + 5])) for i in range(8)]
    return GPT2LMHeadModel(config), tokenizer, BERTScoreLoss(matching="softmax"), pairs


def batch_of(model, tokenizer, pairs, max_target_length: int = 40,
             max_source_length: int = 96) -> dict:  # fmt: skip
    """The recipe's training batch (``recipes/causal.py``'s ``CausalCollator.training_batch``:
    prompt + reference + end rows, right-padded, labels ``-100`` on prompt and padding)."""
    sys.path.insert(0, str(ROOT / "recipes"))
    from causal import CausalCollator

    collator = CausalCollator(tokenizer, model, "translation", max_source_length, max_target_length)
    return collator.training_batch([{"source": s, "target": t} for s, t in pairs])


def parse_variant(text: str) -> SampledAnswers | None:
    """``ce`` (None), ``full`` or ``SampledAnswers`` options (``rows=2,max_new_tokens=20``)."""
    if text == "ce":
        return None
    if text == "full":
        return SampledAnswers()
    options = {}
    for item in text.split(","):
        key, _, value = item.partition("=")
        options[key] = int(value)
    return SampledAnswers(**options)


def timed_step(model, tokenizer, term, optimizer, batch, source, step) -> dict:
    """One training step as the mixin takes it, each part's CPU-seconds."""
    times = dict.fromkeys(PARTS, 0.0)
    clock = time.process_time
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}
    labels = batch["labels"]
    own, answered = {}, 0
    model.train()
    if source is not None and source.answers_at(step):
        pad, ends = _answer_tokens(model, tokenizer)
        start = clock()
        joint = source.answer(model, inputs, labels, causal=True, pad_token_id=pad,
                              eos_token_ids=ends, step=step)  # fmt: skip
        times["generate"] = clock() - start
        inputs, answered = joint.inputs, int((joint.candidate_labels != -100).sum())
    start = clock()
    with lm_head_inputs(model) as head:
        outputs = model(**inputs)
    times["forward"] = clock() - start
    if answered:
        hidden, candidates = joint.split(outputs["logits"])
        outputs = {"logits": hidden}
        own = {"candidate_outputs": {"logits": candidates},
               "candidate_labels": joint.candidate_labels,
               "candidate_rows": joint.candidate_rows}  # fmt: skip
    start = clock()
    if source is None or not answered:  # the CE alone (a weight-0 term computes nothing else)
        logits, aligned = term._aligned(outputs, labels, "labels")
        loss = term._cross_entropy_alone(logits, aligned, None, head, training=True)
    else:
        loss = term(outputs, labels, head=head, training=True, **own)
    times["head"] = clock() - start
    start = clock()
    loss.backward()
    times["backward"] = clock() - start
    start = clock()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    times["optimizer"] = clock() - start
    times["total"] = sum(times[p] for p in PARTS)
    times["answer_tokens"] = answered
    return times


def measure(args) -> tuple[list[tuple[str, dict]], dict]:
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model, tokenizer, loss, pairs = tiny() if args.tiny else gemma(Path(args.adapter))
    batch = batch_of(model, tokenizer, pairs[: args.batch_size], args.max_target_length)
    term = BERTScoreTerm(loss, tokenizer, weight=Balanced(1.0), causal=True)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4, weight_decay=0.0)
    results = []
    for name in ["ce", *args.variants]:
        source = parse_variant(name)
        if source is not None and source.max_new_tokens is None:
            # the study's answers: at most max_target_length new tokens
            source = SampledAnswers(**{**source.__dict__, "max_new_tokens": args.max_new_tokens})
        # every=k is predicted from its answering step: measure that step (step 0)
        steps = []
        for i in range(args.steps + 1):
            steps.append(timed_step(model, tokenizer, term, optimizer, batch, source, 0))
            parts = " ".join(f"{k} {v:.2f}" for k, v in steps[-1].items())
            print(f"{name} step {i}{' (warm-up)' if i == 0 else ''}: {parts}", file=sys.stderr,
                  flush=True)  # fmt: skip
        steps = steps[1:]
        cell = {k: statistics.median(s[k] for s in steps) for k in steps[0]}
        results.append((name, cell))
    ce = results[0][1]["total"]
    for name, cell in results:
        every = 1 if name == "ce" else parse_variant(name).every
        cell["per_step"] = (cell["total"] + (every - 1) * ce) / every
    meta = {
        "model": "tiny random GPT-2" if args.tiny else "Gemma 3 270M + LoRA r8 (stage-1 adapter)",
        "batch": args.batch_size,
        "reference_tokens": int((batch["labels"] != -100).sum()),
        "width": batch["input_ids"].shape[1],
        "threads": args.threads,
        "steps": args.steps,
    }
    return results, meta


def render(results: list[tuple[str, dict]], meta: dict, command: str) -> str:
    ce = results[0][1]["total"]
    lines = [
        f"`{command}`",
        "",
        f"{meta['model']}; batch {meta['batch']} ({meta['reference_tokens']} reference tokens, "
        f"width {meta['width']}); {meta['threads']} thread; CPU-seconds, median of "
        f"{meta['steps']} steps after a warm-up.",
        "",
        "| step | answer tokens | "
        + " | ".join(PARTS)
        + " | total | × CE | per step (every=k) | × CE |",
        "|---|---:|" + "---:|" * len(PARTS) + "---:|---:|---:|---:|",
    ]
    for name, cell in results:
        parts = " | ".join(f"{cell[p]:.2f}" for p in PARTS)
        lines.append(
            f"| {name} | {cell['answer_tokens']:.0f} | {parts} | {cell['total']:.2f} | "
            f"{cell['total'] / ce:.2f} | {cell['per_step']:.2f} | {cell['per_step'] / ce:.2f} |"
        )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a small random model (the test)")
    parser.add_argument("--variants", nargs="*", default=["full", "rows=4", "rows=2"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=40)
    parser.add_argument("--max-target-length", type=int, default=40)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--adapter", default=str(ADAPTER))
    args = parser.parse_args(argv)
    for name in args.variants:
        parse_variant(name)  # a bad variant fails before the model loads
    return args


def main(argv: Sequence[str] | None = None) -> str:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    results, meta = measure(args)
    table = render(results, meta, " ".join(["python benchmarks/sampled_step.py", *argv]))
    print(table)
    return table


if __name__ == "__main__":
    main()
