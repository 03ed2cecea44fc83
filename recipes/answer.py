"""A generator's answers to sources of your own, one a line: e.g. a study's committed adapter
translating your verses.

    python recipes/answer.py --config recipes/configs/bible-es-en-gemma-stage2.yaml \\
        --init_from recipes/results/study/mixin-seed0/sampled/adapter < verses.es > verses.en

The config says what the generator is, how it is prompted (``data``) and how it decodes
(``eval``: greedy or beam search, ``max_new_tokens``, ``batch_size``), as the recipes' held-out
evaluation does (:func:`evaluation.generate_answers`); ``--init_from`` a trained model or LoRA
adapter folder (``train.lora_rank`` its rank). Each answer is printed as its line is answered;
a source longer than ``data.max_source_length`` tokens is cut to its lead.
"""

from __future__ import annotations

import argparse
import sys

import torch
from config import ExistingFile, ExistingFolder, load_config
from evaluation import generate_answers
from examples import Example
from generators import load_generator, with_lora
from run import make_collator


def main(argv: list[str] | None = None, lines=None, out=None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", action=ExistingFile, required=True)
    parser.add_argument("--init_from", action=ExistingFolder, default=None)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args(argv)
    config = load_config(args.config, args.overrides)
    model, tokenizer = load_generator(config.model, args.init_from, None)
    model = with_lora(model, config.train.lora_rank, config.train.lora_alpha, args.init_from)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device).eval()
    collator = make_collator(config, model, tokenizer)
    sources = [line.rstrip("\n") for line in (sys.stdin if lines is None else lines)]
    out = sys.stdout if out is None else out
    answers, spec = [], config.eval
    for start in range(0, len(sources), spec.batch_size):
        chunk = [Example(s, "") for s in sources[start : start + spec.batch_size]]
        batch = generate_answers(
            model, collator, chunk, device, spec.max_new_tokens, spec.batch_size, spec.num_beams
        )
        for answer in batch:
            print(answer, file=out, flush=True)
        answers += batch
    return answers


if __name__ == "__main__":
    main()
