"""The decoder-only layout of the recipes (recipes/causal.py) on a tiny random causal LM: the
completion-only logits are the model's own next-token logits, left padding changes nothing,
own-output completions are cut at eos, and mismatched settings fail with the setting named."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from _models import scorer_vocabulary_tokenizer, tiny_gpt2
from causal import CausalCollator
from examples import Example

from bsloss.integrations.lm_head import token_cross_entropy

SPLITS_ALL = ("train", "validation", "test")
EXAMPLES = [
    Example("the cat sat on the mat all day long and then it slept", "a cat sat"),
    Example("rain", "it rained in the north of the country today"),
    Example("dogs ran in the park", "dogs ran"),
]


@pytest.fixture(scope="module")
def tiny(scorer):
    from transformers import GPT2Config

    tokenizer = scorer_vocabulary_tokenizer(scorer)
    # two layers, 128 positions, and GPT-2's own bos id (this file's model before the shared one)
    bos = GPT2Config().bos_token_id
    model = tiny_gpt2(tokenizer, n_positions=128, n_layer=2, bos_token_id=bos).eval()
    collator = CausalCollator(tokenizer, model, "summarization", 32, 12)
    return model, tokenizer, collator


def test_completion_logits_are_the_models_next_token_logits(tiny):
    model, _, collator = tiny
    batch = collator(EXAMPLES)
    assert (batch["prompt_mask"][:, -1] == 1).all()  # left-padded: every prompt ends at P - 1
    with torch.no_grad():
        (batched,) = collator.teacher_forced_logits(model, batch, [batch["labels"]])
        for row, example in enumerate(EXAMPLES):
            prompt = collator._prompt(example.source)
            completion = collator._completion(example.target)
            alone = model(torch.tensor([prompt + completion])).logits[0]
            # position t of the completion is predicted at column len(prompt) + t - 1
            expected = alone[len(prompt) - 1 : len(prompt) + len(completion) - 1]
            got = batched[row, : len(completion)]
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    # CE over completion tokens only equals the model's own loss with the prompt masked out.
    prompt, completion = (
        collator._prompt(EXAMPLES[0].source),
        collator._completion(EXAMPLES[0].target),
    )
    ids = torch.tensor([prompt + completion])
    labels = torch.tensor([[-100] * len(prompt) + completion])
    with torch.no_grad():
        reference = model(ids, labels=labels).loss
        (single,) = collator.teacher_forced_logits(
            model, collator(EXAMPLES[:1]), [labels[:, len(prompt) :]]
        )
    torch.testing.assert_close(
        token_cross_entropy(labels[:, len(prompt) :], logits=single), reference
    )


def test_content_mask_and_labels(tiny):
    _, tokenizer, collator = tiny
    batch = collator(EXAMPLES)
    labels, mask = batch["labels"], collator.content_mask(batch["labels"])
    for row, example in enumerate(EXAMPLES):
        real = labels[row][labels[row] != -100].tolist()
        assert real[-1] == tokenizer.sep_token_id  # every completion ends with eos
        assert int(mask[row].sum()) == len(real) - 1  # the eos is not a candidate token
        assert tokenizer.decode(real[:-1]) == example.target


def test_generated_completions_stop_at_eos(tiny):
    model, tokenizer, collator = tiny
    batch = collator(EXAMPLES[:2])
    eos, word = collator.eos, tokenizer.vocab["cat"]
    new = torch.tensor([[word, eos, word, word], [word, word, word, eos]])

    class Recorded(torch.nn.Module):  # generate() output: the prompts, then the new tokens
        def generate(self, input_ids, **_):
            return torch.cat([input_ids, new], dim=1)

    labels = collator.generate(Recorded(), batch, 4)
    assert labels.tolist() == [[word, eos, -100, -100], [word, word, word, eos]]
    assert collator.decode(labels) == ["cat", "cat cat cat"]
    # and on the real model: a label row per prompt, nothing after an eos
    labels = collator.generate(model, collator(EXAMPLES), 8)
    assert labels.shape == (3, 8)
    for row in labels:
        ended = (row == eos).nonzero()
        assert not len(ended) or (row[ended[0, 0] + 1 :] == -100).all()


def test_generated_completions_keep_their_eos_when_pad_is_eos(tiny):
    """A tokenizer without a pad token is padded with eos (as TRL's trainers do): a completion
    still keeps its eos, and one that ends at once is that eos, as with a distinct pad (before:
    the eos was taken for padding, and such a completion was empty)."""
    model, tokenizer, _ = tiny
    no_pad = copy.deepcopy(tokenizer)
    no_pad.pad_token = None
    collator = CausalCollator(no_pad, model, "summarization", 32, 12)
    eos, word = collator.eos, tokenizer.vocab["cat"]
    assert collator.pad == eos
    new = torch.tensor([[eos, eos, eos], [word, eos, eos]])  # generate pads with the pad id

    class Recorded(torch.nn.Module):  # generate() output: the prompts, then the new tokens
        def generate(self, input_ids, **_):
            return torch.cat([input_ids, new], dim=1)

    labels = collator.generate(Recorded(), collator(EXAMPLES[:2]), 3)
    assert labels.tolist() == [[eos, -100, -100], [word, eos, -100]]


def test_prompt_longer_than_context_names_the_setting(tiny):
    model, tokenizer, _ = tiny
    collator = CausalCollator(tokenizer, model, "summarization", 1000, 40)
    long = Example(" ".join(["word"] * 200), "short")
    with pytest.raises(ValueError, match="max_source_length"):
        collator([long])


def test_kind_mismatch_names_the_setting(tmp_path, tiny):
    model, tokenizer, _ = tiny
    from generators import _pretrained

    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="model.kind is 'seq2seq' but .* is a causal model"):
        _pretrained(str(tmp_path), "seq2seq", "model.generator")
    loaded, _ = _pretrained(str(tmp_path), "auto", "model.generator")
    assert not loaded.config.is_encoder_decoder


def test_chat_template_setting(tiny):
    model, tokenizer, _ = tiny
    plain = copy.deepcopy(tokenizer)
    plain.chat_template = None
    with pytest.raises(ValueError, match="data.chat_template is true but .* has no chat template"):
        CausalCollator(plain, model, "translation", 32, 12, chat_template=True)
    with pytest.raises(ValueError, match="data.chat_template must be auto, true or false"):
        CausalCollator(plain, model, "translation", 32, 12, chat_template="yes")
    chat = copy.deepcopy(tokenizer)
    chat.chat_template = "{% for m in messages %}<user>{{ m['content'] }}</user>{% endfor %}<bot>"
    prompts = {
        setting: CausalCollator(chat, model, "translation", 32, 12, chat_template=setting).prompt(
            "hola"
        )
        for setting in ("auto", True, False, "true", "False")  # strings: a command line's
    }
    assert prompts["true"] == prompts[True] and prompts["False"] == prompts[False]
    assert prompts["auto"] == prompts[True] == "<user>Spanish: hola\nEnglish:</user><bot>"
    assert prompts[False] == "Spanish: hola\nEnglish:"
    assert CausalCollator(plain, model, "translation", 32, 12).prompt("hola") == prompts[False]


def test_empty_target_names_the_row_and_setting(tmp_path):
    from config import DataConfig
    from examples import load_splits

    data = tmp_path / "data.jsonl"
    rows = [{"split": s, "document": "some text", "summary": "a summary"} for s in SPLITS_ALL]
    rows.insert(2, {"split": "train", "document": "an article", "summary": "  "})
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = DataConfig(path=str(data), source="document", target="summary")
    with pytest.raises(ValueError, match=r"row 2: data.target='summary' is empty"):
        load_splits(spec)
    rows[2]["summary"], rows[0]["document"] = "fine", ""
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match=r"row 0: data.source='document' is empty"):
        load_splits(spec)


def test_a_template_that_writes_the_bos_gives_a_prompt_with_one(gemma_tokenizer):
    """Gemma 3 IT's and Llama 3's chat templates write the BOS themselves: the rendered text,
    tokenised with the tokenizer's special tokens (the collator's call, and TRL's on a text
    prompt), started with two. It starts with one, as apply_chat_template(tokenize=True)'s
    ids do; a base model's plain prompt keeps the one the tokenizer adds."""
    from prompting import prompt_text
    from transformers import AutoConfig, AutoModelForCausalLM

    chat = copy.deepcopy(gemma_tokenizer)
    chat.chat_template = (
        "{{ bos_token }}{% for m in messages %}<start_of_turn>user\n{{ m['content'] }}"
        "<end_of_turn>\n{% endfor %}<start_of_turn>model\n"
    )
    config = AutoConfig.for_model(
        "gemma3_text", vocab_size=len(chat), hidden_size=16, intermediate_size=32,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config)
    collator = CausalCollator(chat, model, "translation", 32, 12)
    messages = [{"role": "user", "content": "Spanish: hola\nEnglish:"}]
    expected = chat.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    assert collator._prompt("hola") == list(expected)
    assert chat(collator.prompt("hola"))["input_ids"] == list(expected)  # TRL's call
    assert list(expected).count(chat.bos_token_id) == 1
    plain = gemma_tokenizer(prompt_text(gemma_tokenizer, "translation", "hola"))["input_ids"]
    assert plain[0] == gemma_tokenizer.bos_token_id != plain[1]
