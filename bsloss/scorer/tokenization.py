"""A scorer's tokenisation, as bert_score does it.

Every text is ``.strip()``-ed, byte-level BPE tokenizers (GPT-2, RoBERTa) get a prefix space,
the tokenizer's special tokens wrap the sentence (``[CLS] … [SEP]``, ``<s> … </s>``), and a text
longer than the model's maximum is truncated there; the caller warns, naming its own positions
(:meth:`ScorerTokenizer.truncation_message`), or keeps it whole for sliding windows.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from bsloss._warnings import warn_user

__all__ = ["ScorerTokenizer", "is_byte_level"]

_BYTE_LEVEL_TOKENIZERS = {
    "GPT2Tokenizer",
    "GPT2TokenizerFast",
    "RobertaTokenizer",
    "RobertaTokenizerFast",
}
_HUGE_MAX_LENGTH = 1_000_000  # tokenizers without a limit report ~1e30
# Texts per thread of one tokenizer call: below this, one thread (a thread's start and its share
# of the ids' conversion cost more than they save); above it, up to _MAX_THREADS threads.
_TEXTS_PER_THREAD = 1024
_MAX_THREADS = 4


def is_byte_level(tokenizer) -> bool:
    """Whether ``tokenizer`` is a byte-level BPE (a word-initial token carries its space)."""
    return bool(_BYTE_LEVEL_TOKENIZERS & {c.__name__ for c in type(tokenizer).__mro__})


class ScorerTokenizer:
    """Text -> scorer token ids with special tokens, bert_score's way.

    Args:
        tokenizer: the scorer's Hugging Face tokenizer (``add_prefix_space=True`` when it is a
            byte-level BPE, see :func:`is_byte_level`).
        name: the scorer's name, for messages.
        max_positions: the most tokens the model's position table takes
            (:func:`~bsloss.scorer.encoder.usable_positions`: ``max_position_embeddings``, less
            the offset of the RoBERTa layout), the limit when the tokenizer declares none.
        absolute_positions: the model has a position table (BERT, RoBERTa, MPNet: not
            DeBERTa-v3's relative positions): ``max_positions`` also caps a larger limit the
            tokenizer declares, with a warning.

    >>> from transformers import AutoTokenizer
    >>> from bsloss.scorer.default import embedded_model_path
    >>> tokens = ScorerTokenizer(AutoTokenizer.from_pretrained(embedded_model_path()), "MiniLM")
    >>> tokens.prefix_ids, tokens.suffix_ids, tokens.max_length
    ([101], [102], 512)
    >>> tokens.encode(["  a cat "])
    ([[101, 1037, 4937, 102]], [])
    """

    def __init__(
        self, tokenizer, name: str, max_positions: int = 512, absolute_positions: bool = False
    ):
        self.tokenizer = tokenizer
        self.name = name
        if not hasattr(tokenizer, "model_max_length"):
            limit = _HUGE_MAX_LENGTH  # no limit declared
        elif tokenizer.model_max_length is None:
            # transformers' own call then fails on every text ("'>' not supported between
            # instances of 'int' and 'NoneType'"): say what to set instead
            raise ValueError(
                f"the {name} tokenizer's model_max_length is None, which its own call cannot "
                f"compare a length with; set it to a number of tokens (1e30, what "
                f"transformers loads for no limit, takes the model's {max_positions} positions)"
            )
        else:
            limit = int(tokenizer.model_max_length)
        self.max_length = max_positions if limit >= _HUGE_MAX_LENGTH else limit
        if absolute_positions and self.max_length > max_positions:
            # a longer text would index past the position table inside the model
            warn_user(
                f"the {name} tokenizer declares a model_max_length of {limit} tokens, but the "
                f"model's position table takes {max_positions}: texts are cut (or windowed) at "
                f"{max_positions}"
            )
            self.max_length = max_positions
        self._read_tokenizer()
        self._threads = max(1, min(_MAX_THREADS, os.cpu_count() or 1))
        self._pool: ThreadPoolExecutor | None = None
        self._pool_pid = 0  # the process that made the pool: a forked child makes its own

    def _read_tokenizer(self) -> None:
        """What this object takes from the tokenizer, read again when the tokenizer changed
        (:meth:`_ids`): its special tokens, its wrapping, its private Rust copy."""
        tokenizer = self.tokenizer
        # The special tokens the tokenizer wraps every sentence with (CLS/SEP, BOS/EOS): they
        # weigh 0 in P and R but stay matchable, as in bert_score.
        self.special_token_ids: tuple[int, ...] = tuple(
            sorted(set(tokenizer("", add_special_tokens=True)["input_ids"]))
        )
        self.prefix_ids, self.suffix_ids = self._special_wrapping()
        # bert_score gives a byte-level BPE's text a leading space (its first word then reads
        # as one after a space, "Ġword"); a tokenizer set with add_prefix_space gives it one
        # itself, to each piece between special or added tokens, so writing another one
        # would make a text that starts with such a token begin with a lone "Ġ" (audit h21)
        self.prefix_space = is_byte_level(tokenizer) and not self._adds_prefix_space()
        self._backend = _call_free_backend(tokenizer)
        self._state = _tokenizer_state(tokenizer)

    def _adds_prefix_space(self) -> bool:
        bare = self.tokenizer("a", add_special_tokens=False)["input_ids"]
        return bare == self.tokenizer(" a", add_special_tokens=False)["input_ids"]

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_pool": None}  # threads are not copied or pickled

    def state(self) -> tuple:
        """What of the tokenizer decides its ids now, for a cache of what they give (the
        references' embeddings) to start over when tokens are added or a setting changes; a
        slow tokenizer by its size and ``split_special_tokens``."""
        split = bool(getattr(self.tokenizer, "split_special_tokens", False))
        return _tokenizer_state(self.tokenizer), len(self.tokenizer), split

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
        self, texts: Sequence[str], truncate: bool = True, threads: int | None = None
    ) -> tuple[list[list[int]], list[int]]:
        """Token ids with special tokens, and the indices of the texts longer than
        ``max_length``: truncated there (the caller warns, naming its own positions), or kept
        whole with ``truncate=False`` (for sliding windows). ``threads``: at most this many
        threads tokenise a large batch of a fast tokenizer (default: up to 4, as the machine
        has cores)."""
        if isinstance(texts, (str, bytes)):  # would be tokenised one character a row
            raise TypeError(
                f"texts must be a sequence of strings, got a single {type(texts).__name__}"
            )
        if not texts:  # a tokenizer given an empty batch fails inside transformers
            return [], []
        prepared = self.prepare(texts)
        ids = self._ids(prepared, self._threads if threads is None else threads)
        too_long = [i for i, row in enumerate(ids) if len(row) > self.max_length]
        if too_long and truncate:
            cut = [self._truncated(ids[i]) for i in too_long]
            if any(row is None for row in cut):  # not wrapped as the tokenizer wraps "a"
                cut = self.tokenizer(
                    [prepared[i] for i in too_long],
                    add_special_tokens=True,
                    truncation=True,
                    max_length=self.max_length,
                    return_token_type_ids=False,
                    return_attention_mask=False,
                )["input_ids"]
            for i, row in zip(too_long, cut, strict=True):
                ids[i] = row
        return ids, too_long

    def _truncated(self, row: list[int]) -> list[int] | None:
        """``row`` cut to ``max_length`` as the Hugging Face call truncates a single text: its
        content cut on the tokenizer's ``truncation_side``, the special tokens kept; ``None``
        where the row is not wrapped as :meth:`_special_wrapping` found. From the ids already
        made, not by a second call: that call re-configures the tokenizer the caller shares (a
        call of the caller's on another thread in between left rows uncut, audit h21) and
        tokenises the whole text again."""
        prefix, suffix = self.prefix_ids, self.suffix_ids
        if not (prefix or suffix) and self.special_token_ids:
            return None  # it wraps texts, but not found around "a": its call knows how
        end = len(row) - len(suffix)
        if row[: len(prefix)] != prefix or row[end:] != suffix or end < len(prefix):
            return None
        content, keep = row[len(prefix) : end], max(0, self.content_length)
        left = getattr(self.tokenizer, "truncation_side", "right") == "left"
        kept = content[len(content) - keep :] if left else content[:keep]
        return [*prefix, *kept, *suffix]

    def _ids(self, prepared: list[str], threads: int) -> list[list[int]]:
        """Each prepared text's ids with special tokens, untruncated.

        Through the Hugging Face call, or, for a fast tokenizer, straight through a private
        copy of its Rust tokenizer (:func:`_call_free_backend`): the same ids without the
        call's per-text conversions, and, for a large batch, in pieces on a few threads. The
        Rust code leaves Python's lock while it works, so the pieces run side by side even
        where the library's own batch parallelism is off (``TOKENIZERS_PARALLELISM=false``, or a
        process forked after it was used), and the caller's thread is free meanwhile: on a GPU
        the metric's first chunk was tokenised before the encoder could start
        (``benchmarks/README.md``, "Runs 4-6"; ``benchmarks/tokenization.py``).
        """
        if self._backend is None:
            return self.tokenizer(
                prepared,
                add_special_tokens=True,
                truncation=False,
                verbose=False,
                # the ids alone: token types and masks would cost as much again to build
                return_token_type_ids=False,
                return_attention_mask=False,
            )["input_ids"]
        if _tokenizer_state(self.tokenizer) != self._state:  # tokens added, a setting changed
            self._read_tokenizer()
            if self._backend is None:
                return self._ids(prepared, threads)
        threads = min(threads, len(prepared) // _TEXTS_PER_THREAD)
        if threads <= 1:
            return [encoding.ids for encoding in self._backend.encode_batch(prepared)]
        if self._pool is None or self._pool_pid != os.getpid():
            # in a forked child (a DataLoader worker) the parent's threads do not exist
            self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="bsloss-tokens")
            self._pool_pid = os.getpid()
        size = -(-len(prepared) // threads)
        pieces = [prepared[start : start + size] for start in range(0, len(prepared), size)]
        encoded = self._pool.map(self._backend.encode_batch, pieces)
        return [encoding.ids for piece in encoded for encoding in piece]

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


def _call_free_backend(tokenizer):
    """A private copy of a fast tokenizer's Rust tokenizer set as the Hugging Face call with
    ``add_special_tokens=True, truncation=False`` sets it (no truncation, no padding, the same
    special-token splitting), so that its ``encode_batch`` gives that call's ids; ``None`` where
    the call is not that: a slow tokenizer, or a class that changes how it encodes.

    A copy because the Hugging Face call re-configures its own Rust tokenizer on every call
    (truncation for the texts that are too long, padding) and refuses concurrent calls; this
    one is never changed after it is made, so threads may share it.
    """
    from transformers import PreTrainedTokenizerFast

    base = PreTrainedTokenizerFast
    if not isinstance(tokenizer, base):
        return None
    # a class that changes the text or the ids in one of these (LayoutLM, LUKE) or in the call
    # itself (SeamlessM4T, UDOP, a user's subclass) would have its change skipped
    for method in ("__call__", "_encode_plus", "_batch_encode_plus"):  # 5 and 4
        if getattr(type(tokenizer), method, None) is not getattr(base, method, None):
            return None
    from tokenizers import Tokenizer

    try:
        backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    except Exception:  # a custom Python piece (RoFormer's Jieba pre-tokenizer) has no JSON form
        return None
    backend.no_truncation()
    backend.no_padding()
    if hasattr(backend, "encode_special_tokens"):
        backend.encode_special_tokens = bool(getattr(tokenizer, "split_special_tokens", False))
    return backend


def _tokenizer_state(tokenizer) -> tuple | None:
    """What of a fast tokenizer decides its ids and may change after a scorer was built: its
    vocabulary with the tokens added to it (an existing token added again, as BERT's
    ``[unused1]`` made special, leaves the size alone but is split off from then on), special
    tokens' splitting, its post-processor (``add_eos_token`` rebuilds it); ``None`` for a slow
    tokenizer (its call is used every time). Reading the added tokens costs ~2 us with a
    BERT's 5 and ~20 ms with Gemma 3's 6,384, once per :meth:`ScorerTokenizer.encode`."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    processor = backend.post_processor
    return (
        backend.get_vocab_size(True),
        len(backend.get_added_tokens_decoder()),
        bool(getattr(tokenizer, "split_special_tokens", False)),
        None if processor is None else processor.__getstate__(),
    )
