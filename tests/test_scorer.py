"""The scorer package's pieces (bsloss/scorer/): tokenization of no texts, device names checked on
loading. (The reference cache: tests/test_reference_cache.py; BERTScorer: tests/test_metric.py.)"""

from __future__ import annotations

from unittest import mock

import pytest
import torch


def test_rc1_tokenising_nothing(encoder):
    assert encoder.tokenization.encode([]) == ([], [])


def test_device_names_are_checked(encoder):
    from bsloss.scorer.loading import resolve_device

    with pytest.raises(ValueError, match="'gpu' is not a torch device"):
        resolve_device("gpu")
    with pytest.raises(ValueError, match="cuda:99"):
        resolve_device("cuda:99")


@pytest.mark.parametrize(
    "local_rank, count, current, expected",
    [("1", 2, 0, 1), (None, 2, 0, 0), ("1", 1, 0, 0), ("0", 2, 1, 1), ("x", 2, 0, 0)],
    ids=["launcher", "no-launcher", "one-visible-gpu", "set-by-the-script", "odd-rank"],
)
def test_the_default_gpu_is_this_processs(monkeypatch, local_rank, count, current, expected):
    """A scorer built with no device (or ``"cuda"``) in a multi-GPU run before the trainer set
    each process's device (a TRL reward made at the top of a script) went to the current device,
    GPU 0, in every process (audit h23, N3): under a launcher it is the one of ``LOCAL_RANK``."""
    from bsloss.scorer.loading import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
    if local_rank is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", local_rank)
    assert resolve_device(None) == resolve_device("cuda") == torch.device("cuda", expected)
    assert resolve_device("cuda:0") == torch.device("cuda", 0)


def _tokenizers_of_every_kind(encoder, folder):
    """MiniLM's WordPiece (a copy: a test sets its truncation side, which the session scorer's
    own kept, so that a later module truncated long texts from the left), an MPNet layout, a
    SentencePiece-style and a byte-level BPE."""
    import copy

    from _tokenizers import (
        brown_lines,
        mpnet_layout_tokenizer,
        train_byte_level_bpe,
        train_sentencepiece_bpe,
    )

    lines = brown_lines(2000)
    vocab = folder / "minilm-vocab.txt"
    vocab.write_text("\n".join(encoder.tokenizer.convert_ids_to_tokens(range(30522))) + "\n")
    return {
        "wordpiece": copy.deepcopy(encoder.tokenizer),
        "mpnet": mpnet_layout_tokenizer(vocab, folder / "mpnet"),
        "sentencepiece-bpe": train_sentencepiece_bpe(lines, folder / "spm"),
        "byte-level-bpe": train_byte_level_bpe(lines, folder / "bytes"),
    }


def test_the_rust_tokenizers_ids_are_the_calls(encoder, tmp_path):
    """ScorerTokenizer.encode goes straight through a private copy of a fast tokenizer's Rust
    tokenizer, in pieces on threads for a large batch: every id must be the Hugging Face
    call's, for every kind of tokenizer, on text with accents, CJK, special-token strings,
    empty and over-long lines, and after the call itself re-configured truncation."""
    from _tokenizers import brown_lines

    from bsloss.scorer import tokenization
    from bsloss.scorer.tokenization import ScorerTokenizer

    odd = ["", "   ", "héllo wörld", "東京 は 大きい", "a [SEP] b [CLS] <s> </s>", "word " * 700]
    texts = brown_lines(2600) + odd  # > 2 pieces of _TEXTS_PER_THREAD: threads are used
    assert len(texts) > 2 * tokenization._TEXTS_PER_THREAD
    for kind, tokenizer in _tokenizers_of_every_kind(encoder, tmp_path).items():
        tokens = ScorerTokenizer(tokenizer, kind, max_positions=512)
        assert tokens._backend is not None, kind  # the fast path is the one tested
        tokens._threads = 2  # threads even on a one-core machine
        ids, too_long = tokens.encode(texts, truncate=False)
        prepared = tokens.prepare(texts)
        expected = tokenizer(prepared, add_special_tokens=True)["input_ids"]
        assert ids == expected, kind
        assert too_long == [len(texts) - 1], kind
        # the call's own tokenizer is now set to truncate: the private copy is not
        tokenizer(prepared[:5], truncation=True, max_length=4)
        assert tokens.encode(odd, truncate=False)[0] == expected[-len(odd) :], kind


