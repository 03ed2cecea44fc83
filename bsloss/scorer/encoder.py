"""The scorer encoder: text, token ids or input embeddings in, contextual token embeddings out.

It knows nothing of matching or losses. It loads any Hugging Face encoder, frozen and in eval
mode, cut at ``num_layers`` the way bert_score cuts it (the layers above are dropped, so compute
stops there), and tokenises like bert_score: ``.strip()``, special tokens added, a prefix space
for byte-level BPE tokenizers (GPT-2/RoBERTa), truncation at the model's maximum length with a
warning that counts the truncated inputs.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import Tensor, nn

from bsloss._warnings import warn_user
from bsloss.inputs import check_int
from bsloss.pretrained import hub_name, resolve_model
from bsloss.scorer.batching import (
    bucket_length,
    bucket_rows,
    progress_bar,
    token_budget_batches,
    token_budget_rows,
)
from bsloss.scorer.default import (
    DEFAULT_MODEL_NAME,
    embedded_model_installed,
    embedded_model_path,
)
from bsloss.scorer.layers import default_num_layers, freeze, num_hidden_layers, truncate_layers

__all__ = ["ScorerEncoder", "resolve_device"]

logger = logging.getLogger("bsloss")

_BYTE_LEVEL_TOKENIZERS = {
    "GPT2Tokenizer",
    "GPT2TokenizerFast",
    "RobertaTokenizer",
    "RobertaTokenizerFast",
}
_HUGE_MAX_LENGTH = 1_000_000  # tokenizers without a limit report ~1e30


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``device`` as a ``torch.device`` (``None``: CUDA when available, else CPU).

    Raises:
        ValueError: not a device name, or a CUDA device on a machine without CUDA.
    """
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"device {device!r} is not a torch device ({error})") from None
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r}: CUDA is not available on this machine")
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise ValueError(
                f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)"
            )
    return resolved


def _load(name_or_path: str):
    from transformers import AutoModel, AutoTokenizer
    from transformers.utils import logging as hf_logging

    if not sys.stderr.isatty():
        hf_logging.disable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path)
        if _BYTE_LEVEL_TOKENIZERS & {c.__name__ for c in type(tokenizer).__mro__}:
            tokenizer = AutoTokenizer.from_pretrained(name_or_path, add_prefix_space=True)
        model = AutoModel.from_pretrained(name_or_path)
    except OSError as error:
        if Path(name_or_path).exists():
            raise
        raise OSError(
            f"could not load scorer model {name_or_path!r}: it is not a local folder and the "
            "Hugging Face hub is unreachable from here (offline, or HF_HUB_OFFLINE=1). Download "
            "the model on a machine with internet (e.g. `hf download NAME --local-dir DIR`) and "
            "pass its folder: model='/path/to/DIR' and num_layers=N. model=None uses the embedded "
            "all-MiniLM-L6-v2."
        ) from error
    return tokenizer, model


