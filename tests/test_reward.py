"""BERTScoreReward: TRL's reward-function call, formats, reference cache, and a GRPO smoke run."""

from __future__ import annotations

import pickle

import pytest
import torch
from _helpers import tiny_training_arguments

import bsloss
from bsloss import BERTScorer
from bsloss.reward import BERTScoreReward
from bsloss.scorer import reference_cache

CANDS = ["A man is playing a guitar.", "The cat sleeps on the mat.", "Stocks fell sharply today."]
REFS = ["A man plays the guitar.", "A cat is sleeping on a rug.", "Markets dropped on Tuesday."]


@pytest.fixture(scope="module")
def reward(scorer) -> BERTScoreReward:
    return BERTScoreReward(scorer=bsloss.BERTScorer(encoder=scorer.encoder))


def test_reward_is_bertscorer_f(reward, scorer):
    expected = scorer.score(CANDS, REFS)[2].tolist()
    got = reward(prompts=["p"] * 3, completions=CANDS, reference=REFS)
    assert isinstance(got, list) and all(isinstance(x, float) for x in got)
    assert got == pytest.approx(expected, abs=1e-6)
    assert len(set(got)) == 3


def test_conversational_completions_and_reference_lists(reward):
    plain = reward(completions=CANDS, reference=REFS)
    chat = [[{"role": "assistant", "content": c}] for c in CANDS]
    assert reward(
        prompts=[[{"role": "user", "content": "q"}]] * 3, completions=chat, reference=REFS
    ) == pytest.approx(plain, abs=1e-6)
    # a list of references per completion: the best one counts
    multi = reward(completions=CANDS, reference=[[r, "Unrelated words here."] for r in REFS])
    assert multi == pytest.approx(plain, abs=1e-6)


def test_a_completion_that_ends_on_a_tool_message_scores_its_last_answer(reward, scorer):
    """A multi-turn completion with tools may end on the tool's output: the last assistant
    message is the model's answer (audit h26: the tool's output was scored, 0.127 against a
    reference equal to the answer). Messages without roles: the last one, as before."""
    plain = reward(completions=CANDS, reference=REFS)
    with_tools = [
        [
            {"role": "assistant", "content": c},
            {"role": "tool", "content": '{"temperature": 21}'},
        ]
        for c in CANDS
    ]
    assert reward(completions=with_tools, reference=REFS) == pytest.approx(plain, abs=1e-6)
    no_roles = [[{"content": "Unrelated words here."}, {"content": c}] for c in CANDS]
    assert reward(completions=no_roles, reference=REFS) == pytest.approx(plain, abs=1e-6)
    with pytest.raises(TypeError, match="got ScorerEncoder; pass a loaded scorer as encoder="):
        BERTScorer(scorer.encoder)


def test_multimodal_text_parts_are_joined_and_a_malformed_one_is_named(reward):
    """Multimodal message content: its text parts joined score as the plain text; a text
    part without ``"text"`` scored as an empty string, silently (audit h23, N2), and one whose
    text is None was named by its completion only."""
    plain = reward(completions=CANDS, reference=REFS)
    parts = [
        [{"role": "assistant", "content": [{"type": "image"}, {"type": "text", "text": c}]}]
        for c in CANDS
    ]
    assert reward(completions=parts, reference=REFS) == pytest.approx(plain, abs=1e-6)
    broken = [*parts[:2], [{"role": "assistant", "content": [{"type": "text"}]}]]
    with pytest.raises(TypeError, match=r"completions\[2\] content\[0\]\['text'\] is missing"):
        reward(completions=broken, reference=REFS)
    broken[2][0]["content"][0]["text"] = None
    with pytest.raises(TypeError, match=r"completions\[2\] content\[0\]\['text'\]"):
        reward(completions=broken, reference=REFS)


