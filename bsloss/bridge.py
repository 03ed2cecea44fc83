r"""Vocabulary bridge: score a generator whose tokenizer is not the scorer's.

A Gemma, Llama, T5 or BART generator scored by a BERT, RoBERTa or MPNet scorer emits
distributions over its own vocabulary. Two modes connect them
(``BERTScoreLoss(bridge=Bridge(tokenizer, mode=...))``).

**The bridge table** (both modes). Every generator token :math:`v` is mapped once to the scorer
pieces its text tokenises into, respecting word boundaries (SentencePiece ``▁``, byte-level BPE
``Ġ``, WordPiece ``##`` continuations): :math:`\pi(v) = (\pi_1, \dots, \pi_{n_v})`. Its bridge
embedding and importance weight are the means

.. math::
    T[v] = \frac{1}{n_v}\sum_{k} E[\pi_k(v)], \qquad \omega[v] = \frac{1}{n_v}\sum_k w[\pi_k(v)]

(:math:`E`, :math:`w`: the scorer's input-embedding table and token weights; :math:`T[v] = 0`,
:math:`\omega[v] = 0` for special tokens, those that ``decode(skip_special_tokens=True)`` drops,
and for text the scorer drops). The piece lists are stored flat (CSR: ``offsets [V+1]``,
``flat [N]``) and :math:`T` is one ``embedding_bag`` over them, so building costs
:math:`O(V d)` memory and time; the tokenisation is batched. The lists are cached on disk
(safetensors), keyed by the contents of both tokenizers (vocabulary, normaliser, pre-tokenizer,
decoder, special tokens), not by their names.

**Word starts.** A token with no word-start marker is a continuation (``"A"`` -> ``##a``), yet
the decoded text starts a word with it at a candidate's first position, after whitespace and,
for a WordPiece scorer, after punctuation it splits off. Each token's pieces as a word start,
:math:`\pi^{s}(v)`, give a second table :math:`T^{s}`, :math:`\omega^{s}`, taken at those
positions (:func:`word_start_positions`, from the most probable tokens, as the decoded text).

**bridge_mode="average"**: candidate position :math:`t` gets the expected bridge embedding
:math:`e_t = \sum_v p_t(v) T[v]` (weight :math:`\sum_v p_t(v)\,\omega[v]`; :math:`T^{s}`,
:math:`\omega^{s}` where a word starts), one scorer position per generator position. It
approximates the metric wherever a token is several scorer pieces.

**bridge_mode="retokenize"** (exact): the forward pass scores the decoded candidate text. The
candidate tokens :math:`y_t = \arg\max_v p_t(v)` (the straight-through / Gumbel-sampled tokens when
those options are on) are decoded with the generator's tokenizer
(``decode(y, skip_special_tokens=True)``), the text is tokenised by the scorer's own tokenizer
exactly as :class:`~bsloss.BERTScorer` tokenises it, and the scorer is fed those pieces
:math:`q_1, \dots, q_m`: the loss value is the F_BERT of the decoded text.

Its gradient is not the straight-through of the decoded pieces. That estimator (each scorer
piece aligned by character offsets to the generator positions covering it, the backward pass that
of their expected bridge embeddings, :math:`x_j = E[q_j] + \bar e_j - \operatorname{sg}(\bar e_j)`)
linearises the scorer at the one-hot input: on Gemma 3 270M it did not descend (12 loss-only
steps on a fixed batch: loss 0.427 -> 0.392, no trend, CE 3.0 -> 5.9), because moving the
*expected* embedding toward :math:`-\nabla` is done most cheaply by spreading probability over
many tokens, which changes the soft point the gradient describes but not the argmax text that is
scored (``benchmarks/training_signal.py``). Instead the loss is the exact value with the gradient
of the average mode's score (a straight-through at the level of the score):

.. math::  F = F_{\text{text}}(\hat y) + F_{\text{avg}}(p) - \operatorname{sg}(F_{\text{avg}}(p))

where :math:`F_{\text{text}}` is the score of the decoded text (computed without gradient) and
:math:`F_{\text{avg}}` that of the expected bridge embeddings, one scorer position per generator
position: a smooth function of the distributions whose descent lowers the decoded text's F_BERT
(same batch: 0.397 -> 0.26 in 2 steps). The extra cost is one no-grad scorer pass.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from bsloss._warnings import warn_user
from bsloss.distributions import augment_table

__all__ = [
    "Bridge",
    "VocabularyBridge",
    "BridgeMode",
    "SharedVocabulary",
    "AverageBridge",
    "RetokenizeBridge",
    "resolve_bridge_mode",
    "Retokenizer",
    "RetokenizedBatch",
    "special_token_ids",
    "token_convention",
    "tokenizer_fingerprint",
    "word_start_positions",
    "byte_character_positions",
    "ByteCharacters",
]

# v4: piece lists built without the scorer tokenizer's leftover padding (v3 may hold padded ones);
# v5 (never released): each token's pieces as a word start too, and the tokens after which a
# word starts; v6: and the byte tokens with the characters they spell
_CACHE_FORMAT = "v6-csr"


def token_convention(tokenizer, vocab: dict[str, int] | None = None) -> str:
    """How a vocabulary marks words, read off it: ``"sentencepiece"`` (``▁`` starts a word),
    ``"byte_level"`` (``Ġ`` does), ``"wordpiece"`` (``##`` continues one), or ``"decoded"``
    where none of those marks 1% of the tokens (a BPE that marks word ends, ``cat</w>``, as
    FSMT, XLM and CLIP do; a vocabulary of whole words): its tokens' texts and word ends are
    then read from the tokenizer's decoder. Taken for SentencePiece until audit h26, such a
    vocabulary's ``cat</w>`` was bridged as ``##cat < / w >`` (one-hot "the cat sat on the
    mat" against itself: F 0.047 in the average mode)."""
    vocab = tokenizer.get_vocab() if vocab is None else vocab
    counts = {
        "sentencepiece": sum(t.startswith("\u2581") for t in vocab),
        "byte_level": sum(t.startswith("\u0120") for t in vocab),
        "wordpiece": sum(t.startswith("##") for t in vocab),
    }
    best = max(counts, key=counts.get)
    return best if counts[best] * 100 >= len(vocab) else "decoded"


# Settings of the serialised Rust tokenizer that any ordinary call leaves behind
# (``tokenizer(texts, padding=True, truncation=True)`` switches them on and leaves them so): they
# change no token's pieces, and keying on them rebuilt the same bridge into another cache file.
_CALL_SETTINGS = ("padding", "truncation")


def _pipeline_without_call_settings(serialised: str) -> str:
    """A fast tokenizer's serialised JSON less its leading ``version``, ``truncation`` and
    ``padding`` fields. The tokenizers library writes its fields in a fixed order, those three
    first, then ``added_tokens``: cutting the text there costs nothing, where parsing and
    re-serialising Gemma's 12 MB pipeline took ~5 s a call. Parsed only when that layout is not
    found."""
    start = serialised.find('"added_tokens"')
    head = serialised[:start] if start >= 0 else ""
    if start >= 0 and '"vocab"' not in head and '"model"' not in head:
        return serialised[start:]
    pipeline = json.loads(serialised)
    for setting in _CALL_SETTINGS:
        pipeline.pop(setting, None)
    return json.dumps(pipeline, sort_keys=True)


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of what decides a tokenizer's output: for a fast tokenizer its serialised pipeline
    (vocabulary, merges, normaliser, pre-tokenizer, post-processor, decoder, added tokens) less
    the padding and truncation settings of its last call; for a slow one its vocabulary and init
    options. The class and the special tokens are always included."""
    digest = hashlib.sha256()
    digest.update(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        digest.update(_pipeline_without_call_settings(backend.to_str()).encode())
    else:
        digest.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
        options = {
            k: v
            for k, v in sorted(getattr(tokenizer, "init_kwargs", {}).items())
            if isinstance(v, (str, int, float, bool, type(None)))
        }
        digest.update(json.dumps(options, sort_keys=True).encode())
    special = {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())}
    digest.update(json.dumps([special, sorted(special_token_ids(tokenizer))]).encode())
    return digest.hexdigest()


def special_token_ids(tokenizer) -> set[int]:
    """Ids that ``decode(..., skip_special_tokens=True)`` drops: the named special tokens and
    every added token flagged special (Gemma has 6,249: ``<start_of_turn>``, ``<unusedN>``...)."""
    ids = set(tokenizer.all_special_ids)
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    ids.update(index for index, token in decoder.items() if getattr(token, "special", False))
    return ids


def _surface(tokenizer, convention: str, token: str) -> tuple[str, bool, bool]:
    """(text, starts a word, ends in whitespace) of one generator token."""
    if convention == "wordpiece":
        return (token[2:], False, False) if token.startswith("##") else (token, True, False)
    if convention == "sentencepiece" and not token.startswith("<0x"):
        # Every ▁ is a space (Gemma has tokens of several spaces, "▁▁▁"), not only the first.
        text = token.replace("\u2581", " ")
    else:
        text = tokenizer.convert_tokens_to_string([token])
    ends = text[-1:].isspace()
    if convention == "decoded" and text.strip():
        # a word's last token: the decoder puts a space between two copies of it ("cat</w>"
        # twice decodes as "cat cat"; a word-level vocabulary's words are all so), where a
        # piece inside a word is glued to the next ("ca" "ca": "caca")
        ends = ends or tokenizer.convert_tokens_to_string([token, token]) != text + text
    return text.strip(), text[:1].isspace(), ends


class _ScorerPieces:
    """Tokenises the texts of many generator tokens into scorer ids, as word starts or
    continuations, with batched tokenizer calls."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.vocab = tokenizer.get_vocab()
        self.convention = token_convention(tokenizer, self.vocab)
        self.backend = None
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:
            # A copy without padding or truncation: the shared Rust tokenizer keeps whatever
            # padding the last transformers call set (tokenizer(texts, padding=True) leaves it
            # on), which would pad every piece list to the batch's longest.
            self.backend = type(backend).from_str(backend.to_str())
            self.backend.no_padding()
            self.backend.no_truncation()

    def _batch(self, texts: list[str]) -> list[list[int]]:
        if not texts:
            return []
        if self.backend is None:  # a slow tokenizer
            return self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        # Straight to the Rust tokenizer: transformers' per-encoding conversion costs ~35 us a
        # text, most of the build time for 262k tokens.
        backend = self.backend
        encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
        return [encoding.ids for encoding in encode(texts, add_special_tokens=False)]

    def __call__(self, items: list[tuple[str, bool]]) -> list[list[int]]:
        """Scorer ids of each ``(text, starts a word)``."""
        out: list[list[int]] = [[] for _ in items]
        starts = [i for i, (text, start) in enumerate(items) if text and start]
        glued = [i for i, (text, start) in enumerate(items) if text and not start]
        for i, ids in zip(starts, self._batch([items[i][0] for i in starts]), strict=True):
            out[i] = list(ids)
        if self.convention == "wordpiece":
            self._wordpiece_continuations([items[i][0] for i in glued], glued, out)
        elif self.convention == "byte_level":
            # " ." is its own pre-token in GPT-2's split, so the text after it gets no "Ġ".
            marker = self.tokenizer(" .", add_special_tokens=False)["input_ids"]
            texts = [" ." + items[i][0] for i in glued]
            for i, ids in zip(glued, self._batch(texts), strict=True):
                out[i] = ids[len(marker) :] if ids[: len(marker)] == marker else list(ids)
        else:
            for i, ids in zip(glued, self._batch([items[i][0] for i in glued]), strict=True):
                ids = list(ids)
                if self.convention == "sentencepiece" and ids:
                    first = self.tokenizer.convert_ids_to_tokens(ids[0])
                    if first == "\u2581":
                        ids = ids[1:]
                    elif first.startswith("\u2581") and first[1:] in self.vocab:
                        ids[0] = self.vocab[first[1:]]
                out[i] = ids
        return out

    def opens_word(self, items: list[tuple[str, bool]]) -> list[bool]:
        """Whether the scorer starts a new word right after each ``(text, ends in whitespace)``:
        after whitespace; for a WordPiece scorer also after what its pre-tokenizer splits off
        (punctuation, CJK), where the next text is a word of its own, not a ``##`` piece. (After
        punctuation a byte-level or SentencePiece scorer's next piece carries no space marker:
        the text's continuation pieces, which the table already holds.)"""
        opens = [space for _, space in items]
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if self.convention != "wordpiece" or backend is None or backend.pre_tokenizer is None:
            return opens
        for index, (text, space) in enumerate(items):
            # ASCII letters and digits never end a WordPiece word: no tokenizer call for them
            if space or not text or (text[-1].isascii() and text[-1].isalnum()):
                continue
            normalized = backend.normalizer.normalize_str(text) if backend.normalizer else text
            if not normalized.strip():  # text the scorer drops (a combining mark): no boundary
                continue
            words = backend.pre_tokenizer.pre_tokenize_str(normalized + "a")
            end = len(normalized)
            opens[index] = bool(words) and words[-1] == ("a", (end, end + 1))
        return opens

    def character_kinds(self) -> tuple[Tensor, Tensor]:
        """The assigned non-ASCII code points after which the scorer starts a new word
        (:meth:`opens_word` of the character alone), and those its normaliser drops: int32
        tensors (~1 s for Unicode's ~145k assigned characters)."""
        import unicodedata

        chars = [
            chr(point)
            for point in range(0x80, 0x110000)
            if unicodedata.category(chr(point)) not in ("Cn", "Cs", "Co")
        ]
        opens = self.opens_word([(char, char.isspace()) for char in chars])
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        normalizer = None if backend is None else backend.normalizer
        dropped = [
            not char.isspace() and normalizer is not None and not normalizer.normalize_str(char)
            for char in chars
        ]
        points = torch.tensor([ord(char) for char in chars], dtype=torch.int32)
        return points[torch.tensor(opens)], points[torch.tensor(dropped)]

    def _wordpiece_continuations(self, texts: list[str], where: list[int], out) -> None:
        """Scorer pieces of texts glued to the end of a word: the part the scorer's
        pre-tokenizer keeps in the same word becomes ``##`` pieces (greedy longest match, as
        WordPiece does); what it splits off (punctuation, a new word) starts new words. The
        texts that need the scorer's own tokenizer are collected and tokenised in one call."""
        backend = self.tokenizer.backend_tokenizer
        deferred: list[tuple[int, str, bool]] = []  # (index, text, replaces the row)
        for index, text in zip(where, texts, strict=True):
            normalized = backend.normalizer.normalize_str(text) if backend.normalizer else text
            words = backend.pre_tokenizer.pre_tokenize_str("a" + normalized)
            if not words or len(words[0][0]) == 1:  # nothing glued to the word: a new word
                deferred.append((index, normalized, True))
                continue
            glued, end = words[0][0][1:], words[0][1][1] - 1
            ids, start = [], 0
            while start < len(glued):
                for stop in range(len(glued), start, -1):
                    piece = self.vocab.get("##" + glued[start:stop])
                    if piece is not None:
                        ids.append(piece)
                        start = stop
                        break
                else:  # no ## piece covers it: fall back to the scorer's own split
                    deferred.append((index, normalized, True))
                    break
            else:
                out[index] = ids
                rest = normalized[end:]
                if rest.strip():
                    deferred.append((index, rest, False))
        tokenised = self._batch([text for _, text, _ in deferred])
        for (index, _, replace), ids in zip(deferred, tokenised, strict=True):
            out[index] = list(ids) if replace else out[index] + list(ids)


@dataclass
class ByteCharacters:
    """The generator's tokens that are one byte of a multi-byte UTF-8 character (SentencePiece
    byte fallback ``<0xC2>``, a byte-level BPE's single-byte tokens), and how the scorer treats
    the characters they spell. Such a token makes no scorer piece alone (half a character), yet
    the character is in the decoded text: Gemma spells the no-break space, the ideographic
    space and ~160 punctuation marks so. :func:`byte_character_positions` rebuilds each
    character from its bytes to decide whether a word starts after it.

    Attributes:
        values: ``[V_gen]`` int16, the byte (0x80-0xFF) of each such token, -1 for the others.
        opening: int32 code points (>= 0x80) after which the scorer starts a new word.
        dropped: int32 code points (>= 0x80) the scorer's normaliser drops (no word boundary).
    """

    values: Tensor
    opening: Tensor
    dropped: Tensor

    @classmethod
    def none(cls, size: int) -> ByteCharacters:
        empty = torch.zeros(0, dtype=torch.int32)
        return cls(torch.full((size,), -1, dtype=torch.int16), empty, empty)

    @property
    def present(self) -> bool:
        return bool(len(self.values)) and int(self.values.max()) >= 0

    def kinds(self) -> Tensor:
        """``[0x110000]`` int8 over code points: 1 opens a word, 2 dropped, 0 glued."""
        kinds = torch.zeros(0x110000, dtype=torch.int8)
        kinds[self.opening.long()] = 1
        kinds[self.dropped.long()] = 2
        return kinds


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte: printable bytes as themselves, the others
    shifted past 255 (``Ġ`` is the space, 0x20)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    alphabet, shifted = {chr(b): b for b in printable}, 0
    for byte in range(256):
        if byte not in alphabet.values():
            alphabet[chr(256 + shifted)] = byte
            shifted += 1
    return alphabet


def _byte_value(token: str, convention: str, alphabet: dict[str, int]) -> int:
    """The byte (>= 0x80) a token is, or -1."""
    if convention == "sentencepiece":
        # an added token may look like one ("<0xZZ>"): only two hex digits make a byte
        if re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", token):
            value = int(token[3:5], 16)
            return value if value >= 0x80 else -1
        return -1
    if convention == "byte_level" and len(token) == 1:
        value = alphabet.get(token, -1)
        return value if value >= 0x80 else -1
    return -1


def _rows_to_csr(
    rows: list[list[int]], indices: list[int], order: list[int], size: int
) -> tuple[Tensor, Tensor]:
    """Flat lists of ``size`` tokens from the piece lists ``rows`` of tokens ``indices``
    (``order``: the rows by id; the other tokens have none)."""
    counts = torch.zeros(size, dtype=torch.long)
    counts[torch.tensor(indices, dtype=torch.long)] = torch.tensor(
        [len(r) for r in rows], dtype=torch.long
    )
    offsets = torch.zeros(size + 1, dtype=torch.long)
    offsets[1:] = counts.cumsum(0)
    return offsets, torch.tensor([p for k in order for p in rows[k]], dtype=torch.long)


def _padded_to_csr(pieces: Tensor) -> tuple[Tensor, Tensor]:
    present = pieces >= 0
    offsets = torch.zeros(pieces.shape[0] + 1, dtype=torch.long)
    offsets[1:] = present.sum(dim=1).cumsum(0)
    return offsets, pieces[present]


def _check_csr(offsets: Tensor, flat: Tensor, special: Tensor, vocab: int | None) -> None:
    """Flat piece lists that :meth:`VocabularyBridge.from_csr` can trust."""
    if offsets.dim() != 1 or len(offsets) < 1 or flat.dim() != 1 or special.dim() != 1:
        raise ValueError("offsets, flat and special must be 1-D")
    if offsets.is_floating_point() or flat.is_floating_point():
        raise ValueError("offsets and flat must be integer tensors")
    if int(offsets[0]) != 0 or int(offsets[-1]) != len(flat) or (offsets.diff() < 0).any():
        raise ValueError("offsets must rise from 0 to the number of pieces")
    if len(special) != len(offsets) - 1:
        raise ValueError(f"special has {len(special)} entries for {len(offsets) - 1} tokens")
    if len(flat) and (int(flat.min()) < 0 or (vocab is not None and int(flat.max()) >= vocab)):
        upper = "the scorer's vocabulary size" if vocab is None else vocab
        raise ValueError(
            f"piece ids must lie in [0, {upper}), got {int(flat.min())}..{int(flat.max())}"
        )


_CACHED_TENSORS = (
    "offsets",
    "flat",
    "special",
    "start_offsets",
    "start_flat",
    "opens_word",
    "byte_values",
    "opening_chars",
    "dropped_chars",
)


def _digest(tensors: dict[str, Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(tensors[name].contiguous().numpy().tobytes())
    return digest.hexdigest()


def _check_cache_dir(folder: Path) -> None:
    """The bridge's ``cache_dir`` can hold the cache: a folder (made if missing) we may write in."""
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"cache_dir {str(folder)!r} is a file, not a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ValueError(f"cache_dir {str(folder)!r} cannot be created: {error}") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(
            f"cache_dir {str(folder)!r} is not writable: pass a folder you can write in "
            "(or None for no cache)"
        )


class VocabularyBridge:
    """Generator token id -> scorer piece ids, stored flat: the pieces of token ``v`` are
    ``flat[offsets[v]:offsets[v + 1]]``; ``special [V_gen]`` marks the generator's special
    tokens.

    A token that carries no word-start marker (Gemma's ``"A"`` beside ``"▁A"``, byte-level
    BPE's ``"man"`` beside ``"Ġman"``) maps to the scorer's continuation pieces (``##a``): it
    is glued to the word before it. Where the decoded text starts a word with it anyway (the
    first token of a candidate, whose text is stripped; after a newline or a lone ``▁``; after
    punctuation a WordPiece scorer splits off) its pieces as a word start apply: ``start_flat``
    / ``start_offsets`` (the same as ``flat`` / ``offsets`` for the tokens that start a word
    themselves), and ``opens_word [V_gen]`` marks the tokens after which the scorer starts a
    new word. The losses use them at those positions (:func:`word_start_positions`).

    Build it with :meth:`build`; ``VocabularyBridge(pieces)`` takes a padded ``[V_gen, P]``
    table (``-1`` = none) and :meth:`from_csr` the flat form.

    Args:
        pieces: ``[V_gen, P]`` scorer piece ids of each generator token, ``-1`` padded.
        special: ``[V_gen]`` true on the generator's special tokens (default: tokens that map
            to nothing).
        identity: the vocabularies are equal.
        start_pieces: ``[V_gen, P']`` the pieces of each token as a word start (default:
            ``pieces``).
        opens_word: ``[V_gen]`` true on the tokens after which a word starts (default: none).

    Raises:
        AttributeError: from :meth:`build`, a tokenizer without ``get_vocab`` (not a Hugging
            Face tokenizer).

    >>> import bsloss
    >>> from bsloss.scorer.encoder import ScorerEncoder
    >>> scorer = ScorerEncoder.from_pretrained()
    >>> bridge = bsloss.VocabularyBridge.build(scorer.tokenizer, scorer)  # same vocabulary
    >>> bridge.identity, bridge.generator_vocab_size
    (True, 30522)
    """

    def __init__(
        self,
        pieces: Tensor,
        special: Tensor | None = None,
        identity: bool = False,
        start_pieces: Tensor | None = None,
        opens_word: Tensor | None = None,
    ):
        for name, table in (("pieces", pieces), ("start_pieces", start_pieces)):
            if table is not None and (
                not isinstance(table, Tensor) or table.dim() != 2 or table.is_floating_point()
            ):
                got = list(table.shape) if isinstance(table, Tensor) else type(table).__name__
                raise ValueError(
                    f"{name} must be an integer tensor [V_gen, P] of scorer piece ids (-1: "
                    f"none), got {got}" + (f" {table.dtype}" if isinstance(table, Tensor) else "")
                )
        offsets, flat = _padded_to_csr(pieces.long())
        starts = None if start_pieces is None else _padded_to_csr(start_pieces.long())
        self._init(offsets, flat, special, identity, starts, opens_word)

    def _init(
        self,
        offsets: Tensor,
        flat: Tensor,
        special: Tensor | None,
        identity: bool,
        starts: tuple[Tensor, Tensor] | None = None,
        opens_word: Tensor | None = None,
        byte_characters: ByteCharacters | None = None,
    ):
        # the lists checked once here, for every way in (the constructor, from_csr, load): a
        # piece id < 0 crashed inside embedding_bag, offsets past the flat list gave a loss
        tokens = len(offsets) - 1 if offsets.dim() == 1 else 0
        unmarked = torch.zeros(max(tokens, 0), dtype=torch.bool)
        _check_csr(offsets, flat, unmarked if special is None else special, None)
        if starts is not None:  # its own count of tokens: compared with offsets' below
            start_tokens = len(starts[0]) - 1 if starts[0].dim() == 1 else 0
            _check_csr(*starts, torch.zeros(max(start_tokens, 0), dtype=torch.bool), None)
        self.offsets, self.flat = offsets.long(), flat.long()
        counts = self.piece_counts
        # Without a special mask, tokens that map to nothing are taken as the special ones.
        self.special = counts == 0 if special is None else special.bool()
        self.identity = identity
        size = self.generator_vocab_size
        start_offsets, start_flat = (self.offsets, self.flat) if starts is None else starts
        self.start_offsets, self.start_flat = start_offsets.long(), start_flat.long()
        if len(self.start_offsets) != size + 1:
            raise ValueError(
                f"start_offsets has {len(self.start_offsets) - 1} tokens, offsets {size}"
            )
        if opens_word is None:
            opens_word = torch.zeros(size, dtype=torch.bool)
        if tuple(opens_word.shape) != (size,):
            raise ValueError(f"opens_word must have shape [{size}], got {list(opens_word.shape)}")
        self.opens_word = opens_word.bool()
        if byte_characters is None:
            byte_characters = ByteCharacters.none(size)
        if tuple(byte_characters.values.shape) != (size,):
            raise ValueError(
                f"byte_characters.values must have shape [{size}], got "
                f"{list(byte_characters.values.shape)}"
            )
        self.byte_characters = byte_characters
        # whether any token's pieces as a word start differ from its own (else the losses need
        # no second table)
        same_offsets = torch.equal(self.start_offsets, self.offsets)
        self.has_word_starts = not (same_offsets and torch.equal(self.start_flat, self.flat))
        self._padded: Tensor | None = None
        # the fingerprints of the scorer tokenizer whose ids the pieces are and of the
        # generator tokenizer whose tokens they map (set by build; a bridge made from lists or
        # loaded from a file has none)
        self.scorer_fingerprint: str | None = None
        self.generator_fingerprint: str | None = None

    @classmethod
    def from_csr(
        cls,
        offsets: Tensor,
        flat: Tensor,
        special: Tensor | None = None,
        identity: bool = False,
        start_offsets: Tensor | None = None,
        start_flat: Tensor | None = None,
        opens_word: Tensor | None = None,
        byte_characters: ByteCharacters | None = None,
    ) -> VocabularyBridge:
        """Bridge from flat lists: token ``v``'s pieces are ``flat[offsets[v]:offsets[v + 1]]``,
        as a word start ``start_flat[start_offsets[v]:start_offsets[v + 1]]`` (default: the
        same)."""
        if (start_offsets is None) != (start_flat is None):
            raise ValueError("start_offsets and start_flat go together")
        starts = None if start_offsets is None else (start_offsets, start_flat)
        bridge = cls.__new__(cls)
        bridge._init(offsets, flat, special, identity, starts, opens_word, byte_characters)
        return bridge

    @property
    def generator_vocab_size(self) -> int:
        return int(self.offsets.shape[0] - 1)

    @property
    def piece_counts(self) -> Tensor:
        """``[V_gen]``: the number of scorer pieces of each generator token."""
        return self.offsets[1:] - self.offsets[:-1]

    @property
    def pieces(self) -> Tensor:
        """The padded ``[V_gen, P]`` table (``-1`` = none), built on first use (P is the most
        pieces of any token: this is for inspection, the bridge itself never pads)."""
        if self._padded is None:
            counts = self.piece_counts
            width = max(1, int(counts.max())) if len(counts) else 1
            padded = torch.full((self.generator_vocab_size, width), -1, dtype=torch.long)
            rows = torch.repeat_interleave(torch.arange(len(counts)), counts)
            cols = torch.arange(len(self.flat)) - self.offsets[:-1][rows]
            padded[rows, cols] = self.flat
            self._padded = padded
        return self._padded

    def pieces_of(self, index: int, word_start: bool = False) -> list[int]:
        """Scorer piece ids of generator token ``index`` (``word_start``: as a word start)."""
        offsets, flat = self._lists(word_start)
        return flat[offsets[index] : offsets[index + 1]].tolist()

    def without_word_starts(self) -> VocabularyBridge:
        """This bridge with each token mapped alike wherever it stands (no word-start table: a
        loss through it skips the second expectation and its read of the device, and maps a
        candidate's first word as the token's own pieces; ``docs/bridge.md``, "Word starts")."""
        bridge = VocabularyBridge.from_csr(self.offsets, self.flat, self.special, self.identity)
        bridge.scorer_fingerprint = self.scorer_fingerprint
        bridge.generator_fingerprint = self.generator_fingerprint
        return bridge

    def _lists(self, word_start: bool) -> tuple[Tensor, Tensor]:
        return (self.start_offsets, self.start_flat) if word_start else (self.offsets, self.flat)

    @classmethod
    def build(
        cls, generator_tokenizer, scorer, cache_dir: str | Path | None = None
    ) -> VocabularyBridge:
        """Bridge from ``generator_tokenizer`` to ``scorer`` (a ScorerEncoder or a tokenizer).

        Args:
            generator_tokenizer: the generator's Hugging Face tokenizer (fast or slow).
            scorer: a :class:`~bsloss.scorer.encoder.ScorerEncoder` or the scorer's tokenizer.
            cache_dir: folder of the safetensors cache (``None``: no cache). The file name is a
                hash of both tokenizers' contents.

        Returns:
            the bridge; the identity when both vocabularies are equal.

        >>> from transformers import AutoTokenizer
        >>> from bsloss.scorer.default import embedded_model_path
        >>> tok = AutoTokenizer.from_pretrained(embedded_model_path())
        >>> VocabularyBridge.build(tok, tok).identity
        True
        """
        scorer_tokenizer = getattr(scorer, "tokenizer", scorer)
        fingerprints = (
            tokenizer_fingerprint(generator_tokenizer),
            tokenizer_fingerprint(scorer_tokenizer),
        )
        bridge = cls._build(generator_tokenizer, scorer_tokenizer, cache_dir, fingerprints)
        bridge.generator_fingerprint, bridge.scorer_fingerprint = fingerprints
        return bridge

    @classmethod
    def _build(
        cls,
        generator_tokenizer,
        scorer_tokenizer,
        cache_dir: str | Path | None,
        fingerprints: tuple[str, str],
    ) -> VocabularyBridge:
        gen_vocab = generator_tokenizer.get_vocab()
        size = max(len(generator_tokenizer), max(gen_vocab.values()) + 1)
        special = special_token_ids(generator_tokenizer)
        special_mask = torch.zeros(size, dtype=torch.bool)
        special_mask[sorted(special)] = True
        if gen_vocab == scorer_tokenizer.get_vocab():
            pieces = torch.arange(size)[:, None]
            pieces[special_mask] = -1
            return cls(pieces, special_mask, identity=True)
        path = None
        if cache_dir is not None:
            key = hashlib.sha256("|".join([_CACHE_FORMAT, *fingerprints]).encode()).hexdigest()[:24]
            path = Path(cache_dir) / f"bridge-{key}.safetensors"
            if path.exists():
                try:
                    return cls.load(path, scorer_vocab_size=len(scorer_tokenizer))
                except ValueError as error:  # a crash mid-write, a full disk, a stray file
                    warn_user(f"rebuilding the vocabulary bridge: {error}")
            _check_cache_dir(Path(cache_dir))  # before the build, not after it
        convention = token_convention(generator_tokenizer, gen_vocab)
        indices = [index for index in gen_vocab.values() if index not in special]
        tokens = generator_tokenizer.convert_ids_to_tokens(indices)
        surfaces = [_surface(generator_tokenizer, convention, token) for token in tokens]
        scorer_pieces = _ScorerPieces(scorer_tokenizer)
        rows = scorer_pieces([(text, start) for text, start, _ in surfaces])
        # the glued tokens once more, as word starts (the others start one already)
        glued = [k for k, (text, start, _) in enumerate(surfaces) if text and not start]
        start_rows = list(rows)
        as_starts = scorer_pieces([(surfaces[k][0], True) for k in glued])
        for k, pieces in zip(glued, as_starts, strict=True):
            start_rows[k] = pieces
        opens = torch.zeros(size, dtype=torch.bool)
        opens[torch.tensor(indices, dtype=torch.long)] = torch.tensor(
            scorer_pieces.opens_word([(text, space) for text, _, space in surfaces]),
            dtype=torch.bool,
        )
        # rows in id order, so that the flat list follows the offsets
        order = sorted(range(len(indices)), key=indices.__getitem__)
        offsets, flat = _rows_to_csr(rows, indices, order, size)
        start_offsets, start_flat = _rows_to_csr(start_rows, indices, order, size)
        alphabet = _byte_level_alphabet()
        bytes_of = torch.full((size,), -1, dtype=torch.int16)
        bytes_of[torch.tensor(indices, dtype=torch.long)] = torch.tensor(
            [_byte_value(token, convention, alphabet) for token in tokens], dtype=torch.int16
        )
        no_points = torch.zeros(0, dtype=torch.int32)
        byte_characters = ByteCharacters(bytes_of, no_points, no_points)
        if byte_characters.present:
            byte_characters.opening, byte_characters.dropped = scorer_pieces.character_kinds()
        bridge = cls.from_csr(
            offsets, flat, special_mask, False, start_offsets, start_flat, opens, byte_characters
        )
        if path is not None:
            try:
                bridge.save(path)
            except OSError as error:  # a full disk: the bridge is built, keep it
                warn_user(f"the vocabulary bridge is not cached: writing {path} failed ({error})")
        return bridge

    def save(self, path: str | Path) -> None:
        """Write the bridge to ``path`` (safetensors) atomically: a temporary file in the same
        folder, renamed over ``path`` once complete, so no reader ever sees half a file."""
        from safetensors.torch import save_file

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(
            dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"
        )
        os.close(handle)
        tensors = {
            "offsets": self.offsets.contiguous(),
            "flat": self.flat.contiguous(),
            "special": self.special.contiguous(),
            # copies: without word-start lists of its own a bridge's are its lists, and
            # safetensors refuses tensors that share memory
            "start_offsets": self.start_offsets.clone(),
            "start_flat": self.start_flat.clone(),
            "opens_word": self.opens_word.contiguous(),
            "byte_values": self.byte_characters.values.contiguous(),
            "opening_chars": self.byte_characters.opening.contiguous(),
            "dropped_chars": self.byte_characters.dropped.contiguous(),
        }
        metadata = {
            "identity": str(self.identity),
            "format": _CACHE_FORMAT,
            "sha256": _digest(tensors),
        }
        try:
            save_file(tensors, temporary, metadata=metadata)
            os.replace(temporary, path)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise

    @classmethod
    def load(cls, path: str | Path, scorer_vocab_size: int | None = None) -> VocabularyBridge:
        """The bridge saved at ``path`` by :meth:`save`.

        Args:
            path: the safetensors file.
            scorer_vocab_size: when given, every piece id must be below it.

        Raises:
            ValueError: ``path`` is not a complete bridge cache (unreadable, another format,
                inconsistent offsets, piece ids out of range), named.
        """
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(path), framework="pt") as handle:
                metadata = handle.metadata() or {}
                if metadata.get("format") != _CACHE_FORMAT:
                    raise ValueError(
                        f"it is not of format {_CACHE_FORMAT!r} (got {metadata.get('format')!r})"
                    )
                tensors = {name: handle.get_tensor(name) for name in _CACHED_TENSORS}
            if "sha256" in metadata and metadata["sha256"] != _digest(tensors):
                raise ValueError("its contents do not match their sha256 (damaged)")
            offsets, flat, special = tensors["offsets"], tensors["flat"], tensors["special"]
            _check_csr(offsets, flat, special, scorer_vocab_size)
            _check_csr(tensors["start_offsets"], tensors["start_flat"], special, scorer_vocab_size)
            return cls.from_csr(
                offsets,
                flat,
                special,
                identity=metadata.get("identity") == "True",
                start_offsets=tensors["start_offsets"],
                start_flat=tensors["start_flat"],
                opens_word=tensors["opens_word"],
                byte_characters=ByteCharacters(
                    tensors["byte_values"], tensors["opening_chars"], tensors["dropped_chars"]
                ),
            )
        except (SafetensorError, ValueError, KeyError, RuntimeError, OSError) as error:
            raise ValueError(
                f"{path} is not a valid bridge cache ({error}); delete it to rebuild"
            ) from error

    def _mean_over_pieces(
        self, values: Tensor, word_start: bool = False, rows: int | None = None
    ) -> Tensor:
        """``[rows, c]`` (default ``[V_gen, c]``): mean of ``values[piece]`` over each token's
        pieces (0 for none, and for the rows past ``V_gen``), one ``embedding_bag`` over the
        flat lists straight into the result (no ``[V, P, c]`` gather, no padded copy)."""
        offsets, flat = self._lists(word_start)
        size = self.generator_vocab_size
        rows = size if rows is None else rows
        if len(flat) == 0:
            return values.new_zeros(rows, values.shape[1])
        starts = offsets[:-1]
        if rows > size:  # empty bags: rows of zeros
            starts = torch.cat([starts, starts.new_full((rows - size,), len(flat))])
        return torch.nn.functional.embedding_bag(
            flat.to(values.device), values, starts.to(values.device), mode="mean"
        )

    def embedding_table(self, scorer_table: Tensor, word_start: bool = False) -> Tensor:
        """``[V_gen, d]`` input embeddings :math:`T` from the scorer's ``[V_scorer, d]`` table
        (``word_start``: of each token as a word start)."""
        return self._mean_over_pieces(scorer_table, word_start)

    def weight_table(self, scorer_weights: Tensor, word_start: bool = False) -> Tensor:
        """``[V_gen]`` importance weights :math:`\\omega` from the scorer's ``[V_scorer]``
        (``word_start``: of each token as a word start)."""
        return self._mean_over_pieces(scorer_weights[:, None], word_start)[:, 0]

    def augmented_table(
        self,
        scorer_table: Tensor,
        scorer_weights: Tensor,
        word_start: bool = False,
        rows: int | None = None,
    ) -> Tensor:
        """``[rows, d + 1]`` (default ``[V_gen, d + 1]``): :meth:`embedding_table` beside
        :meth:`weight_table` (:func:`~bsloss.distributions.augment_table`), built as one mean
        over the scorer's ``[V_scorer, d + 1]``, so that no ``[V_gen, d]`` table is held
        beside it; ``rows`` past ``V_gen`` are 0 (a head padded past the tokenizer's
        tokens)."""
        return self._mean_over_pieces(augment_table(scorer_table, scorer_weights), word_start, rows)

    def fidelity(self) -> dict[str, float]:
        """Shares of the non-special generator tokens that map to exactly one scorer piece, to
        several, and to none (text the scorer's normaliser drops, e.g. lone bytes)."""
        counts = self.piece_counts
        ordinary = ~self.special
        total = max(int(ordinary.sum()), 1)

        def share(selected: Tensor) -> float:
            return float((selected & ordinary).sum()) / total

        return {
            "tokens": float(total),
            "single_piece_share": share(counts == 1),
            "multi_piece_share": share(counts > 1),
            "none_share": share(counts == 0),
            "max_pieces": float(counts.max()),
        }


# --------------------------------------------------------------------------- retokenize
@dataclass
class RetokenizedBatch:
    """The scorer's tokenisation of decoded candidates.

    Attributes:
        texts: the decoded candidate texts.
        piece_ids: ``[B, P]`` scorer ids of the content pieces (special tokens excluded).
        piece_mask: ``[B, P]`` true on real pieces.
    """

    texts: list[str]
    piece_ids: Tensor
    piece_mask: Tensor


class Retokenizer:
    """Decodes generator tokens to text and tokenises it as the scorer does.

    Args:
        generator_tokenizer: the generator's tokenizer (fast or slow; only
            ``batch_decode(..., skip_special_tokens=True)`` is used).
        encoder: the :class:`~bsloss.scorer.encoder.ScorerEncoder`.
    """

    def __init__(self, generator_tokenizer, encoder):
        self.generator_tokenizer = generator_tokenizer
        self.encoder = encoder

    # host work on text (the ids read back, decoded, tokenised): skipped by Dynamo in a compiled
    # loss, whose graph would otherwise take each step's decoded texts in and compile again
    @torch.compiler.disable
    def __call__(self, token_ids: Tensor, mask: Tensor) -> RetokenizedBatch:
        """Retokenise a batch of generator tokens ``[B, L]`` (``mask``: real positions)."""
        rows = token_ids.detach().cpu().tolist()
        keep = mask.detach().cpu().tolist()
        real = [
            [t for t, k in zip(r, m, strict=True) if k] for r, m in zip(rows, keep, strict=True)
        ]
        texts = self.generator_tokenizer.batch_decode(real, skip_special_tokens=True)
        tokens = self.encoder.tokenization
        head, tail = len(tokens.prefix_ids), len(tokens.suffix_ids)
        # bert_score's tokenisation (strip, prefix space, truncation with a warning naming the
        # candidates), without the special tokens the loss splices in itself
        pieces = [row[head : len(row) - tail] for row in tokens(texts, name="candidates")]
        batch = len(texts)
        width = max([len(p) for p in pieces] + [1])
        ids = torch.zeros(batch, width, dtype=torch.long)
        piece_mask = torch.zeros(batch, width, dtype=torch.bool)
        for b, row in enumerate(pieces):
            ids[b, : len(row)] = torch.tensor(row, dtype=torch.long)
            piece_mask[b, : len(row)] = True
        empty = [b for b in range(batch) if not pieces[b]]
        if empty:
            warn_user(
                f"{len(empty)} decoded candidate(s) are empty or whitespace-only for the scorer "
                f"(candidates {empty[:10]}): they score 0"
            )
        device = token_ids.device
        return RetokenizedBatch(texts, ids.to(device), piece_mask.to(device))


def word_start_positions(
    tokens: Tensor, mask: Tensor, opens_word: Tensor, transparent: Tensor
) -> Tensor:
    """``[B, L]``, true at the positions of ``mask`` whose token begins a word of the decoded
    text: the first of its row (the scored text is stripped) and each right after a token that
    opens a word (``opens_word [V]``: its text ends in whitespace, or in punctuation a WordPiece
    scorer splits off). Tokens that leave the words as they are (``transparent [V]``: those the
    decoder drops, and those that make no scorer piece and end in no space, such as a combining
    mark) begin none and are looked past; so are the positions outside ``mask``, as the decoded
    text has no token there.

    >>> opens = torch.tensor([False, False, True])  # token 2 is a newline
    >>> clear = torch.tensor([False, False, False])
    >>> word_start_positions(torch.tensor([[0, 1, 2, 1]]), torch.ones(1, 4, dtype=torch.bool),
    ...                      opens, clear).tolist()
    [[True, False, False, True]]
    """
    return _word_starts(mask & ~transparent[tokens], opens_word[tokens])


def _word_starts(marks: Tensor, opens_at: Tensor) -> Tensor:
    """:func:`word_start_positions` from the positions that count (``marks [B, L]``) and those
    after which a word starts (``opens_at [B, L]``)."""
    batch, length = marks.shape
    if length == 0:
        return marks
    positions = torch.arange(length, device=marks.device).expand(batch, length)
    last = torch.where(marks, positions, -1).cummax(dim=1).values
    # the last marked position before each one (-1: none, the row's first word)
    previous = torch.nn.functional.pad(last[:, :-1], (1, 0), value=-1)
    after_opener = opens_at.gather(1, previous.clamp(min=0))
    return marks & ((previous < 0) | after_opener)


_LEAD_MASKS = (0x7F, 0x1F, 0x0F, 0x07)  # a UTF-8 lead byte's payload, by sequence length


def byte_character_positions(
    tokens: Tensor,
    mask: Tensor,
    byte_values: Tensor,
    kinds: Tensor,
    opens_at: Tensor,
    transparent_at: Tensor,
) -> tuple[Tensor, Tensor]:
    """``opens_at``, ``transparent_at`` ``[B, L]`` with the byte tokens' positions decided by
    the character their bytes spell, rebuilt from UTF-8 on the device: the position of a
    character's last byte opens a word after it (``kinds[code point] == 1``), counts as text
    (0) or is looked past (2, a character the scorer drops); its other bytes, and bytes that
    make no valid character, are looked past.

    Args:
        tokens, mask: ``[B, L]`` ids and the positions the decoded text keeps (those outside
            ``mask`` are looked past: the decoder joins the bytes around them).
        byte_values: ``[V]`` the byte (0x80-0xFF) of each byte token, -1 for the others.
        kinds: ``[0x110000]`` int8, :meth:`ByteCharacters.kinds`.

    >>> values = torch.full((8,), -1, dtype=torch.int16)
    >>> values[[5, 6]] = torch.tensor([0xC2, 0xA0], dtype=torch.int16)  # U+00A0, no-break space
    >>> kinds = torch.zeros(0x110000, dtype=torch.int8); kinds[0xA0] = 1
    >>> opens = torch.zeros(1, 4, dtype=torch.bool)
    >>> clear = torch.tensor([[False, True, True, False]])  # byte tokens: no piece of their own
    >>> tokens, mask = torch.tensor([[1, 5, 6, 2]]), torch.ones(1, 4, dtype=torch.bool)
    >>> byte_character_positions(tokens, mask, values, kinds, opens, clear)
    (tensor([[False, False,  True, False]]), tensor([[False,  True, False, False]]))
    """
    if tokens.shape[1] == 0:
        return opens_at, transparent_at
    values = byte_values[tokens].int()
    values = torch.where(mask, values, -1)
    is_byte = values >= 0
    continuation = is_byte & ((values & 0xC0) == 0x80)
    # the k-th position of the decoded text before each (-1: none), as the decoder joins the
    # bytes: past the positions outside `mask`
    batch, length = tokens.shape
    positions = torch.arange(length, device=tokens.device).expand(batch, length)
    last = torch.where(mask, positions, -1).cummax(dim=1).values
    earlier = [positions, torch.nn.functional.pad(last[:, :-1], (1, 0), value=-1)]
    for _ in range(2):
        before = earlier[-1]
        earlier.append(torch.where(before >= 0, earlier[1].gather(1, before.clamp(min=0)), -1))

    def back(tensor: Tensor, k: int, fill: int | bool) -> Tensor:  # tensor at the k-th before
        where = earlier[k]
        return torch.where(where >= 0, tensor.gather(1, where.clamp(min=0)), fill)

    # continuation bytes ending here (0-3), then the lead byte before them
    run = continuation.int()
    run = run + (run.bool() & back(continuation, 1, False)).int()
    run = run + (run == 2).int() * back(continuation, 2, False).int()
    lead = values.clone()
    for k in (1, 2, 3):
        lead = torch.where(run == k, back(values, k, -1), lead)
    length = torch.full_like(lead, -1)  # the sequence length the lead byte announces
    for size, (pattern, top) in enumerate(((0xC0, 0xE0), (0xE0, 0xF0), (0xF0, 0xF8)), start=2):
        length = torch.where((lead & top) == pattern, size, length)
    complete = is_byte & (lead >= 0) & (length == run + 1)
    point = torch.zeros_like(values)
    for size in (2, 3, 4):
        here = length == size
        value = (lead & _LEAD_MASKS[size - 1]) << (6 * (size - 1))
        for k in range(size - 1):  # the continuation bytes, the last one here
            value = value | ((back(values, k, 0) & 0x3F) << (6 * k))
        point = torch.where(here, value, point)
    kind = kinds[point.clamp(0, kinds.shape[0] - 1).long()]
    opens_at = torch.where(is_byte, complete & (kind == 1), opens_at)
    transparent_at = torch.where(is_byte, ~complete | (kind == 2), transparent_at)
    return opens_at, transparent_at


# --------------------------------------------------------------------------- modes
# The most rows a bridged head may have past its tokenizer's tokens (or 1% of them, if more):
# heads are padded to a multiple of 64 or 128 (T5: 28 rows, Qwen2.5: 271, Phi-2: 905); a head of
# another vocabulary altogether (Gemma's 262,144 through a 30,527-token bridge) is refused
_MOST_PADDED_ROWS = 1024


class BridgeMode:
    """How a loss's candidates reach its scorer: chosen once per loss
    (:func:`resolve_bridge_mode`), asked by the loss wherever the modes differ.

    A subclass states the generator-token table the expectations are taken over
    (:meth:`tables`), which of its tokens are not content (:meth:`special_tokens`), and
    whether the value is the score of the decoded text (``decodes``: the loss then also encodes
    the argmax tokens through :meth:`retokenize`).

    Args:
        bridge: the :class:`VocabularyBridge` (``None``: the scorer's own vocabulary).
    """

    name: str | None = None  # the ``bridge_mode`` string (None: no bridge in between)
    identity = False  # an identity bridge was given (the generator's vocabulary is the scorer's)
    decodes = False
    # what happens to a candidate with more tokens than the scorer takes (a warning says it)
    truncation = "only their first tokens are scored, the rest get no score and no gradient"

    def __init__(self, bridge: VocabularyBridge | None = None):
        self.bridge = bridge
        # on the candidates' device: opens_word, transparent, special, byte characters' tables
        self._word_masks: tuple | None = None
        # the generator tokenizer the bridge was built from and its size then, or since, when
        # what it added are special tokens (resolve sets it)
        self.built_from: tuple[object, int] | None = None

    def check_padded_rows(self, name: str, size: int) -> None:
        """Candidates ``name`` over ``size`` tokens, more than the bridge maps: a head padded
        past its tokenizer's tokens, whose extra rows make no text, unless the tokenizer has
        grown since the bridge was built. Then the rows past it are tokens it has added (and
        the head resized for), which the bridge would score as nothing (audit h26: an added
        word dropped from a one-hot candidate, F 0.746 where its text scores 1.0)."""
        expected = self.bridge.generator_vocab_size
        if size - expected > max(_MOST_PADDED_ROWS, expected // 100):
            raise ValueError(
                f"{name} has a vocabulary of {size} entries, {size - expected} past the "
                f"{expected} tokens the vocabulary bridge maps: more than a head padded to a "
                "multiple of 64 or 128 has (Qwen2.5's: 271 rows); the bridge was built from "
                "another generator tokenizer"
            )
        if self.built_from is None:
            return
        tokenizer, checked = self.built_from
        now = len(tokenizer)
        if now == checked:
            return
        if now > checked and set(range(checked, now)) <= special_token_ids(tokenizer):
            # special tokens only (a pad token added, as for GPT-2 or Llama): no text, as the
            # padded rows the bridge takes them for
            self.built_from = tokenizer, now
            return
        raise ValueError(
            f"{name} has a vocabulary of {size} entries and the generator tokenizer now has "
            f"{now} tokens, {expected} when the vocabulary bridge was built: it maps only "
            "the tokens the tokenizer had then; build the loss again with "
            "bridge=Bridge(tokenizer) after adding tokens"
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def vocab_size(self, scorer_vocab_size: int) -> int:
        """The number of generator tokens a candidate distribution must cover."""
        return scorer_vocab_size if self.bridge is None else self.bridge.generator_vocab_size

    def tables(
        self, scorer_table: Tensor, scorer_weights: Tensor, rows: int
    ) -> tuple[Tensor, Tensor | None]:
        """``[rows, d + 1]`` :func:`~bsloss.distributions.augment_table` of the generator's
        tokens (their input embeddings and weights; rows past the vocabulary 0) and the same
        of the tokens as word starts, for the positions of :meth:`word_starts` (``None`` where
        it is the same table: no bridge, or one whose tokens map alike wherever they stand)."""
        if self.bridge is None:
            table = augment_table(scorer_table, scorer_weights)
            if rows > table.shape[0]:
                table = torch.nn.functional.pad(table, (0, 0, 0, rows - table.shape[0]))
            return table, None
        # one at a time, each straight into its [rows, d + 1]: Gemma's are 385 MiB each
        own = self.bridge.augmented_table(scorer_table, scorer_weights, rows=rows)
        if not self.bridge.has_word_starts:
            return own, None
        return own, self.bridge.augmented_table(scorer_table, scorer_weights, True, rows)

    def word_starts(self, tokens: Tensor, mask: Tensor) -> Tensor | None:
        """``[B, L]``: the positions of ``mask`` whose token ``tokens [B, L]`` begins a word of
        the decoded text (:func:`word_start_positions`, the characters spelled in byte tokens
        rebuilt: :func:`byte_character_positions`); ``None`` without word-start tables (decided
        here, where a compiled loss without them keeps its graph whole)."""
        if self.bridge is None or not self.bridge.has_word_starts:
            return None
        return self._word_starts(tokens, mask)

    # the masks are moved to the tokens' device on first use: state a compiled loss would
    # guard on, and compile again once it is set; the positions' read follows right after
    @torch.compiler.disable
    def _word_starts(self, tokens: Tensor, mask: Tensor) -> Tensor:
        device = tokens.device
        if self._word_masks is None or self._word_masks[0].device != device:
            bridge = self.bridge
            transparent = bridge.special | ((bridge.piece_counts == 0) & ~bridge.opens_word)
            characters = bridge.byte_characters
            kinds = None
            if characters.present:
                kinds = (characters.values.to(device), characters.kinds().to(device))
            self._word_masks = (
                bridge.opens_word.to(device),
                transparent.to(device),
                bridge.special.to(device),
                kinds,
            )
        opens, transparent, special, kinds = self._word_masks
        size = opens.shape[0]
        # a bridged head's rows past the tokenizer's tokens make no text: outside the mask
        mask = mask & (tokens < size)
        tokens = tokens.clamp(max=size - 1)
        opens_at, transparent_at = opens[tokens], transparent[tokens]
        if kinds is not None:  # the decoder drops the special tokens between bytes too
            opens_at, transparent_at = byte_character_positions(
                tokens, mask & ~special[tokens], *kinds, opens_at, transparent_at
            )
        return _word_starts(mask & ~transparent_at, opens_at)

    def special_tokens(self, scorer_special: Tensor, scorer_vocab_size: int) -> Tensor:
        """``[V_gen]``, true on the generator tokens that are not content: the generator's
        special tokens, those ``decode(skip_special_tokens=True)`` drops (the bridge's
        ``special``), and the tokens that make no scorer piece (Gemma's ~1,090 newlines, runs
        of spaces, tabs: the scorer's tokenizer drops their text). A candidate position whose
        token is one of them (a distribution's most probable token) is skipped, as the decoded
        text drops it: through a bridge its embedding would be 0, a position of its own that
        changes its neighbours' context and that the references' tokens could match.
        ``scorer_special``: the scorer's special token ids."""
        return self.bridge.special | (self.bridge.piece_counts == 0)

    def vocabulary_error(self, name: str, size: int, expected: int) -> str:
        """The message for a candidate ``name`` over ``size`` tokens instead of ``expected``."""
        if self.bridge is None and self.identity and size > expected:
            # the generator's tokenizer is the scorer's: no bridge to pass, no padding to skip
            return (
                f"{name} has a vocabulary of {size} entries but the scorer expects {expected} "
                f"(the identity bridge: the generator's tokenizer is the scorer's); pass its "
                f"first {expected}, {name}[..., :{expected}]"
            )
        if self.bridge is None:
            where, hint = "the scorer", "; pass bridge=Bridge(generator_tokenizer) to bridge them"
        else:
            where, hint = "the vocabulary bridge", ""
        return f"{name} has a vocabulary of {size} entries but {where} expects {expected}{hint}"


class SharedVocabulary(BridgeMode):
    """The generator's vocabulary is the scorer's (no bridge, or an identity one): a candidate
    token is its scorer piece. Candidates may hold the scorer's own special tokens
    (``tokenizer(texts)`` adds them, a generator ends on [SEP]), which are skipped: the loss
    wraps each candidate itself."""

    def special_tokens(self, scorer_special: Tensor, scorer_vocab_size: int) -> Tensor:
        special = torch.zeros(scorer_vocab_size, dtype=torch.bool, device=scorer_special.device)
        return special.index_fill_(0, scorer_special, True)


class AverageBridge(BridgeMode):
    """``bridge_mode="average"``: one scorer position per generator position, the expected bridge
    embedding :math:`e_t = \\sum_v p_t(v) T[v]` (see the module's docstring)."""

    name = "average"


class RetokenizeBridge(BridgeMode):
    """``bridge_mode="retokenize"`` (exact): the value is the score of the decoded text, the
    gradient the average mode's (see the module's docstring).

    Args:
        bridge: the :class:`VocabularyBridge`.
        generator_tokenizer, encoder: as in :class:`Retokenizer`.
    """

    name = "retokenize"
    decodes = True
    truncation = "their decoded text is scored whole, but only their first tokens give a gradient"

    def __init__(self, bridge: VocabularyBridge, generator_tokenizer, encoder):
        super().__init__(bridge)
        self.retokenizer = Retokenizer(generator_tokenizer, encoder)

    def retokenize(self, tokens: Tensor, mask: Tensor) -> RetokenizedBatch:
        """The scorer's pieces of the decoded ``tokens`` ``[B, L]`` (``mask``: real ones)."""
        return self.retokenizer(tokens, mask)


BRIDGE_MODES = ("retokenize", "average")


def check_bridge_mode(mode: object, name: str = "bridge_mode") -> None:
    """Refuse a mode (``name``: the argument the caller passed) that is not one of
    :data:`BRIDGE_MODES` or ``None``."""
    if mode is not None and mode not in BRIDGE_MODES:
        raise ValueError(f"{name} must be one of {BRIDGE_MODES} or None, got {mode!r}")


def resolve_bridge_mode(
    bridge: VocabularyBridge | None, mode: str | None, generator_tokenizer, encoder
) -> BridgeMode:
    """The :class:`BridgeMode` of a loss: ``mode`` (``"retokenize"``, ``"average"`` or ``None``:
    retokenize when ``generator_tokenizer`` is given, else average) when the vocabularies
    differ; :class:`SharedVocabulary` when there is no bridge or an identity one.

    Raises:
        ValueError: an unknown ``mode``, or ``"retokenize"`` without ``generator_tokenizer``.
    """
    check_bridge_mode(mode)
    if bridge is None or bridge.identity:
        # the scorer's own table, not the identity bridge's: that one gives [UNK] and [MASK]
        # embedding 0, which the shared vocabulary scores as content
        shared = SharedVocabulary()
        shared.identity = bridge is not None
        return shared
    if mode is None:
        mode = "average" if generator_tokenizer is None else "retokenize"
    if mode == "average":
        return AverageBridge(bridge)
    if generator_tokenizer is None:
        raise ValueError(
            "bridge_mode='retokenize' decodes the candidates: pass Bridge(generator_tokenizer, ...)"
        )
    return RetokenizeBridge(bridge, generator_tokenizer, encoder)


def _check_tokenizer(tokenizer: object, name: str) -> None:
    if not all(
        callable(getattr(tokenizer, method, None))
        for method in ("get_vocab", "convert_ids_to_tokens", "batch_decode")
    ):
        raise TypeError(
            f"{name} must be a Hugging Face tokenizer (get_vocab, batch_decode), got "
            f"{type(tokenizer).__name__} {tokenizer!r:.60}; load it with "
            "transformers.AutoTokenizer.from_pretrained(...)"
        )


@dataclass(frozen=True)
class Bridge:
    """How a generator whose vocabulary is not the scorer's reaches the scorer: one value for
    :class:`~bsloss.BERTScoreLoss`'s ``bridge=`` (a tokenizer or a :class:`VocabularyBridge`
    passed there is its shorthand).

    Args:
        tokenizer: the generator's Hugging Face tokenizer (the :class:`VocabularyBridge` is built
            from it, unless ``vocabulary`` is given; ``"retokenize"`` decodes with it).
        mode: ``"retokenize"`` or ``"average"`` (:data:`BRIDGE_MODES`); ``None``: retokenize
            with a tokenizer, average without.
        cache_dir: folder of :meth:`VocabularyBridge.build`'s cache (``None``: none).
        vocabulary: a :class:`VocabularyBridge` already built.

    Raises:
        TypeError: ``tokenizer`` is not a Hugging Face tokenizer, ``vocabulary`` not a
            :class:`VocabularyBridge`.
        ValueError: an unknown ``mode``; neither ``tokenizer`` nor ``vocabulary``.

    >>> Bridge(mode="average")
    Traceback (most recent call last):
    ValueError: Bridge needs the generator's tokenizer or a VocabularyBridge (vocabulary=)
    """

    tokenizer: object = None
    mode: str | None = None
    cache_dir: str | Path | None = None
    vocabulary: VocabularyBridge | None = None

    def __post_init__(self) -> None:
        check_bridge_mode(self.mode, "Bridge(mode)")
        if self.tokenizer is None and self.vocabulary is None:
            raise ValueError(
                "Bridge needs the generator's tokenizer or a VocabularyBridge (vocabulary=)"
            )
        if isinstance(self.tokenizer, VocabularyBridge):
            raise TypeError(
                "Bridge's first argument is the generator's tokenizer; pass a VocabularyBridge "
                "as Bridge(vocabulary=...) (or as bridge= of the loss itself)"
            )
        if self.tokenizer is not None:
            _check_tokenizer(self.tokenizer, "Bridge(tokenizer)")
        if self.vocabulary is not None and not isinstance(self.vocabulary, VocabularyBridge):
            raise TypeError(
                f"vocabulary must be a VocabularyBridge, got {type(self.vocabulary).__name__}"
            )

    @classmethod
    def of(cls, bridge: object) -> Bridge | None:
        """``bridge=`` as a :class:`Bridge`: itself, a :class:`VocabularyBridge` or a tokenizer
        (shorthands), or ``None``."""
        if bridge is None or isinstance(bridge, Bridge):
            return bridge
        if isinstance(bridge, VocabularyBridge):
            return cls(vocabulary=bridge)
        _check_tokenizer(bridge, "bridge")
        return cls(bridge)

    def resolve(self, encoder) -> tuple[VocabularyBridge, BridgeMode]:
        """The vocabulary bridge (built here when not given) and the mode, for ``encoder``."""
        vocabulary = self.vocabulary
        if vocabulary is None:
            vocabulary = VocabularyBridge.build(self.tokenizer, encoder, cache_dir=self.cache_dir)
        else:
            _check_scorer(vocabulary, encoder)
            if self.tokenizer is not None:
                _check_generator(vocabulary, self.tokenizer)
        mode = resolve_bridge_mode(vocabulary, self.mode, self.tokenizer, encoder)
        if self.tokenizer is not None:
            mode.built_from = self.tokenizer, len(self.tokenizer)
        return vocabulary, mode


def _check_generator(vocabulary: VocabularyBridge, tokenizer) -> None:
    """Refuse a given bridge built from another generator tokenizer than ``tokenizer``: the
    retokenize mode decoded with this one while its gradient went through the other's tokens
    (audit h26: Gemma's tokenizer with an MPNet-layout bridge, F 1.0 from the decoded text and
    0.05 from the bridge), and the average mode read one vocabulary's ids as the other's."""
    built_from = vocabulary.generator_fingerprint
    size = len(tokenizer)
    if built_from is not None and built_from != tokenizer_fingerprint(tokenizer):
        raise ValueError(
            "vocabulary= was built from another generator tokenizer than Bridge's tokenizer "
            "(or from this one before it changed); build it from this one, "
            "VocabularyBridge.build(generator_tokenizer, scorer)"
        )
    if size > vocabulary.generator_vocab_size:
        raise ValueError(
            f"vocabulary= maps {vocabulary.generator_vocab_size} generator tokens and Bridge's "
            f"tokenizer has {size}: it was built from another tokenizer, or before tokens "
            "were added; build it from this one, VocabularyBridge.build(generator_tokenizer, "
            "scorer)"
        )


def _check_scorer(vocabulary: VocabularyBridge, encoder) -> None:
    """Refuse a given bridge built for another scorer: its piece ids past the scorer's table
    crashed inside ``embedding_bag``, and ids that fit were read as other tokens (MPNet's ids
    are MiniLM's + 4: "the cat sat" read as "mothers stuff professor")."""
    rows = encoder.input_embeddings.num_embeddings
    largest = int(vocabulary.flat.max()) if vocabulary.flat.numel() else -1
    if largest >= rows:
        raise ValueError(
            f"vocabulary= holds scorer piece ids up to {largest}, but this loss's scorer has "
            f"{rows} tokens: the bridge was built for another scorer; build it with this one, "
            "VocabularyBridge.build(generator_tokenizer, scorer)"
        )
    built_for = vocabulary.scorer_fingerprint
    tokenizer = getattr(encoder, "tokenizer", None)
    if None not in (built_for, tokenizer) and built_for != tokenizer_fingerprint(tokenizer):
        raise ValueError(
            "vocabulary= was built for another scorer's tokenizer than this loss's: its "
            "piece ids would be read as other tokens; build it with this scorer, "
            "VocabularyBridge.build(generator_tokenizer, scorer)"
        )
