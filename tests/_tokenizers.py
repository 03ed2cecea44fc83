"""Real tokenizers and data for the vocabulary-bridge tests, all built offline.

- an MPNet-layout tokenizer: all-mpnet-base-v2's vocabulary is all-MiniLM-L6-v2's WordPiece
  vocabulary with ``<s> <pad> </s> <unk>`` in front and ``<mask>`` at the end, so every MiniLM
  line (its own ``[PAD]``/``[UNK]``/``[CLS]``/``[SEP]``/``[MASK]`` and ``[unusedN]`` included)
  sits at its MiniLM id + 4;
- a SentencePiece-style BPE (``▁`` word starts) and a byte-level BPE (``Ġ`` word starts),
  trained with the ``tokenizers`` library on Brown sentences;
- STS-B dev pairs and Brown sentences from the shared data folder.
"""

from __future__ import annotations

import csv
import os
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
SPECIAL_TOKENS = ("<pad>", "</s>", "<unk>")
MPNET_HEAD = ("<s>", "<pad>", "</s>", "<unk>")  # ids 0..3 of all-mpnet-base-v2
MPNET_SHIFT = len(MPNET_HEAD)


def data_file(name: str) -> Path:
    """A file of the shared data folder (``$BSLOSS_DATA_DIR`` or ``../shared/data``)."""
    folder = os.environ.get("BSLOSS_DATA_DIR") or REPO_ROOT.parent / "shared/data"
    path = Path(folder) / name
    if not path.is_file():
        pytest.skip(f"{name} not found at {path} (set BSLOSS_DATA_DIR to its folder)")
    return path


def xsum_study_file(folder: Path) -> Path:
    """The efficacy study's XSum split (all 1,001 articles), built from the shared data as the
    study's runs built it (``recipes/data/make_samples.py --xsum-study``; not vendored)."""
    import subprocess
    import sys

    source = data_file("xsum-test.jsonl")
    path = folder / "xsum-study.jsonl"
    subprocess.run([sys.executable, str(REPO_ROOT / "recipes/data/make_samples.py"), "--data-dir",
                    str(source.parent), "--xsum-study", str(path)], check=True)  # fmt: skip
    return path


def stsb_pairs(n: int) -> tuple[list[str], list[str]]:
    """The first ``n`` STS-B dev pairs as (candidates = sentence1, references = sentence2)."""
    with open(data_file("stsb-dev.tsv"), newline="", encoding="utf-8") as handle:
        rows = csv.reader(handle, delimiter="\t", quoting=csv.QUOTE_NONE)
        header = next(rows)
        assert header[:3] == ["score", "sentence1", "sentence2"], header
        pairs = [(row[1], row[2]) for row, _ in zip(rows, range(n), strict=False)]
    return [c for c, _ in pairs], [r for _, r in pairs]


def brown_lines(n: int) -> list[str]:
    with open(data_file("brown-sentences.txt"), encoding="utf-8") as handle:
        return [line.rstrip("\n") for line, _ in zip(handle, range(n), strict=False)]


# --------------------------------------------------------------------------- tokenizers
def mpnet_layout_tokenizer(minilm_vocab: Path, folder: Path):
    """A fast MPNet tokenizer whose vocabulary is MiniLM's, shifted by +4, plus ``<mask>``
    (``MPNetTokenizerFast``: under transformers 4.x ``MPNetTokenizer`` is the slow Python one,
    under 5.x the two names are one class)."""
    from transformers import MPNetTokenizerFast

    lines = Path(minilm_vocab).read_text(encoding="utf-8").splitlines()
    folder.mkdir(parents=True, exist_ok=True)
    vocab = [*MPNET_HEAD, *lines, "<mask>"]
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    return MPNetTokenizerFast.from_pretrained(
        str(folder),
        do_lower_case=True,
        bos_token="<s>",
        eos_token="</s>",
        sep_token="</s>",
        cls_token="<s>",
        unk_token="<unk>",
        pad_token="<pad>",
        mask_token="<mask>",
    )


