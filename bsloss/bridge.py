"""Vocabulary bridge: scorer input embeddings for the tokens of a different generator vocabulary.

A T5 or Marian generator scored by a RoBERTa or BERT scorer emits distributions over its own
vocabulary. The bridge maps every generator token, once, to the scorer pieces its text
tokenises into, respecting word boundaries (SentencePiece ``▁``, byte-level BPE ``Ġ``, WordPiece
``##`` continuations); its input embedding is the mean of those pieces' embeddings, and its
importance weight the mean of theirs. Special tokens map to nothing (zero embedding, weight 0).
Equal vocabularies give the identity. The piece table is cached on disk as safetensors.

This is an approximation where a generator token spans several scorer pieces (one position
instead of several); :meth:`VocabularyBridge.fidelity` reports how often that happens.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from torch import Tensor

__all__ = ["VocabularyBridge", "token_convention"]


def token_convention(tokenizer) -> str:
    """``"sentencepiece"``, ``"byte_level"`` or ``"wordpiece"``, read off the vocabulary."""
    vocab = tokenizer.get_vocab()
    counts = {
        "sentencepiece": sum(t.startswith("\u2581") for t in vocab),
        "byte_level": sum(t.startswith("\u0120") for t in vocab),
        "wordpiece": sum(t.startswith("##") for t in vocab),
    }
    return max(counts, key=counts.get)


def _surface(tokenizer, convention: str, token: str) -> tuple[str, bool]:
    """(text, starts a word) of one generator token."""
    if convention == "wordpiece":
        return (token[2:], False) if token.startswith("##") else (token, True)
    if convention == "sentencepiece" and not token.startswith("<0x"):
        return (token[1:], True) if token.startswith("\u2581") else (token, False)
    text = tokenizer.convert_tokens_to_string([token])
    return text.strip(), text[:1].isspace()


class _ScorerPieces:
    """Tokenises a piece of text into scorer ids, as a word start or a continuation."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.vocab = tokenizer.get_vocab()
        self.convention = token_convention(tokenizer)

    def __call__(self, text: str, word_start: bool) -> list[int]:
        if not text:
            return []
        if not word_start and self.convention == "wordpiece":
            return self._wordpiece_continuation(text)
        if not word_start and self.convention == "byte_level":
            # " ." is its own pre-token in GPT-2's split, so the text after it gets no "Ġ".
            marker = self.tokenizer(" .", add_special_tokens=False)["input_ids"]
            ids = self.tokenizer(" ." + text, add_special_tokens=False)["input_ids"]
            return ids[len(marker) :] if ids[: len(marker)] == marker else ids
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if not word_start and self.convention == "sentencepiece" and ids:
            first = self.tokenizer.convert_ids_to_tokens(ids[0])
            if first == "\u2581":
                ids = ids[1:]
            elif first.startswith("\u2581") and first[1:] in self.vocab:
                ids[0] = self.vocab[first[1:]]
        return ids

    def _wordpiece_continuation(self, text: str) -> list[int]:
        """Scorer pieces of ``text`` glued to the end of a word: the part the scorer's
        pre-tokenizer keeps in the same word becomes ``##`` pieces (greedy longest match, as
        WordPiece does); what it splits off (punctuation, a new word) starts new words."""
        backend = self.tokenizer.backend_tokenizer
        normalized = backend.normalizer.normalize_str(text) if backend.normalizer else text
        words = backend.pre_tokenizer.pre_tokenize_str("a" + normalized)
        if not words or len(words[0][0]) == 1:  # nothing glued to the word: a new word
            return self.tokenizer(normalized, add_special_tokens=False)["input_ids"]
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
                return self.tokenizer(normalized, add_special_tokens=False)["input_ids"]
        rest = normalized[end:]
        if rest.strip():
            ids += self.tokenizer(rest, add_special_tokens=False)["input_ids"]
        return ids