class ScorerEncoder(nn.Module):
    """A frozen Hugging Face encoder cut at ``num_layers``, with its tokenizer.

    Build it with :meth:`from_pretrained`. Its parameters never require grad; gradients flow
    through it only to ``inputs_embeds``.
    """

    def __init__(self, model: nn.Module, tokenizer, name: str, num_layers: int):
        super().__init__()
        self.model = freeze(model)
        self.eval()
        self.tokenizer = tokenizer
        self.name = name
        self.num_layers = num_layers
        self.prefix_space = bool(
            _BYTE_LEVEL_TOKENIZERS & {c.__name__ for c in type(tokenizer).__mro__}
        )
        self.max_length = self._max_length()
        # The special tokens the tokenizer wraps every sentence with (CLS/SEP, BOS/EOS): they
        # weigh 0 in P and R but stay matchable, as in bert_score.
        self.special_token_ids: tuple[int, ...] = tuple(
            sorted(set(tokenizer("", add_special_tokens=True)["input_ids"]))
        )
        self.prefix_ids, self.suffix_ids = self._special_wrapping()
        self.linear_weight_dtype: torch.dtype | None = None
        self._inference_model: nn.Module | None = None
        # bert_score's all_layers: the no-grad path returns every layer's hidden states
        # (embeddings first) side by side, [B, L, (num_hidden_layers + 1) * d]
        self.all_layers = False

    def _special_wrapping(self) -> tuple[list[int], list[int]]:
        """The special ids the tokenizer puts before and after a sentence ([CLS] / [SEP])."""
        bare = self.tokenizer("a", add_special_tokens=False)["input_ids"]
        full = self.tokenizer("a", add_special_tokens=True)["input_ids"]
        for start in range(len(full) - len(bare) + 1):
            if full[start : start + len(bare)] == bare:
                return full[:start], full[start + len(bare) :]
        return [], []

    @classmethod
    def from_pretrained(
        cls,
        model: str | None = None,
        num_layers: int | None = None,
        device: str | torch.device | None = None,
        all_layers: bool = False,
    ) -> ScorerEncoder:
        """Load ``model`` (hub name or local folder; ``None``: embedded all-MiniLM-L6-v2; its hub
        name also loads the embedded copy when installed). ``all_layers``: keep every layer and
        return all their hidden states from the no-grad path (bert_score's ``all_layers``)."""
        if model is not None and not isinstance(model, str | Path):
            raise TypeError(f"model must be a name or a folder, got {type(model).__name__}")
        if num_layers is not None:
            num_layers = check_int(num_layers, "num_layers", 0)
        # Offline short names ("all-mpnet-base-v2") load their converted folder and keep the
        # hub name for the layer table and the shipped baselines.
        name = DEFAULT_MODEL_NAME if model is None else hub_name(str(model))
        if model is None or (name == DEFAULT_MODEL_NAME and embedded_model_installed()):
            path = embedded_model_path()
        else:
            path = resolve_model(str(model))
        if num_layers is None:
            num_layers = default_num_layers(name)
        tokenizer, hf_model = _load(path)
        if getattr(hf_model.config, "is_encoder_decoder", False):
            hf_model = hf_model.get_encoder()
        if num_layers > num_hidden_layers(hf_model) or num_layers < 0:
            raise ValueError(
                f"num_layers must be between 0 and {num_hidden_layers(hf_model)} for {name!r}, "
                f"got {num_layers}"
            )
        if not all_layers:
            truncate_layers(hf_model, num_layers)
        encoder = cls(hf_model, tokenizer, name, num_layers).to(resolve_device(device))
        encoder.all_layers = all_layers
        logger.info("bsloss scorer: %s, layer %d, on %s", name, num_layers, encoder.device)
        return encoder

    def _max_length(self) -> int:
        limit = int(getattr(self.tokenizer, "model_max_length", _HUGE_MAX_LENGTH))
        if limit >= _HUGE_MAX_LENGTH:
            limit = int(getattr(self.model.config, "max_position_embeddings", 512))
        return limit

    def keep_frozen(self) -> None:
        """Undo ``requires_grad_(True)`` on a module that holds the scorer.

        ``parent.requires_grad_(True)`` reaches every parameter below ``parent``, the scorer's
        too; the scorer would then collect ``.grad`` (memory, and an optimizer would update it).
        Checked at every forward pass (a scan of the parameter flags, microseconds).
        """
        thawed = [p for p in self.parameters() if p.requires_grad]
        if not thawed:
            return
        for parameter in thawed:
            parameter.requires_grad_(False)
            parameter.grad = None
        warn_user(
            f"{len(thawed)} parameters of the frozen scorer {self.name} were set to require "
            "grad (requires_grad_(True) on a module that holds it?); they were frozen again: "
            "the scorer is a fixed instrument and is never trained"
        )

    def train(self, mode: bool = True) -> ScorerEncoder:
        """The scorer is a fixed instrument: it stays in eval mode (no dropout) even when a
        module that contains it is put in training mode."""
        return super().train(False)

    @property
    def device(self) -> torch.device:
        return self.input_embeddings.weight.device

    @property
    def input_embeddings(self) -> nn.Embedding:
        """The scorer's token-embedding table ``[V, d]`` (before positions and LayerNorm)."""
        return self.model.get_input_embeddings()

    @property
    def hidden_size(self) -> int:
        return int(self.input_embeddings.weight.shape[1])

    @property
    def pad_token_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return 0 if pad is None else int(pad)

    def tokenize_checked(
        self, texts: Sequence[str], truncate: bool = True
    ) -> tuple[list[list[int]], list[int]]:
        """Token ids with special tokens, and the indices of the texts longer than
        ``max_length``: truncated there (the caller warns, naming its own positions), or kept
        whole with ``truncate=False`` (for :meth:`embed_windows`)."""
        if not texts:  # a tokenizer given an empty batch fails inside transformers
            return [], []
        prepared = [text.strip() for text in texts]
        if self.prefix_space:
            prepared = [" " + text if text else text for text in prepared]
        ids = self.tokenizer(prepared, add_special_tokens=True, truncation=False, verbose=False)[
            "input_ids"
        ]
        too_long = [i for i, row in enumerate(ids) if len(row) > self.max_length]
        if too_long and truncate:
            shortened = self.tokenizer(
                [prepared[i] for i in too_long],
                add_special_tokens=True,
                truncation=True,
                max_length=self.max_length,
            )["input_ids"]
            for i, row in zip(too_long, shortened, strict=True):
                ids[i] = row
        return [list(row) for row in ids], too_long

    def truncation_message(self, count: int, total: int, where: str) -> str:
        return (
            f"{count} of {total} inputs are longer than {self.name}'s maximum of "
            f"{self.max_length} tokens and were truncated ({where}); pass long_inputs='window' "
            "to score them whole with overlapping windows."
        )

    def tokenize(self, texts: Sequence[str], name: str = "texts") -> list[list[int]]:
        """Token ids with special tokens; truncation at ``max_length`` warns with the count."""
        ids, too_long = self.tokenize_checked(texts)
        if too_long:
            shown = ", ".join(f"{name}[{i}]" for i in too_long[:10])
            warn_user(self.truncation_message(len(too_long), len(texts), shown))
        return ids

    def keep_linear_weights_in(self, dtype: torch.dtype) -> ScorerEncoder:
        """Store the weights of the linear layers in ``dtype`` (fast mode).

        Autocast casts a float32 weight to bf16/fp16 again at every call, because its cast cache
        holds only weights that require grad, and a frozen scorer's do not (measured on CPU:
        1.10× faster bf16 encoding without those casts). LayerNorm, embeddings and the residual
        stream stay float32. From then on the encoder runs only under ``torch.autocast``.
        """
        for module in self.model.modules():
            if isinstance(module, nn.Linear):
                module.to(dtype)
        self.linear_weight_dtype = dtype
        self._inference_model = None
        return self

    def compile_inference(self) -> ScorerEncoder:
        """Encode text through ``torch.compile(dynamic=True)`` with inductor's weight freezing.

        Only the no-grad path (:meth:`embed_token_ids`, :meth:`embed_windows`) uses the
        compiled model; the first call compiles (tens of seconds on a CPU; again for a new kind
        of shape, such as a batch of one), later calls are faster. Freezing bakes the weights in:
        compile after moving the encoder to its device.
        """
        self._inference_model = torch.compile(self.model, dynamic=True, options={"freezing": True})
        return self

    def _check_precision(self) -> None:
        if self.linear_weight_dtype is not None and not torch.is_autocast_enabled(self.device.type):
            raise RuntimeError(
                f"this scorer encoder keeps its linear weights in {self.linear_weight_dtype} "
                "(the encoder of a fast-mode BERTScorer): run it under "
                f"torch.autocast({self.device.type!r}, dtype={self.linear_weight_dtype}), or "
                "build a float32 encoder with ScorerEncoder.from_pretrained()"
            )

    def forward(
        self,
        input_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        inputs_embeds: Tensor | None = None,
    ) -> Tensor:
        """Hidden states ``[B, L, d]`` of layer ``num_layers``."""
        self.keep_frozen()
        self._check_precision()
        out = self.model(
            input_ids=input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds
        )
        return out.last_hidden_state

    def _encode_without_grad(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """:meth:`forward` for the no-grad path, through the compiled model when there is one."""
        if self.all_layers:
            self._check_precision()
            model = self._inference_model or self.model
            out = model(
                input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True
            )
            return torch.cat(out.hidden_states, dim=-1)
        if self._inference_model is None or torch.is_grad_enabled():
            return self(input_ids=input_ids, attention_mask=attention_mask)
        self._check_precision()
        out = self._inference_model(input_ids=input_ids, attention_mask=attention_mask)
        return out.last_hidden_state

    def forward_token_embeddings(
        self, token_embeddings: Tensor, mask: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Run input embeddings of candidate tokens through the scorer, between the scorer's own
        special-token embeddings.

        Args:
            token_embeddings: ``[B, L, d]`` input embeddings (e.g. expected embeddings).
            mask: ``[B, L]``, true on real tokens (any pattern; real tokens are packed left).

        Returns:
            hidden states ``[B, P + L' + S, d]``, attention mask, and a mask of the special
            positions (``P``/``S``: the number of prefix/suffix special tokens, ``L'`` the
            largest number of real tokens in a row: padding beyond it is dropped, so a long
            padded batch of short rows fits the encoder).
        """
        batch = token_embeddings.shape[0]
        mask = mask.bool()
        device = token_embeddings.device
        n_prefix, n_suffix = len(self.prefix_ids), len(self.suffix_ids)
        lengths = mask.sum(dim=1)
        length = token_embeddings.shape[1]
        if n_prefix + length + n_suffix > self.max_length:
            # padding past the scorer's maximum: keep only the columns some row uses (a sync,
            # paid only by such batches)
            length = int(lengths.max()) if batch else 0
        total = n_prefix + length + n_suffix
        # Slot of each real token: right after the prefix, packed left in their original order.
        slot = n_prefix + torch.cumsum(mask.long(), dim=1) - 1
        slot = torch.where(mask, slot, torch.full_like(slot, total))  # padded -> a dropped slot
        inputs = token_embeddings.new_zeros(batch, total + 1, token_embeddings.shape[-1])
        inputs = inputs.scatter(1, slot[..., None].expand_as(token_embeddings), token_embeddings)
        inputs = inputs[:, :total]
        table = self.input_embeddings.weight
        positions = torch.arange(total, device=device)[None, :]
        special = torch.zeros(batch, total, dtype=torch.bool, device=device)
        for k, token_id in enumerate(self.prefix_ids):
            special[:, k] = True
            inputs[:, k] = table[token_id].to(inputs.dtype)
        suffix_start = n_prefix + lengths  # [B]
        for k, token_id in enumerate(self.suffix_ids):
            at = positions == (suffix_start + k)[:, None]
            special |= at
            inputs = torch.where(at[..., None], table[token_id].to(inputs.dtype), inputs)
        attention = positions < (suffix_start + n_suffix)[:, None]
        hidden = self(inputs_embeds=inputs, attention_mask=attention.long())
        return hidden, attention, special

    def embed_token_ids(
        self,
        token_ids: Sequence[Sequence[int]],
        batch_size: int,
        progress: bool | None = None,
        transform: Callable[[Tensor], Tensor] | None = None,
    ) -> list[Tensor]:
        """Hidden states ``[L_i, d]`` of each id sequence, in input order.

        Sequences are encoded longest first in token-budget batches (little padding, bounded
        memory), padded to bucketed shapes (:func:`~bsloss.scorer.batching.bucket_length`,
        :func:`~bsloss.scorer.batching.bucket_rows`) so that a long run reuses a few tensor
        sizes; a sequence longer than ``max_length`` is encoded with :meth:`embed_windows`.
        ``transform`` (e.g. a normalisation) is applied to each batch's ``[B, L, d]`` hidden
        states at once.

        The results are views of one packed ``[sum L_i, d]`` tensor laid out in encoding order:
        the real tokens of each batch are selected straight into their slice of it, so the
        embeddings are held once, in one block, and no temporary depends on the batch's exact
        token count.
        """
        transform = transform or (lambda hidden: hidden)
        sizes = [len(ids) for ids in token_ids]
        long = [i for i, size in enumerate(sizes) if size > self.max_length]
        short = sorted(
            (i for i, size in enumerate(sizes) if size <= self.max_length),
            key=lambda i: sizes[i],
            reverse=True,
        )
        offsets: dict[int, int] = {}  # the packed layout: encoding order
        offset = 0
        for i in long + short:
            offsets[i] = offset
            offset += sizes[i]
        packed: Tensor | None = None

        def slots(first: int, count: int, like: Tensor) -> Tensor:
            """The ``count`` packed rows that start at text ``first`` (allocated like ``like``
            on first use)."""
            nonlocal packed
            if packed is None:
                packed = like.new_empty(offset, like.shape[-1])
            return packed[offsets[first] : offsets[first] + count]

        for i in long:
            rows = transform(self.embed_windows(token_ids[i]))
            slots(i, len(rows), rows).copy_(rows)
        padded_lengths = [bucket_length(sizes[i], self.max_length) for i in short]
        batches = token_budget_batches(padded_lengths, batch_size)
        for start, stop in progress_bar(batches, len(batches), progress, "bsloss: encoding"):
            members = short[start:stop]
            length = padded_lengths[start]
            rows = bucket_rows(len(members), token_budget_rows(length, batch_size))
            pad = self.pad_token_id
            input_ids = torch.tensor(
                [list(token_ids[i]) + [pad] * (length - sizes[i]) for i in members]
                + [[pad] * length] * (rows - len(members)),
                dtype=torch.long,
            )
            real_lengths = torch.tensor([sizes[i] for i in members] + [0] * (rows - len(members)))
            real = torch.arange(length)[None, :] < real_lengths[:, None]
            # a filler row attends to one token, not none: not every attention implementation
            # handles a fully masked row (a softmax over only -inf is NaN)
            filler_first_token = (torch.arange(rows)[:, None] >= len(members)) & (
                torch.arange(length)[None, :] == 0
            )
            attended = real | filler_first_token
            hidden = transform(
                self._encode_without_grad(input_ids.to(self.device), attended.to(self.device))
            )
            flat_hidden = hidden.reshape(rows * length, -1)
            token_rows = real.flatten().nonzero().squeeze(1).to(self.device)
            # row-major: sequence by sequence, which is the packed layout of ``members``
            out = slots(members[0], len(token_rows), flat_hidden)
            torch.index_select(flat_hidden, 0, token_rows, out=out)
            del hidden, flat_hidden
        if packed is None:
            return []
        return [packed[offsets[i] : offsets[i] + sizes[i]] for i in range(len(sizes))]

    def embed_windows(self, ids: Sequence[int], overlap: float = 0.5) -> Tensor:
        """Hidden states ``[len(ids), d]`` of a token sequence longer than ``max_length``.

        The content between the special tokens is cut into windows of ``max_length`` tokens
        (special tokens included) that overlap by ``overlap``; each window is encoded with the
        scorer's own special tokens, and every content token takes its vector from the window in
        which it lies farthest from an edge (the most context on both sides). The prefix special
        tokens come from the first window, the suffix ones from the last.
        """
        n_prefix, n_suffix = len(self.prefix_ids), len(self.suffix_ids)
        content = list(ids[n_prefix : len(ids) - n_suffix])
        width = self.max_length - n_prefix - n_suffix
        stride = max(1, int(width * (1 - overlap)))
        starts = list(range(0, max(len(content) - width, 0) + 1, stride))
        if starts[-1] + width < len(content):
            starts.append(len(content) - width)
        windows = [self.prefix_ids + content[a : a + width] + self.suffix_ids for a in starts]
        input_ids = torch.tensor(windows, device=self.device)  # all windows have the full width
        hidden = self._encode_without_grad(input_ids, torch.ones_like(input_ids))
        position = torch.arange(len(content), device=self.device)
        start = torch.tensor(starts, device=self.device)
        offset = position[None, :] - start[:, None]  # [windows, tokens]
        inside = (offset >= 0) & (offset < width)
        margin = torch.minimum(offset, width - 1 - offset).masked_fill(~inside, -1)
        best = margin.argmax(dim=0)  # the window where each token is most central
        rows = hidden[best, n_prefix + offset[best, position]]
        return torch.cat([hidden[0, :n_prefix], rows, hidden[-1, hidden.shape[1] - n_suffix :]])

    def describe(self) -> str:
        return f"{self.name} (layer {self.num_layers})"
