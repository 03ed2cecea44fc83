"""The host's share of the GPU benchmark's Gemma-shaped training step, measured on the CPU.

On a card the Gemma 3 270M-shaped step (``benchmarks/gpu.py``, section 3) is bound by the host
(the model's own CE step took 83-117 ms in runs 4-6, its kernels a fraction of that), and the
mixin's fused path with the CE alone took 1.15-1.40x the model's step. This runs the same
steps (:func:`benchmarks.gpu.gemma_steps`: the model's own CE, the mixin's fused CE alone, CE +
the term; each forward, backward, AdamW step and ``zero_grad``), and a fourth, CE + the term
through the loss compiled (``loss.compile()``, inductor; its compiling first step untimed), on
a model of Gemma 3 270M's config and depth (18 layers, its attention pattern) but 64 wide with
a 4,096-token vocabulary, so that the arithmetic is small beside the host's work, alternately
in one process, and counts each step's operations at the dispatcher
(``benchmarks/launches.py``'s counter; not the compiled step's, which a dispatch mode runs
eagerly). The scorer is
MiniLM's vocabulary and depth, 32 wide, through the synthetic bridge, its mask prepared as on a
GPU.

What it tells: how much host work the fused path and the term add to a step. Where the ratio
here is near 1 and the card's is not, the card's difference is not the host's operations but
what the card or a wait for it adds (the GPU benchmark's profiles of these rows say which).

    HF_HUB_OFFLINE=1 python benchmarks/gemma_step_host.py --rounds 7

``--chunks 16`` cuts the fused pass's vocabulary as a card cuts Gemma 3's at this step (one
chunk here otherwise): the PyTorch pass's launches a chunk then count as they do on the card.
"""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path

if not __package__:  # run as `python benchmarks/gemma_step_host.py`
    import _path  # noqa: F401

from benchmarks import harness
from benchmarks.gpu import GEMMA3_270M, ReferencesGiven, gemma_steps, synthetic_bridge
from benchmarks.launches import count
from benchmarks.revisions import narrow_scorer

COMPILED = "mixin fused CE + term, the loss compiled (loss.compile())"
# Gemma 3 270M's structure, the arithmetic cut down: 64 wide, 4,096 tokens
NARROW = {
    "vocab_size": 4096,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "query_pre_attn_scalar": 32,
}


def main() -> None:
    parser = harness.argument_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5, help="training steps per timed round")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--length", type=int, default=32)
    parser.add_argument("--completion", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--chunks",
        type=int,
        default=0,
        help="cut the head's vocabulary into this many chunks for the fused pass, all the rows "
        "in one block (16: as many as CUDA cuts Gemma 3's 262,144 tokens into at the step's "
        "1,016 target rows, head_ce_launches.py); default: the CPU's policy (here one chunk)",
    )
    args = parser.parse_args()

    import torch
    import transformers

    import bsloss.scorer.encoder
    from bsloss import BERTScoreLoss
    from bsloss.integrations.huggingface import BERTScoreTerm
    from bsloss.scorer.encoder import ScorerEncoder

    warnings.simplefilter("ignore")
    torch.set_num_threads(args.threads)
    env = harness.environment()
    bsloss.scorer.encoder.paced_by_host = lambda device: True
    if args.chunks:
        from bsloss.functional import fused_expectation

        width = -(-NARROW["vocab_size"] // args.chunks)
        fused_expectation._chunk_shape = lambda n, vocab, *a, **k: (n, width)
    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(**{**GEMMA3_270M, **NARROW})
    model = transformers.Gemma3ForCausalLM(config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.length))
    labels = ids.clone()
    labels[:, : args.length - args.completion] = -100
    with tempfile.TemporaryDirectory(prefix="bsloss-gemma-host-") as scratch:
        encoder = ScorerEncoder.from_pretrained(narrow_scorer(Path(scratch)), num_layers=6)
    refs = [f"reference sentence number {i} for the step" for i in range(args.batch)]
    bridge = synthetic_bridge(config.vocab_size, encoder.input_embeddings.num_embeddings)
    terms = []
    for compiled in (False, True):
        loss = BERTScoreLoss(model=encoder, bridge=bridge)
        if compiled:
            loss.compile()  # inductor, the default mode: its first step compiles (untimed)
        loss.encode_references(refs)
        terms.append(BERTScoreTerm(loss, ReferencesGiven(), weight=1.0, causal=True))
    steps = dict(
        zip(
            ("the model's own CE", "mixin fused CE only", "mixin fused CE + term"),
            gemma_steps(model, optimizer, ids, labels, terms[0], refs),
            strict=True,
        )
    )
    steps[COMPILED] = gemma_steps(model, optimizer, ids, labels, terms[1], refs)[2]
    steps[COMPILED]()  # compiles
    # (not the compiled step's: under the counter's dispatch mode Dynamo runs it eagerly)
    operations = {
        name: f"{sum(count(step).by_caller.values()):,}"
        for name, step in steps.items()
        if name != COMPILED
    }

    def repeated(step):
        def run():
            for _ in range(args.steps):
                value = step()
            return float(value)

        return run

    for step in steps.values():
        repeated(step)()  # warm
    timer = harness.AlternatingTimer(args.rounds, label="gemma step")
    series = timer.run({name: repeated(step) for name, step in steps.items()})
    anchor = series["the model's own CE"]
    rows = []
    for name, timed in series.items():
        low, high = harness.ratio_range(timed.seconds, anchor.seconds)
        rows.append(
            (
                name,
                f"{timed.median() / args.steps * 1e3:.2f}",
                f"{timed.median() / anchor.median():.3f}",
                f"{low:.3f}–{high:.3f}",
                operations.get(name, "–"),
            )
        )
    lines = [
        *harness.header_lines(env),
        f"- model: Gemma 3 270M's config, {config.num_hidden_layers} layers, "
        f"{config.hidden_size} wide, V {config.vocab_size:,}; {args.batch} x {args.length} "
        f"tokens, labels the last {args.completion}; scorer: random, MiniLM's vocabulary and 6 "
        f"layers, 32 wide, through the synthetic bridge; {args.steps} steps a round, "
        f"{args.rounds} rounds alternating, {args.threads} thread(s); the fused pass's "
        + (f"vocabulary in {args.chunks} chunks" if args.chunks else "chunks: the CPU's policy"),
        "",
        harness.markdown_table(
            ["step", "ms a step (median)", "/ model's step", "per-round range", "operations"],
            rows,
            "lrrrr",
        ),
    ]
    payload = {
        "seconds": {name: s.seconds for name, s in series.items()},
        "steps": args.steps,
        "operations": operations,
    }
    harness.write_outputs("\n".join(lines), args.out, args.json, payload)


if __name__ == "__main__":
    main()