def test_a_tokenizer_class_that_changes_the_call_goes_through_the_call(encoder):
    """A class overriding how the call encodes (as LayoutLM's or LUKE's do) keeps its own
    call: the Rust shortcut would skip what it adds."""
    from transformers import PreTrainedTokenizerFast

    from bsloss.scorer.tokenization import ScorerTokenizer

    # the method a batch call goes through: _batch_encode_plus under transformers 4.x; under 5
    # it is gone and _encode_plus takes single texts and batches alike
    batch_method = "_batch_encode_plus"
    method = batch_method if hasattr(PreTrainedTokenizerFast, batch_method) else "_encode_plus"

    def marked_call(self, *args, **kwargs):
        encoded = getattr(super(Marked, self), method)(*args, **kwargs)
        ids = encoded["input_ids"]
        batched = bool(ids) and isinstance(ids[0], list)
        encoded["input_ids"] = [[7, *row] for row in ids] if batched else [7, *ids]
        return encoded

    Marked = type("Marked", (type(encoder.tokenizer),), {method: marked_call})

    marked = Marked.from_pretrained(encoder.tokenizer.name_or_path)
    tokens = ScorerTokenizer(marked, "marked")
    assert tokens._backend is None
    plain = encoder.tokenization.encode(["the cat sat", "héllo"])[0]
    assert tokens.encode(["the cat sat", "héllo"])[0] == [[7, *ids] for ids in plain]


def test_a_tokenizer_class_that_changes_the_text_in_its_call_goes_through_the_call(encoder):
    """A subclass rewriting the text in ``__call__`` itself (as SeamlessM4T's and UDOP's do, or a
    user's pre-edit) had the Rust shortcut, which skipped the rewrite (audit h21 note 5)."""
    from bsloss.scorer.tokenization import ScorerTokenizer

    def respelling_call(self, text=None, *args, **kwargs):
        if isinstance(text, str):
            text = text.replace("colour", "color")
        elif text is not None:
            text = [t.replace("colour", "color") for t in text]
        return super(Respelling, self).__call__(text, *args, **kwargs)

    Respelling = type("Respelling", (type(encoder.tokenizer),), {"__call__": respelling_call})
    respelling = Respelling.from_pretrained(encoder.tokenizer.name_or_path)
    tokens = ScorerTokenizer(respelling, "respelling")
    plain = encoder.tokenization
    assert tokens.encode(["the colour red"])[0] == plain.encode(["the color red"])[0]
    assert tokens.encode(["the colour red"])[0] != plain.encode(["the colour red"])[0]


def test_a_tokenizer_whose_limit_is_none_is_refused_with_what_to_set(encoder):
    """``model_max_length = None`` makes transformers' own call fail on every text ("'>' not
    supported between instances of 'int' and 'NoneType'", from inside transformers, at the
    scorer's construction): refused by name (audit h21 note 3)."""
    import copy

    from bsloss.scorer.tokenization import ScorerTokenizer

    tokenizer = copy.deepcopy(encoder.tokenizer)
    tokenizer.model_max_length = None
    with pytest.raises(ValueError, match="MiniLM tokenizer's model_max_length is None.*512"):
        ScorerTokenizer(tokenizer, "MiniLM")