class VocabularyBridge:
    """Generator token id -> scorer piece ids (``pieces [V_gen, P]``, ``-1`` = none), and which
    generator tokens are special (``special [V_gen]``).

    Build it with :meth:`build`; :class:`~bsloss.BERTScoreLoss` does so when given
    ``generator_tokenizer``.

    Args:
        pieces: ``[V_gen, P]`` scorer piece ids of each generator token, ``-1`` padded.
        special: ``[V_gen]`` true on the generator's special tokens (default: tokens that map
            to nothing).
        identity: the vocabularies are equal.

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

    def __init__(self, pieces: Tensor, special: Tensor | None = None, identity: bool = False):
        self.pieces = pieces.long()
        # Without a special mask, tokens that map to nothing are taken as the special ones.
        self.special = (self.pieces < 0).all(dim=1) if special is None else special.bool()
        self.identity = identity

    @property
    def generator_vocab_size(self) -> int:
        return int(self.pieces.shape[0])

    @classmethod
    def build(cls, generator_tokenizer, scorer, cache_dir: str | Path | None = None):
        """Bridge from ``generator_tokenizer`` to ``scorer`` (a ScorerEncoder or a tokenizer)."""
        scorer_tokenizer = getattr(scorer, "tokenizer", scorer)
        gen_vocab, scorer_vocab = generator_tokenizer.get_vocab(), scorer_tokenizer.get_vocab()
        size = max(len(generator_tokenizer), max(gen_vocab.values()) + 1)
        special = set(generator_tokenizer.all_special_ids)
        special_mask = torch.zeros(size, dtype=torch.bool)
        special_mask[sorted(special)] = True
        if gen_vocab == scorer_vocab:
            pieces = torch.arange(size)[:, None]
            pieces[special_mask] = -1
            return cls(pieces, special_mask, identity=True)
        key = hashlib.sha256(
            json.dumps(
                [sorted(gen_vocab.items()), sorted(scorer_vocab.items()), sorted(special), "v2"]
            ).encode()
        ).hexdigest()[:20]
        path = Path(cache_dir) / f"bridge-{key}.safetensors" if cache_dir else None
        if path is not None and path.exists():
            return cls.load(path)
        convention = token_convention(generator_tokenizer)
        to_scorer = _ScorerPieces(scorer_tokenizer)
        rows: list[list[int]] = [[] for _ in range(size)]
        for token, index in gen_vocab.items():
            if index in special:
                continue
            text, word_start = _surface(generator_tokenizer, convention, token)
            rows[index] = to_scorer(text, word_start)
        width = max(1, max(len(r) for r in rows))
        pieces = torch.full((size, width), -1, dtype=torch.long)
        for index, row in enumerate(rows):
            pieces[index, : len(row)] = torch.tensor(row, dtype=torch.long)
        bridge = cls(pieces, special_mask)
        if path is not None:
            bridge.save(path)
        return bridge

    def save(self, path: str | Path) -> None:
        from safetensors.torch import save_file

        Path(path).parent.mkdir(parents=True, exist_ok=True)
        save_file(
            {"pieces": self.pieces.contiguous(), "special": self.special.contiguous()},
            str(path),
            metadata={"identity": str(self.identity)},
        )

    @classmethod
    def load(cls, path: str | Path) -> VocabularyBridge:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as handle:
            pieces, special = handle.get_tensor("pieces"), handle.get_tensor("special")
            identity = handle.metadata().get("identity") == "True"
        return cls(pieces, special, identity=identity)

    def _mean_over_pieces(self, values: Tensor) -> Tensor:
        """Mean of ``values[piece]`` over each generator token's pieces (0 for none)."""
        pieces = self.pieces.to(values.device)
        present = (pieces >= 0).to(values.dtype)
        gathered = values[pieces.clamp_min(0)]
        if gathered.dim() == 3:
            total = (gathered * present[..., None]).sum(dim=1)
            return total / present.sum(dim=1, keepdim=True).clamp_min(1)
        return (gathered * present).sum(dim=1) / present.sum(dim=1).clamp_min(1)

    def embedding_table(self, scorer_table: Tensor) -> Tensor:
        """``[V_gen, d]`` input embeddings from the scorer's ``[V_scorer, d]`` table."""
        if self.identity:
            present = (self.pieces[:, 0] >= 0).to(scorer_table.device, scorer_table.dtype)
            return scorer_table[: self.generator_vocab_size] * present[:, None]
        return self._mean_over_pieces(scorer_table)

    def weight_table(self, scorer_weights: Tensor) -> Tensor:
        """``[V_gen]`` importance weights from the scorer's ``[V_scorer]`` weights."""
        return self._mean_over_pieces(scorer_weights)

    def fidelity(self) -> dict[str, float]:
        """Shares of the non-special generator tokens that map to exactly one scorer piece, to
        several, and to none (text the scorer's normaliser drops, e.g. lone bytes)."""
        counts = (self.pieces >= 0).sum(dim=1)
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
