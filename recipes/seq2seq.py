"""The encoder-decoder collator: tokenised once per text, padded and shifted by transformers'
``DataCollatorForSeq2Seq``; teacher forcing over several label sets in one pass (the decoder-only
counterpart is :mod:`causal`).
"""

from __future__ import annotations

import copy

import torch
from examples import Example
from generators import decode_texts

from bsloss.integrations.candidates import generate_ids, generated_labels, pad_labels
from bsloss.integrations.lm_head import IGNORE_INDEX


def special_ids(model, tokenizer) -> tuple[int, int]:
    """(pad, eos) of a seq2seq generator."""
    config = model.config
    eos = config.eos_token_id if config.eos_token_id is not None else tokenizer.eos_token_id
    pad = config.pad_token_id if config.pad_token_id is not None else tokenizer.pad_token_id
    return pad, eos


class Collator:
    """Source ids (truncated to ``max_source_length``) and label ids ``[target pieces, eos]``.
    Each text is tokenised once per run; ``truncated`` counts the distinct texts the length
    limits cut. Padding (sources with the tokenizer's pad, labels with ``-100``, on the right)
    and the ``decoder_input_ids`` (the model's ``prepare_decoder_input_ids_from_labels``) are
    transformers' ``DataCollatorForSeq2Seq``."""

    def __init__(self, tokenizer, model, max_source_length: int, max_target_length: int):
        from transformers import DataCollatorForSeq2Seq

        self.tokenizer, self.model = tokenizer, model
        self.pad, self.eos = special_ids(model, tokenizer)
        self.max_source, self.max_target = max_source_length, max_target_length
        self.truncated = {"source": 0, "target": 0}
        self._cache: dict[str, dict[str, list[int]]] = {"source": {}, "target": {}}
        if tokenizer.padding_side != "right":  # the collator pads labels on the tokenizer's side
            tokenizer = copy.deepcopy(tokenizer)
            tokenizer.padding_side = "right"
        self.padding = DataCollatorForSeq2Seq(
            tokenizer, model=model, label_pad_token_id=IGNORE_INDEX
        )

    def _ids(self, texts: list[str], side: str) -> list[list[int]]:
        cache = self._cache[side]
        missing = [t for t in dict.fromkeys(texts) if t not in cache]
        if missing:
            source = side == "source"
            encoded = self.tokenizer(missing, add_special_tokens=source)["input_ids"]
            for text, ids in zip(missing, encoded, strict=True):
                if source and len(ids) > self.max_source:
                    ids = ids[: self.max_source - 1] + [ids[-1]]  # keep the closing special
                    self.truncated[side] += 1
                if not source:
                    if len(ids) > self.max_target - 1:
                        ids = ids[: self.max_target - 1]
                        self.truncated[side] += 1
                    ids = ids + [self.eos]
                cache[text] = ids
        return [cache[t] for t in texts]

    def __call__(self, examples: list[Example]) -> dict[str, torch.Tensor]:
        """``input_ids``, ``attention_mask``, ``labels`` and ``decoder_input_ids``."""
        sources = self._ids([e.source for e in examples], "source")
        labels = self._ids([e.target for e in examples], "target")
        features = [
            {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": target}
            for ids, target in zip(sources, labels, strict=True)
        ]
        return dict(self.padding(features))

    def training_batch(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        """Training rows (``source``, ``target``) as the trainer takes them: the batch of
        :meth:`__call__`."""
        return self([Example(row["source"], row["target"]) for row in rows])

    def content_mask(self, labels: torch.Tensor) -> torch.Tensor:
        """Positions that hold a target token (not padding, not the final eos)."""
        return (labels != IGNORE_INDEX) & (labels != self.eos) & (labels != self.pad)

    def teacher_forced_logits(self, model, batch, label_sets: list[torch.Tensor]) -> list:
        """Logits for several label sets of the same sources in one forward pass (one pass
        keeps DistributedDataParallel to one reduction per step)."""
        labels = torch.cat(pad_labels(label_sets))
        repeat = len(label_sets)
        logits = model(
            input_ids=batch["input_ids"].repeat(repeat, 1),
            attention_mask=batch["attention_mask"].repeat(repeat, 1),
            decoder_input_ids=self.model.prepare_decoder_input_ids_from_labels(labels=labels),
        ).logits
        parts = logits.chunk(repeat)
        return [part[:, : x.shape[1]] for part, x in zip(parts, label_sets, strict=True)]

    def generate(self, model, batch, max_new_tokens: int, **options) -> torch.Tensor:
        """The model's own output as labels-style ids."""
        sequences = generate_ids(
            model, batch["input_ids"], batch["attention_mask"], max_new_tokens, **options
        )
        return generated_labels(sequences, self.eos)

    def decode(self, labels: torch.Tensor) -> list[str]:
        return decode_texts(self.tokenizer, labels.clamp_min(0).masked_fill(labels < 0, self.pad))