def test_the_tokenizer_copies_pickles_and_survives_a_fork(encoder):
    """The thread pool is neither copied nor pickled, and a forked child (a DataLoader
    worker) makes its own: the parent's threads do not exist there."""
    import copy
    import os
    import pickle

    tokens = copy.copy(encoder.tokenization)
    tokens._threads = 2
    texts = [f"sentence number {i}" for i in range(3000)]
    expected = tokens.encode(texts)
    assert tokens._pool is not None
    assert copy.deepcopy(tokens).encode(texts) == expected
    assert pickle.loads(pickle.dumps(tokens)).encode(texts) == expected
    if not hasattr(os, "fork"):
        return
    import select
    import signal

    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child's result goes through the pipe
        ok = tokens.encode(texts) == expected
        os.write(write, b"1" if ok else b"0")
        os._exit(0)
    os.close(write)
    answered, _, _ = select.select([read], [], [], 60)  # the parent's pool would hang it
    if not answered:
        os.kill(child, signal.SIGKILL)
    os.waitpid(child, 0)
    assert answered, "the forked child's tokenisation hung"
    assert os.read(read, 1) == b"1"


def test_tokens_added_to_the_tokenizer_later_are_seen(encoder, tmp_path):
    from transformers import AutoTokenizer

    from bsloss.scorer.tokenization import ScorerTokenizer

    encoder.tokenizer.save_pretrained(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    tokens = ScorerTokenizer(tokenizer, "copy")
    before = tokens.encode(["a zxqvword here"])[0]
    tokenizer.add_tokens(["zxqvword"])
    after = tokens.encode(["a zxqvword here"])[0]
    assert after != before
    assert after == [tokenizer(tokens.prepare(["a zxqvword here"]))["input_ids"][0]]


def test_a_scorer_and_a_loss_follow_tokens_added_after_they_were_built(encoder):
    """docs/metric.md: tokens added to the tokenizer after the scorer was built reach the next
    call. Audit h25: the importance weights kept the old vocabulary's size, and the new token's
    id indexed past them (``IndexError`` in the padding; the loss: a size mismatch in its
    candidates' table); and the references' cache kept their old pieces (F 0.18 against 0.75),
    as neither the tokenizer nor transformers 5's resize of the embedding in place (the same
    parameter, its version unchanged) changed its key. Each now scores as one built on the
    grown scorer, after calls that filled the caches."""
    import copy

    import bsloss

    grown = copy.deepcopy(encoder)
    cands, refs = ["a zxqvword here", "the cat"], ["zxqvword is here", "a cat sat"]
    built = [
        bsloss.BERTScorer(encoder=grown, idf=idf, reference_cache_size=size)
        for idf, size in (
            (False, 0),
            (False, 8),
            (["zxqvword is here", "a cat"], 8),
            ({2000: 1.5}, 8),
        )
    ]
    losses = [bsloss.BERTScoreLoss(encoder=grown), bsloss.BERTScoreLoss(encoder=grown, idf=refs)]
    vocab = encoder.input_embeddings.num_embeddings
    logits = torch.randn(2, 3, vocab + 1)
    key = grown.weights_key()
    for scorer in built:
        scorer.score(cands, refs)
    for loss in losses:
        loss(logits[..., :vocab], refs)
    grown.tokenizer.add_tokens(["zxqvword"])
    torch.manual_seed(0)
    grown.model.resize_token_embeddings(len(grown.tokenizer), mean_resizing=False)
    new_id = grown.tokenizer.convert_tokens_to_ids("zxqvword")
    assert new_id == vocab and new_id in grown.tokenization.encode(cands[:1])[0][0]
    assert grown.weights_key() != key  # the compiled model, the candidates' table follow it
    for scorer in built:
        again = bsloss.BERTScorer(encoder=grown, idf=scorer.idf)
        assert torch.equal(scorer.score(cands, refs)[2], again.score(cands, refs)[2]), scorer.idf
    for loss, idf in zip(losses, (None, refs), strict=True):
        again = bsloss.BERTScoreLoss(encoder=grown, idf=idf)
        assert loss(logits, refs).item() == again(logits, refs).item()


def test_tokens_added_without_resizing_the_embedding_are_refused_by_name(encoder):
    """A token added to the scorer's tokenizer without ``resize_token_embeddings`` has an id
    past the model's input embedding: refused on the host, naming the token and the fix, on
    the metric's batched and windowed paths and the loss's text references (it was an
    ``IndexError`` deep inside torch; on a GPU a device-side assert, which ends the CUDA
    context); the next call without the token scores as before."""
    import copy

    import bsloss

    grown = copy.deepcopy(encoder)
    scorer = bsloss.BERTScorer(encoder=grown)
    windowed = bsloss.BERTScorer(encoder=grown, long_inputs="window")
    loss = bsloss.BERTScoreLoss(encoder=grown)
    vocab = grown.input_embeddings.num_embeddings
    logits = torch.randn(1, 3, vocab)
    before = scorer.score(["the cat"], ["a cat sat"])[2], loss(logits, ["a cat sat"])
    grown.tokenizer.add_tokens(["zxqvword"])
    calls = {
        "batched": lambda: scorer.score(["a zxqvword here"], ["a cat"]),
        "windowed": lambda: windowed.score(["a cat"], ["word " * 600 + "zxqvword"]),
        "loss": lambda: loss(logits, ["zxqvword is here"]),
    }
    for call in calls.values():
        with pytest.raises(ValueError, match=rf"'zxqvword' the id {vocab}, past the {vocab} rows"):
            call()
    assert torch.equal(scorer.score(["the cat"], ["a cat sat"])[2], before[0])
    assert loss(logits, ["a cat sat"]).item() == before[1].item()


def test_cached_references_follow_a_tokenizer_setting_changed_later(encoder):
    """A change of the tokenizer that leaves the vocabulary and the weights alone
    (``split_special_tokens``: a literal "[SEP]" in a text is text from then on) reaches cached
    references too (audit h25: the cache was not keyed on the tokenizer)."""
    import copy

    import bsloss

    changed = copy.deepcopy(encoder)
    cands, refs = ["a cat sat here"], ["a cat [SEP] sat"]
    cached = bsloss.BERTScorer(encoder=changed, reference_cache_size=8)
    before = cached.score(cands, refs)[2]
    changed.tokenizer.split_special_tokens = True
    after = bsloss.BERTScorer(encoder=changed).score(cands, refs)[2]
    assert not torch.equal(before, after)
    assert torch.equal(cached.score(cands, refs)[2], after)


def test_changes_to_the_tokenizer_after_it_was_copied_are_seen(encoder, tmp_path):
    """Audit h21: the private copy was made again only when the vocabulary grew. An existing
    token added again (BERT's ``[unused1]`` made special, a word added as a token) leaves the
    size alone but is split off by the call from then on; ``split_special_tokens`` set later
    changes the ids too. Each now reaches the next call."""
    from transformers import AutoTokenizer

    from bsloss.scorer.tokenization import ScorerTokenizer

    encoder.tokenizer.save_pretrained(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    tokens = ScorerTokenizer(tokenizer, "copy")
    text = ["mark [unused1] here, concatenate [SEP] a"]

    def the_calls() -> list[list[int]]:
        return tokenizer(tokens.prepare(text))["input_ids"]

    before = tokens.encode(text)[0]
    assert before == the_calls()
    tokenizer.add_special_tokens({"additional_special_tokens": ["[unused1]"]})
    tokenizer.add_tokens(["cat"])  # "concatenate" -> con cat en ##ate
    assert len(tokenizer) == 30522  # no new id: the size did not change
    assert tokens.encode(text)[0] == the_calls() != before
    tokenizer.split_special_tokens = True  # "[SEP]" in the text is text now
    assert tokens.encode(text)[0] == the_calls()
    assert tokenizer.convert_tokens_to_ids("[SEP]") not in tokens.encode(text)[0][0][1:-1]


def test_byte_level_text_starting_with_a_special_token_gets_no_lone_space():
    """Audit h21: bert_score's leading space for a byte-level BPE was written before the text,
    where a tokenizer with ``add_prefix_space=True`` (as bsloss loads them) adds it itself to
    each piece between special tokens: a text starting with ``<s>``, ``</s>`` or an added token
    began with a lone ``Ġ`` that neither the call nor bert_score's ``sent_encode`` makes."""
    import json

    from _tokenizers import brown_lines
    from tokenizers import ByteLevelBPETokenizer
    from transformers import GPT2TokenizerFast, RobertaTokenizerFast

    from bsloss.scorer.tokenization import ScorerTokenizer

    raw = ByteLevelBPETokenizer()
    specials = ["<pad>", "<unk>", "<s>", "</s>", "<|endoftext|>"]
    raw.train_from_iterator(
        brown_lines(500), vocab_size=1000, show_progress=False, special_tokens=specials
    )
    model = json.loads(raw.to_str())["model"]
    vocab, merges = model["vocab"], [tuple(m) for m in model["merges"]]
    for kind in (RobertaTokenizerFast, GPT2TokenizerFast):
        tokenizer = kind(vocab=vocab, merges=merges, add_prefix_space=True)
        tokenizer.add_tokens(["[NEW]"])
        tokens = ScorerTokenizer(tokenizer, kind.__name__)
        texts = ["<s> a cat", "</s>", "<|endoftext|> a cat", "[NEW] a cat", " a cat <s> ", "a"]
        expected = tokenizer([t.strip() for t in texts])["input_ids"]
        assert tokens.encode(texts)[0] == expected, kind.__name__
        assert tokens.encode(["a"])[0][0][-1 if kind is GPT2TokenizerFast else -2] == (
            tokenizer.convert_tokens_to_ids("Ġa")
        )  # the first word still reads as one after a space


def test_a_tokenizer_with_a_custom_python_piece_goes_through_its_call(encoder):
    """Audit h21: a Rust tokenizer with a custom Python piece (RoFormer's Jieba
    pre-tokenizer) has no JSON form, and the copy raised ``Exception: Custom PreTokenizer
    cannot be serialized`` while building the scorer; the call serves it."""
    import copy

    from tokenizers.pre_tokenizers import PreTokenizer

    from bsloss.scorer.tokenization import ScorerTokenizer

    class SplitOnSpaces:
        def pre_tokenize(self, pretokenized):
            pretokenized.split(lambda i, text: text.split(" ", "removed"))

    tokenizer = copy.deepcopy(encoder.tokenizer)
    tokenizer.backend_tokenizer.pre_tokenizer = PreTokenizer.custom(SplitOnSpaces())
    tokens = ScorerTokenizer(tokenizer, "custom")
    assert tokens._backend is None
    texts = ["a cat sat", "héllo wörld"]
    assert tokens.encode(texts)[0] == tokenizer(texts)["input_ids"]


@pytest.mark.parametrize("side", ["right", "left"])
def test_truncation_cuts_the_ids_it_has_without_calling_the_tokenizer_again(
    encoder, tmp_path, side
):
    """Audit h21: the texts too long were tokenised again by the caller's tokenizer, set to
    truncate: a call of the caller's on another thread in between left rows of 602 tokens
    past the limit of 512, and a long text cost its tokenisation twice. The ids made are cut
    as the call would cut them, for every kind of tokenizer and both truncation sides."""
    import warnings

    from bsloss.scorer.tokenization import ScorerTokenizer

    texts = ["word " * 700, "a cat sat", "é " * 600, "x, " * 100]
    for kind, tokenizer in _tokenizers_of_every_kind(encoder, tmp_path).items():
        tokenizer.truncation_side = side
        with warnings.catch_warnings():  # MiniLM declares 512: cut to the 64 here, warned
            warnings.simplefilter("ignore")
            tokens = ScorerTokenizer(tokenizer, kind, max_positions=64, absolute_positions=True)
        prepared = tokens.prepare(texts)
        expected = tokenizer(prepared, truncation=True, max_length=tokens.max_length)
        call = type(tokenizer).__call__
        with mock.patch.object(type(tokenizer), "__call__", autospec=True, side_effect=call) as spy:
            ids, too_long = tokens.encode(texts)
        assert ids == expected["input_ids"], (kind, side)
        assert too_long == [0, 2, 3], kind
        assert spy.call_count == 0, kind


def test_a_single_string_is_refused_not_split_into_characters(encoder):
    with pytest.raises(TypeError, match="texts must be a sequence of strings, got a single str"):
        encoder.tokenization.encode("a cat")


def _tiny_folder(folder, kind: str, encoder, max_length: int | None = None) -> str:
    """A random 1-layer ``kind`` model with 34 position embeddings, saved with MiniLM's
    tokenizer minus its ``model_max_length`` (the tokenizer then declares no limit), or with
    ``max_length`` as its ``model_max_length``."""
    import json

    import transformers

    small = dict(vocab_size=30522, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                 intermediate_size=37, max_position_embeddings=34, pad_token_id=0)  # fmt: skip
    config = {"bert": transformers.BertConfig, "roberta": transformers.RobertaConfig,
              "mpnet": transformers.MPNetConfig}[kind](**small)  # fmt: skip
    transformers.AutoModel.from_config(config).save_pretrained(folder)
    encoder.tokenizer.save_pretrained(folder)
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    settings.pop("model_max_length", None)
    if max_length is not None:
        settings["model_max_length"] = max_length
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    return str(folder)


def _scores_a_text_past_the_limit(scorer, usable: int) -> None:
    """A 42-token text through ``scorer``, whose limit is ``usable`` tokens: truncated with the
    warning, and windowed without one, both finite."""
    import warnings

    import bsloss

    text = " ".join(["word"] * 40)  # 42 tokens with [CLS] and [SEP]
    with pytest.warns(UserWarning, match=f"maximum of {usable} tokens and were truncated"):
        truncated = scorer.score([text], ["a cat"])
    window = bsloss.BERTScorer(encoder=scorer.encoder, long_inputs="window")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        whole = window.score([text], ["a cat"])
    for scores in (truncated, whole):
        assert all(torch.isfinite(s).all() for s in scores)


@pytest.mark.parametrize("kind, usable", [("bert", 34), ("roberta", 33), ("mpnet", 32)])
def test_a_tokenizer_declaring_more_than_the_position_table_is_cut_to_it(
    encoder, tmp_path, kind, usable
):
    """A tokenizer whose ``model_max_length`` (1024 here) is more than the model's position
    table takes: a text longer than the table crashed inside transformers, in both long-input
    modes ("The expanded size of the tensor (736) must match the existing size (512)" for
    MiniLM's folder declaring 1024). The limit is the table's, with a warning at load."""
    import bsloss

    folder = _tiny_folder(tmp_path, kind, encoder, max_length=1024)
    with pytest.warns(UserWarning, match=f"model_max_length of 1024 .* takes {usable}"):
        scorer = bsloss.BERTScorer(folder, num_layers=1, device="cpu")
    assert scorer.encoder.max_length == usable
    _scores_a_text_past_the_limit(scorer, usable)


@pytest.mark.parametrize("kind, usable", [("bert", 34), ("roberta", 33), ("mpnet", 32)])
def test_a_tokenizer_without_a_limit_takes_the_positions_the_model_can_use(
    encoder, tmp_path, kind, usable
):
    """With no ``model_max_length``, the limit is the positions the model can use: RoBERTa's
    and MPNet's position ids start after ``padding_idx`` (config.pad_token_id for RoBERTa,
    always 1 for MPNet), so ``max_position_embeddings - padding_idx - 1`` of them.

    Before: the limit was ``max_position_embeddings`` (34 here, 514 for roberta-large or
    all-mpnet-base-v2 without it), and a text of that many tokens crashed inside torch
    (``IndexError: index out of range in self``) in both long-input modes."""
    import bsloss

    scorer = bsloss.BERTScorer(_tiny_folder(tmp_path, kind, encoder), num_layers=1, device="cpu")
    assert scorer.encoder.max_length == usable
    _scores_a_text_past_the_limit(scorer, usable)