def test_reference_column_and_target(scorer):
    reward = BERTScoreReward(
        scorer=bsloss.BERTScorer(encoder=scorer.encoder),
        reference_column="summary",
        target="precision",
    )
    assert reward.__name__ == "bertscore_precision"
    got = reward(completions=CANDS, summary=REFS, trainer_state=None)
    assert got == pytest.approx(scorer.score(CANDS, REFS)[0].tolist(), abs=1e-6)
    with pytest.raises(KeyError, match="'summary'.*\\['reference'\\]"):
        reward(completions=CANDS, reference=REFS, completion_ids=[[1]] * 3)
    with pytest.raises(TypeError, match=r"completions\[1\]"):
        reward(completions=["ok", 3, "x"], summary=REFS)
    with pytest.raises(ValueError, match="3 completions but 2 references"):
        reward(completions=CANDS, summary=REFS[:2])
    # prompts are not read, but a different number of them is not this batch (audit h23, N1)
    with pytest.raises(ValueError, match="3 completions but 2 prompts"):
        reward(prompts=["p"] * 2, completions=CANDS, summary=REFS)


def test_reference_embeddings_are_cached_across_calls(scorer, monkeypatch):
    reward = BERTScoreReward(scorer=bsloss.BERTScorer(encoder=scorer.encoder))
    first = reward(completions=CANDS, reference=REFS)
    encoded: list[int] = []
    original = reference_cache.embed_token_ids

    def counting(encoder, token_ids, *args, **kwargs):
        encoded.append(len(token_ids))
        return original(encoder, token_ids, *args, **kwargs)

    monkeypatch.setattr(reference_cache, "embed_token_ids", counting)
    second = reward(completions=list(reversed(CANDS)), reference=REFS)
    assert sum(encoded) == len(CANDS)  # only the new candidate texts
    assert second[1] == pytest.approx(first[1], abs=1e-6)  # same middle pair
    assert len(reward.scorer._reference_cache) == len(REFS)


def test_reference_cache_evicts_oldest(scorer):
    cached = bsloss.BERTScorer(encoder=scorer.encoder, reference_cache_size=2)
    cached.score(CANDS, REFS)
    assert list(cached._reference_cache) == REFS[1:]
    for embeddings, ids in cached._reference_cache.values():
        # own storage, not a view that keeps the whole scored chunk alive
        assert embeddings.untyped_storage().nbytes() == embeddings.numel() * 4
        assert ids.untyped_storage().nbytes() == ids.numel() * 8
    with pytest.raises(ValueError, match="reference_cache_size"):
        bsloss.BERTScorer(encoder=scorer.encoder, reference_cache_size=-1)


def test_idf_true_is_refused(scorer):
    with pytest.raises(ValueError, match="idf=True"):
        BERTScoreReward(idf=True, scorer=bsloss.BERTScorer(encoder=scorer.encoder))


def test_a_scorer_of_every_layer_is_refused():
    """An ``all_layers`` scorer was taken, and the reward returned one list per layer (7 for 2
    completions): TRL's GRPO failed at its first step, "returned 7 rewards, but 2 were
    expected". It is refused when the reward is built, named."""
    every_layer = bsloss.BERTScorer(all_layers=True)
    with pytest.raises(ValueError, match="scorer has all_layers=True.*one float per completion"):
        BERTScoreReward(scorer=every_layer)


def test_a_scorer_with_idf_from_each_call_is_refused(scorer):
    """A scorer whose idf comes from each call's references would score the same pair
    differently in another batch (0 alone: log(2/2) weighs every token 0)."""
    per_call = bsloss.BERTScorer(encoder=scorer.encoder, idf=True)
    with pytest.raises(ValueError, match="scorer has idf=True.*idf=\\[...\\]"):
        BERTScoreReward(scorer=per_call)
    corpus = bsloss.BERTScorer(encoder=scorer.encoder, idf=list(REFS))
    reward = BERTScoreReward(scorer=corpus)
    alone = reward(completions=CANDS[:1], reference=REFS[:1])
    assert alone == pytest.approx(reward(completions=CANDS, reference=REFS)[:1], abs=1e-6)
    assert alone[0] > 0.5


