"""Prompt -> completion for decoder-only generators: prompt formats and the answer a completion
holds.

A base (not instruction-tuned) LM such as Gemma 3 270M continues text, so each task has a plain
prompt format ending where the answer starts; a tokenizer with a chat template gets the prompt as
one user message instead. A completion's answer is its first line: a base model that has said its
one-sentence summary or its translation goes on with more text, and only the answer is scored.
Batching and generation are :mod:`causal`'s.
"""

from __future__ import annotations

from tasks import get_task


def chat_template_setting(setting: bool | str) -> bool | str:
    """Config ``data.chat_template`` as ``"auto"``, ``True`` or ``False`` (``"true"`` and
    ``"false"``, as a command line gives them, too).

    Raises:
        ValueError: any other value, named.
    """
    if isinstance(setting, str) and setting.lower() in ("true", "false"):
        return setting.lower() == "true"
    if setting != "auto" and not isinstance(setting, bool):
        raise ValueError(f"data.chat_template must be auto, true or false, got {setting!r}")
    return setting


def uses_chat_template(tokenizer, setting: bool | str = "auto") -> bool:
    """Whether prompts go through the tokenizer's chat template (config ``data.chat_template``,
    :func:`chat_template_setting`): ``"auto"`` when it has one, ``True`` requires one, ``False``
    never."""
    has_one = bool(getattr(tokenizer, "chat_template", None))
    setting = chat_template_setting(setting)
    if setting == "auto":
        return has_one
    if setting and not has_one:
        name = getattr(tokenizer, "name_or_path", "the generator's tokenizer")
        raise ValueError(
            f"data.chat_template is true but {name} has no chat template (a base model); "
            "set data.chat_template: auto or false, and data.prompt_format if needed"
        )
    return setting


def prompt_text(
    tokenizer, task: str, source: str, template: str | None = None, chat: bool = False
) -> str:
    """The prompt for one source text: ``template`` (with ``{source}``), else the task's plain
    format (:mod:`tasks`); as one user message through the chat template when ``chat``.

    The text is what a tokenizer call with its special tokens turns into the prompt's ids (the
    recipes' collator makes that call, and TRL's trainers on a text prompt): a template that
    writes the BOS itself (Gemma 3 IT's, Llama 3's) has it taken off when the tokenizer adds
    one, so that the prompt starts with one BOS, as ``apply_chat_template(tokenize=True)``'s
    ids do, not two."""
    if template is None:
        template = get_task(task).prompt_format
    if "{source}" not in template:
        raise ValueError(f"prompt_format must contain '{{source}}', got {template!r}")
    text = template.format(source=source)
    if not chat:
        return text
    messages = [{"role": "user", "content": text}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    bos = tokenizer.bos_token
    if bos and text.startswith(bos) and _adds_bos(tokenizer):
        text = text[len(bos) :]
    return text


def _adds_bos(tokenizer) -> bool:
    """Whether a tokenizer call with its special tokens starts with the BOS."""
    ids = tokenizer("a")["input_ids"]
    return bool(ids) and ids[0] == tokenizer.bos_token_id


def lead(tokenizer, text: str, max_tokens: int) -> str:
    """The first ``max_tokens`` tokens of ``text`` (an article's lead), as text."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return text if len(ids) <= max_tokens else tokenizer.decode(ids[:max_tokens])


def answer(completion: str) -> str:
    """The answer a completion holds: its first non-empty line, stripped."""
    for line in completion.splitlines():
        if line.strip():
            return line.strip()
    return ""
