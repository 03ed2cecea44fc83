"""A scorer's tokenisation, as bert_score does it.

Every text is ``.strip()``-ed, byte-level BPE tokenizers (GPT-2, RoBERTa) get a prefix space,
the tokenizer's special tokens wrap the sentence (``[CLS] … [SEP]``, ``<s> … </s>``), and a text
longer than the model's maximum is truncated there; the caller warns, naming its own positions
(:meth:`ScorerTokenizer.truncation_message`), or keeps it whole for sliding windows.
"""

from __future__ import annotations

from collections.abc import Sequence

from bsloss._warnings import warn_user

__all__ = ["ScorerTokenizer", "is_byte_level"]

_BYTE_LEVEL_TOKENIZERS = {
    "GPT2Tokenizer",
    "GPT2TokenizerFast",
    "RobertaTokenizer",
    "RobertaTokenizerFast",
}
_HUGE_MAX_LENGTH = 1_000_000  # tokenizers without a limit report ~1e30


def is_byte_level(tokenizer) -> bool:
    """Whether ``tokenizer`` is a byte-level BPE (a word-initial token carries its space)."""
    return bool(_BYTE_LEVEL_TOKENIZERS & {c.__name__ for c in type(tokenizer).__mro__})


class ScorerTokenizer:
    """Text -> scorer token ids with special tokens, bert_score's way.

    Args:
        tokenizer: the scorer's Hugging Face tokenizer (``add_prefix_space=True`` when it is a
            byte-level BPE, see :func:`is_byte_level`).
        name: the scorer's name, for messages.
        max_positions: the model's ``max_position_embeddings``, the limit when the tokenizer
            declares none.

    >>> from transformers import AutoTokenizer
    >>> from bsloss.scorer.default import embedded_model_path
    >>> tokens = ScorerTokenizer(AutoTokenizer.from_pretrained(embedded_model_path()), "MiniLM")
    >>> tokens.prefix_ids, tokens.suffix_ids, tokens.max_length
    ([101], [102], 512)
    >>> tokens.encode(["  a cat "])
    ([[101, 1037, 4937, 102]], [])
    """

    def __init__(self, tokenizer, name: str, max_positions: int = 512):
        self.tokenizer = tokenizer
        self.name = name
        self.prefix_space = is_byte_level(tokenizer)
        limit = int(getattr(tokenizer, "model_max_length", _HUGE_MAX_LENGTH))
        self.max_length = max_positions if limit >= _HUGE_MAX_LENGTH else limit
        # The special tokens the tokenizer wraps every sentence with (CLS/SEP, BOS/EOS): they
        # weigh 0 in P and R but stay matchable, as in bert_score.
        self.special_token_ids: tuple[int, ...] = tuple(
            sorted(set(tokenizer("", add_special_tokens=True)["input_ids"]))
        )
        self.prefix_ids, self.suffix_ids = self._special_wrapping()

    def _special_wrapping(self) -> tuple[list[int], list[int]]:
        """The special ids the tokenizer puts before and after a sentence ([CLS] / [SEP])."""
        bare = self.tokenizer("a", add_special_tokens=False)["input_ids"]
        full = self.tokenizer("a", add_special_tokens=True)["input_ids"]
        for start in range(len(full) - len(bare) + 1):
            if full[start : start + len(bare)] == bare:
                return full[:start], full[start + len(bare) :]
        return [], []

    @property
    def pad_token_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return 0 if pad is None else int(pad)

    @property
    def content_length(self) -> int:
        """The most tokens a text may have between the special tokens."""
        return self.max_length - len(self.prefix_ids) - len(self.suffix_ids)

    def prepare(self, texts: Sequence[str]) -> list[str]:
        """The texts as the tokenizer should see them: stripped, with the prefix space of a
        byte-level BPE."""
        prepared = [text.strip() for text in texts]
        if self.prefix_space:
            prepared = [" " + text if text else text for text in prepared]
        return prepared

    def encode(
        self, texts: Sequence[str], truncate: bool = True
    ) -> tuple[list[list[int]], list[int]]:
        """Token ids with special tokens, and the indices of the texts longer than
        ``max_length``: truncated there (the caller warns, naming its own positions), or kept
        whole with ``truncate=False`` (for sliding windows)."""
        if not texts:  # a tokenizer given an empty batch fails inside transformers
            return [], []
        prepared = self.prepare(texts)
        # the ids alone: the token types and attention masks are Python lists as long as the
        # ids, which would cost as much again to build (the metric's host loop is this fast)
        ids_only = {"return_token_type_ids": False, "return_attention_mask": False}
        ids = self.tokenizer(
            prepared, add_special_tokens=True, truncation=False, verbose=False, **ids_only
        )["input_ids"]
        too_long = [i for i, row in enumerate(ids) if len(row) > self.max_length]
        if too_long and truncate:
            shortened = self.tokenizer(
                [prepared[i] for i in too_long],
                add_special_tokens=True,
                truncation=True,
                max_length=self.max_length,
                **ids_only,
            )["input_ids"]
            for i, row in zip(too_long, shortened, strict=True):
                ids[i] = row
        return [list(row) for row in ids], too_long

    def __call__(self, texts: Sequence[str], name: str = "texts") -> list[list[int]]:
        """Token ids with special tokens; truncation at ``max_length`` warns with the count,
        naming the first positions as ``name[i]``."""
        ids, too_long = self.encode(texts)
        if too_long:
            shown = ", ".join(f"{name}[{i}]" for i in too_long[:10])
            warn_user(self.truncation_message(len(too_long), len(texts), shown))
        return ids

    def truncation_message(self, count: int, total: int, where: str) -> str:
        return (
            f"{count} of {total} inputs are longer than {self.name}'s maximum of "
            f"{self.max_length} tokens and were truncated ({where}); pass long_inputs='window' "
            "to score them whole with overlapping windows."
        )