@pytest.mark.parametrize(
    ("options", "error", "named"),
    [
        ({"target": ["f1"]}, ValueError, "target must be one of"),
        ({"target": {"f1": 1}}, ValueError, "target must be one of"),
        ({"reference_column": None}, TypeError, "reference_column must be"),
        ({"reference_column": ""}, TypeError, "reference_column must be"),
        ({"reference_column": 3}, TypeError, "reference_column must be"),
    ],
)
def test_reward_options_are_checked_when_built(scorer, options, error, named):
    """target=["f1"] failed as 'unhashable type: list'; reference_column=None was taken and
    failed at the first call (in GRPO, the first step)."""
    with pytest.raises(error, match=named):
        BERTScoreReward(scorer=bsloss.BERTScorer(encoder=scorer.encoder), **options)


@pytest.mark.parametrize(
    "settings",
    [
        {"rescale_with_baseline": True},
        {"idf": ["a corpus"]},
        {"model": "roberta-large"},
        {"num_layers": 3},
    ],
)
@pytest.mark.filterwarnings("ignore:BERTScoreReward.*deprecated:DeprecationWarning")
def test_scorer_settings_beside_a_scorer_are_refused(scorer, settings):
    """With scorer= the scorer's settings are the reward's: another one beside it was dropped
    without a word (rescale_with_baseline=True scored unrescaled)."""
    name = next(iter(settings))
    with pytest.raises(ValueError, match=f"^{name} and scorer= given together"):
        BERTScoreReward(scorer=bsloss.BERTScorer(encoder=scorer.encoder), **settings)


