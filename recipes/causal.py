"""Batches for a decoder-only generator: a prompt, then the completion it is trained to write.

Every batch is laid out as ``[left padding][prompt][completion][right padding]``: prompts are
left-padded to one width ``P``, so every completion starts at column ``P`` and the distributions
that predict it are the model's outputs at columns ``P - 1 … P + C - 2``. The model computes
logits for those ``C + 1`` columns only (``logits_to_keep``), never for the prompt: with a
262,144-token vocabulary the prompt's logits would be most of a step's memory. Position ids
count real tokens only, so left padding does not shift them (as ``generate`` does).

The collator has the seq2seq :class:`seq2seq.Collator`'s interface (``teacher_forced_logits``,
``generate``, ``decode``, ``content_mask``), so the recipes run either kind of model unchanged.
"""

from __future__ import annotations

import torch
from prompting import answer, lead, prompt_text, uses_chat_template

from bsloss.integrations.candidates import generate_ids, generated_labels, pad_labels
from bsloss.integrations.lm_head import IGNORE_INDEX


class CausalCollator:
    """Prompt ids (``prompt_ids``/``prompt_mask`` ``[B, P]``, left-padded) and completion labels
    (``labels`` ``[B, C]``: the target's tokens and eos, ``-100`` after). A source longer than
    ``max_source_length`` tokens is cut to its lead (counted in ``truncated``), a target to
    ``max_target_length - 1`` tokens before the eos. Padding is the tokenizer's (``pad``); a
    tokenizer without a pad token is given eos as one, as TRL's trainers do."""

    def __init__(
        self,
        tokenizer,
        model,
        task: str,
        max_source_length: int,
        max_target_length: int,
        prompt_format: str | None = None,
        chat_template: bool | str = "auto",
    ):
        self.tokenizer, self.task, self.prompt_format = tokenizer, task, prompt_format
        self.chat = uses_chat_template(tokenizer, chat_template)
        self.eos = tokenizer.eos_token_id
        if self.eos is None:
            self.eos = model.config.eos_token_id
        if self.eos is None:
            raise ValueError("the generator's tokenizer has no eos token to end completions with")
        if tokenizer.pad_token_id is None:  # pad with eos, as TRL's trainers do
            tokenizer.pad_token = tokenizer.convert_ids_to_tokens(self.eos)
        self.pad = tokenizer.pad_token_id
        self.max_source, self.max_target = max_source_length, max_target_length
        self.context = getattr(model.config, "max_position_embeddings", None)
        # A chat-formatted prompt ends where the answer starts; a plain one ends with ':'.
        self.separator = "" if self.chat else " "
        self.truncated = {"source": 0, "target": 0}
        self._prompts: dict[str, list[int]] = {}
        self._completions: dict[str, list[int]] = {}

    def prompt(self, source: str) -> str:
        """The prompt text for ``source``: its lead of ``max_source_length`` tokens, formatted."""
        return self._prompt_and_cut(source)[0]

    def _prompt_and_cut(self, source: str) -> tuple[str, bool]:
        kept = lead(self.tokenizer, source, self.max_source)
        text = prompt_text(self.tokenizer, self.task, kept, self.prompt_format, self.chat)
        return text, kept != source

    def _prompt(self, source: str) -> list[int]:
        if source not in self._prompts:
            text, cut = self._prompt_and_cut(source)
            self.truncated["source"] += cut
            self._prompts[source] = self.tokenizer(text)["input_ids"]
        return self._prompts[source]

    def _completion(self, target: str) -> list[int]:
        if target not in self._completions:
            ids = self.tokenizer(self.separator + target, add_special_tokens=False)["input_ids"]
            if len(ids) > self.max_target - 1:
                ids = ids[: self.max_target - 1]
                self.truncated["target"] += 1
            self._completions[target] = ids + [self.eos]
        return self._completions[target]

    def _prompt_ids(self, sources: list[str]) -> list[list[int]]:
        prompts = [self._prompt(source) for source in sources]
        width = max(len(p) for p in prompts)
        if self.context is not None and width + self.max_target > self.context:
            raise ValueError(
                f"a prompt of {width} tokens plus data.max_target_length={self.max_target} "
                f"exceeds the model's context of {self.context}; lower data.max_source_length"
            )
        return prompts

    def training_batch(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        """Training rows (``source``, ``target``) as a language model's batch, as a trainer
        takes it: ``input_ids`` each row's prompt then its completion, right-padded, with
        ``attention_mask``, and ``labels`` (``-100`` on the prompt and the padding)."""
        prompts = self._prompt_ids([row["source"] for row in rows])
        completions = [self._completion(row["target"]) for row in rows]
        padded = self._pad([p + c for p, c in zip(prompts, completions, strict=True)], "right")
        width = padded["input_ids"].shape[1]
        labels = [
            [IGNORE_INDEX] * len(p) + c + [IGNORE_INDEX] * (width - len(p) - len(c))
            for p, c in zip(prompts, completions, strict=True)
        ]
        return {
            "input_ids": padded["input_ids"],
            "attention_mask": padded["attention_mask"],
            "labels": torch.tensor(labels),
        }

    def __call__(self, examples) -> dict[str, torch.Tensor]:
        prompts = self._pad(self._prompt_ids([e.source for e in examples]), "left")
        completions = self._pad([self._completion(e.target) for e in examples], "right")
        labels = completions["input_ids"].masked_fill(
            completions["attention_mask"] == 0, IGNORE_INDEX
        )
        return {
            "prompt_ids": prompts["input_ids"],
            "prompt_mask": prompts["attention_mask"],
            "labels": labels,
        }

    def _pad(self, rows: list[list[int]], side: str):
        """The tokenizer's padding of ``rows`` on ``side``: ids and the 0/1 mask."""
        return self.tokenizer.pad(
            {"input_ids": rows}, padding_side=side, return_attention_mask=True, return_tensors="pt"
        )

    def content_mask(self, labels: torch.Tensor) -> torch.Tensor:
        """Positions that hold a target token (not padding, not the final eos)."""
        return (labels != IGNORE_INDEX) & (labels != self.eos) & (labels != self.pad)

    def teacher_forced_logits(self, model, batch, label_sets: list[torch.Tensor]) -> list:
        """Logits ``[B, C_i, V]`` predicting each label set's completion after the batch's
        prompts, all sets in one forward pass (one DDP reduction per step)."""
        completions = torch.cat(pad_labels(label_sets))
        span = completions.shape[1]
        repeat = len(label_sets)
        completion_mask = (completions != IGNORE_INDEX).long()
        input_ids = torch.cat(
            [batch["prompt_ids"].repeat(repeat, 1), completions.clamp_min(0)], dim=1
        )
        attention_mask = torch.cat([batch["prompt_mask"].repeat(repeat, 1), completion_mask], 1)
        position_ids = (attention_mask.cumsum(1) - 1).clamp_min(0)
        logits = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            logits_to_keep=span + 1,
            use_cache=False,
        ).logits[:, :span]
        return [
            part[:, : x.shape[1]] for part, x in zip(logits.chunk(repeat), label_sets, strict=True)
        ]

    @torch.no_grad()
    def generate(
        self,
        model,
        batch,
        max_new_tokens: int,
        *,
        sample: bool = False,
        top_k: int = 0,
        num_beams: int = 1,
        streamer=None,
    ) -> torch.Tensor:
        """The model's own completions as labels-style ids (``-100`` after the first eos);
        ``streamer``: ``model.generate``'s (the evaluation's progress bar)."""
        sequences = generate_ids(
            model, batch["prompt_ids"], batch["prompt_mask"], max_new_tokens, sample=sample,
            top_k=top_k, num_beams=num_beams, pad_token_id=self.pad, eos_token_id=self.eos,
            streamer=streamer,
        )  # fmt: skip
        # generated_labels drops its first column (a seq2seq decoder start): here the last
        # prompt column
        return generated_labels(sequences[:, batch["prompt_ids"].shape[1] - 1 :], self.eos)

    def decode(self, labels: torch.Tensor) -> list[str]:
        """Answers of completion ids: the text's first line (a base model goes on after it)."""
        rows = [[t for t in row.tolist() if t >= 0] for row in labels]
        texts = self.tokenizer.batch_decode(rows, skip_special_tokens=True)
        return [answer(t) for t in texts]