def _wrap(raw, folder: Path):
    from transformers import PreTrainedTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    raw.save(str(folder / "tokenizer.json"))
    pad, eos, unk = SPECIAL_TOKENS
    return PreTrainedTokenizerFast(
        tokenizer_file=str(folder / "tokenizer.json"), pad_token=pad, eos_token=eos, unk_token=unk
    )


def train_sentencepiece_bpe(lines: list[str], folder: Path, vocab_size: int = 4000):
    """SentencePiece-style BPE: Metaspace pre-tokenizer, ``▁`` marks a word start."""
    from tokenizers import SentencePieceBPETokenizer

    raw = SentencePieceBPETokenizer(unk_token="<unk>")
    raw.train_from_iterator(
        lines, vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False
    )
    return _wrap(raw, folder)


def train_byte_level_bpe(lines: list[str], folder: Path, vocab_size: int = 4000):
    """GPT-2-style byte-level BPE, ``Ġ`` marks a word start; with a prefix space (as RoBERTa's
    ``add_prefix_space=True``) so a sentence's first word is a word start too."""
    from tokenizers import ByteLevelBPETokenizer

    raw = ByteLevelBPETokenizer(add_prefix_space=True)
    raw.train_from_iterator(
        lines, vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False
    )
    return _wrap(raw, folder)


def train_word_end_bpe(lines: list[str], folder: Path, vocab_size: int = 4000):
    """BPE that marks a word's last token (``cat</w>``, as FSMT, XLM and CLIP): no word-start
    marker in its vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    raw = Tokenizer(models.BPE(unk_token="<unk>", end_of_word_suffix="</w>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.decoder = decoders.BPEDecoder(suffix="</w>")
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        end_of_word_suffix="</w>",
        show_progress=False,
    )
    raw.train_from_iterator(lines, trainer)
    return _wrap(raw, folder)


def word_level(lines: list[str], folder: Path):
    """A vocabulary of whole words (the lines' lower-cased words), no marker at all: the
    decoder puts the spaces between them."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

    words = sorted({word for line in lines for word in line.lower().split()})
    vocab = {token: index for index, token in enumerate([*SPECIAL_TOKENS, *words])}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.normalizer = normalizers.Lowercase()
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return _wrap(raw, folder)


# --------------------------------------------------------------------------- inputs
def encode(tokenizer, texts: list[str]) -> list[list[int]]:
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def padded(rows: list[list[int]], device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, L]`` ids (0-padded) and mask."""
    length = max(map(len, rows))
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    mask = torch.zeros(len(rows), length, dtype=torch.bool)
    for b, row in enumerate(rows):
        ids[b, : len(row)] = torch.tensor(row, dtype=torch.long)
        mask[b, : len(row)] = True
    return ids.to(device), mask.to(device)


def one_hot(ids: torch.Tensor, vocab_size: int, value: float = 1.0) -> torch.Tensor:
    """``[B, L, V]``: ``value`` at each id, 0 elsewhere (logits with ``value=1e4``: the
    softmax is exactly one-hot in float32)."""
    out = torch.zeros(*ids.shape, vocab_size, device=ids.device)
    return out.scatter_(-1, ids[..., None], value)


def scorer_keeps_whole(scorer_tokenizer, token: str) -> bool:
    """Whether the scorer's own WordPiece tokenizer can produce ``token`` from text.

    A word-start token must come back as itself (``[unusedN]`` and ``...`` do not: BERT's
    pre-tokenizer splits their punctuation). A ``##x`` continuation must be glued to the word
    before it: ``a`` + ``x`` stays one word through the normaliser and the pre-tokenizer
    (``##.``, ``##中`` do not: punctuation and CJK characters always start a word).
    """
    if not token.startswith("##"):
        ids = scorer_tokenizer(token, add_special_tokens=False)["input_ids"]
        return ids == [scorer_tokenizer.convert_tokens_to_ids(token)]
    backend = scorer_tokenizer.backend_tokenizer
    word = backend.normalizer.normalize_str("a" + token[2:])
    words = backend.pre_tokenizer.pre_tokenize_str(word)
    return len(words) == 1 and words[0][0] == "a" + token[2:]