def test_trl_grpo_two_steps(reward, scorer, tmp_path):
    """The reward plugged as-is into TRL's GRPOTrainer for two optimisation steps of a tiny
    randomly initialised causal LM that uses the embedded scorer's tokenizer."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from _models import scorer_vocabulary_tokenizer, tiny_gpt2

    tokenizer = scorer_vocabulary_tokenizer(scorer)
    model = tiny_gpt2(tokenizer)
    calls: list[int] = []

    def recorded(**kwargs):
        rewards = reward(**kwargs)
        calls.append(len(rewards))
        return rewards

    recorded.__name__ = reward.__name__
    data = datasets.Dataset.from_dict(
        {
            "prompt": ["Summarize: the cat sat.", "Summarize: a dog ran."] * 2,
            "reference": ["The cat sat.", "A dog ran."] * 2,
        }
    )
    config = tiny_training_arguments(
        tmp_path, trl.GRPOConfig, num_generations=2, max_completion_length=6, bf16=False
    )
    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=recorded,
        args=config,
        train_dataset=data,
        processing_class=tokenizer,
    )
    trainer.train()
    assert calls and all(n == 2 for n in calls)
    logged = [entry for entry in trainer.state.log_history if "reward" in entry]
    assert len(logged) == 2
    assert all(0.0 <= entry["reward"] <= 1.0 for entry in logged)


def test_scorer_keywords_are_deprecated_for_a_scorer_object():
    """The reward's own parameters are few; the scorer's keywords warn naming scorer=."""
    import inspect
    import warnings

    parameters = inspect.signature(BERTScoreReward.__init__).parameters.values()
    named = [p for p in parameters if p.name != "self" and p.kind is not p.VAR_KEYWORD]
    assert len(named) == 6
    with pytest.warns(DeprecationWarning, match=r"batch_size=\.\.\.\) is deprecated: pass scorer="):
        old = BERTScoreReward(batch_size=3)
    new = BERTScoreReward(scorer=bsloss.BERTScorer(batch_size=3))
    assert old.scorer.batch_size == new.scorer.batch_size == 3
    completions, references = ["a cat sat", "hello there"], ["a cat sat down", "bye"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        expected = new(completions=completions, reference=references)
    assert old(completions=completions, reference=references) == expected
    with pytest.raises(TypeError, match="unexpected keyword argument 'batchsize'"):
        BERTScoreReward(batchsize=3)


def test_rc1_reward_chunk_of_only_cached_texts(scorer):
    """Every text of the second call is cached: nothing is left to tokenise."""
    reward = BERTScoreReward(scorer=BERTScorer(encoder=scorer.encoder))
    first = reward(completions=["Yes", "No"], reference=["Yes", "No"])
    second = reward(completions=["No", "Yes"], reference=["Yes", "No"])
    expected = scorer.score(["No", "Yes"], ["Yes", "No"])[2].tolist()
    assert second == pytest.approx(expected, abs=1e-6)
    assert first == pytest.approx([1.0, 1.0], abs=1e-6)


def test_rc1_scorer_passed_to_reward_is_left_unchanged(encoder):
    plain = BERTScorer(encoder=encoder)
    reward = BERTScoreReward(scorer=plain, reference_cache_size=8)
    reward(completions=["A dog.", "A cat."], reference=["A dog.", "A cat."])
    assert plain.reference_cache_size == 0 and len(plain._reference_cache) == 0
    assert len(reward.scorer._reference_cache) == 2 and reward.scorer is not plain
    # the plain scorer's own score() still works on those texts, all of them now cached by the
    # reward's copy
    p, r, f = plain.score(["A cat.", "A dog."], ["A dog.", "A cat."])
    assert torch.isfinite(f).all() and f.shape == (2,)
    reward.clear_cache()
    assert len(reward.scorer._reference_cache) == 0


def test_rc1_cached_scorer_passed_to_reward_is_shared(encoder):
    cached = BERTScorer(encoder=encoder, reference_cache_size=4)
    reward = BERTScoreReward(scorer=cached)
    reward(completions=["A dog."], reference=["A cat."])
    assert reward.scorer is cached and list(cached._reference_cache) == ["A cat."]


def test_rc10_reward_completions_as_a_string(scorer):
    reward = BERTScoreReward(scorer=scorer)
    with pytest.raises(TypeError, match="completions must be a list"):
        reward(completions="ab", reference=["a", "b"])
    with pytest.raises(TypeError, match="summary must be a list"):
        BERTScoreReward(scorer=scorer, reference_column="summary")(
            completions=["a", "b"], summary="ab"
        )
    with pytest.raises(TypeError, match="reference_cache_size"):
        BERTScoreReward(scorer=scorer, reference_cache_size=0.5)
    with pytest.raises(TypeError, match="scorer must be a BERTScorer"):
        BERTScoreReward(scorer="all-MiniLM-L6-v2")


def test_decision_scorer_and_reward_pickle(scorer):
    """A reward served by a process pool is pickled; a local lambda made that fail. Decision:
    both pickle, and the copy scores as the original."""
    reward = BERTScoreReward(scorer=scorer, reference_cache_size=10)
    for original in (scorer, reward):
        copy = pickle.loads(pickle.dumps(original))
        assert type(copy) is type(original)
    pairs = (["a cat sat", "a dog"], ["the cat sat", "the dog ran"])
    assert pickle.loads(pickle.dumps(scorer)).score(*pairs)[2].tolist() == pytest.approx(
        scorer.score(*pairs)[2].tolist(), abs=1e-6
    )
    copy = pickle.loads(pickle.dumps(reward))
    assert copy(completions=pairs[0], reference=pairs[1]) == pytest.approx(
        reward(completions=pairs[0], reference=pairs[1]), abs=1e-6
    )


def test_the_scorers_warnings_come_once_per_kind(scorer):
    """A reward is called at every step, and the scorer's warning names the call's positions,
    so Python repeated it (14 warnings in 20 calls with an empty completion at varying
    places): each kind comes once per reward now, a second kind once too."""
    import warnings

    reward = BERTScoreReward(scorer=scorer)
    references = ["a cat sat on the mat", "the dog ran", "hello there"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(20):
            completions = ["a cat sat", "a dog", "hi"]
            completions[step % 3] = ""  # scores 0, with the scorer's warning
            scores = reward(completions=completions, reference=references)
            assert scores[step % 3] == 0.0
        reward(completions=["[SEP]", "a dog", "hi"], reference=references)  # weights sum to 0
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2, messages
    assert "empty or whitespace-only" in messages[0] and "once" in messages[0]
    assert "weights of a text's tokens sum to 0" in messages[1]


def test_a_prompt_or_completion_reference_column_says_why_it_is_missing(scorer):
    reward = BERTScoreReward(scorer=scorer, reference_column="completion")
    with pytest.raises(KeyError, match="TRL passes the prompt and completion columns as"):
        reward(prompts=["p"], completions=["a cat"], reference=["a cat"])
