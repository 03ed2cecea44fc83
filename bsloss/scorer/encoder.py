"""The scorer encoder: token ids or input embeddings in, contextual token embeddings out.

One job: a frozen Hugging Face encoder and the precision it runs in. It knows nothing of
matching or losses. Its pieces live beside it:

- :mod:`~bsloss.scorer.loading`: hub name, folder or embedded default -> model cut at
  ``num_layers``, tokenizer, device;
- :mod:`~bsloss.scorer.tokenization`: text -> ids as bert_score tokenises, truncation messages
  (``encoder.tokenization``);
- :mod:`~bsloss.scorer.inference`: many id sequences -> hidden states, in bucketed token-budget
  batches, long ones through sliding windows;
- :mod:`bsloss.special_tokens`: candidate input embeddings wrapped in the special tokens (the
  loss's path).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import Tensor, nn

from bsloss._warnings import warn_user
from bsloss.scorer.attention_masks import prepared_attention_mask
from bsloss.scorer.batching import paced_by_host
from bsloss.scorer.layers import freeze
from bsloss.scorer.loading import load_scorer, resolve_device
from bsloss.scorer.tokenization import ScorerTokenizer

__all__ = ["ScorerEncoder", "usable_positions"]

logger = logging.getLogger("bsloss")

# The load_state_dict calls into a scorer model (through any parent; assign=True, which installs
# new parameter objects, included), counted on the model by a hook: with the parameters'
# in-place changes, what a cache of the scorer's outputs keys on (ScorerEncoder.weights_key).
_LOADS = "_bsloss_state_loads"


def _count_load(module: nn.Module, incompatible_keys) -> None:
    # a module-level function: a hook that is a closure would stop the model from pickling
    module.__dict__[_LOADS] = module.__dict__.get(_LOADS, 0) + 1


class ScorerEncoder(nn.Module):
    """A frozen Hugging Face encoder cut at ``num_layers``, with its tokenizer.

    Build it with :meth:`from_pretrained`. Its parameters never require grad; gradients flow
    through it only to ``inputs_embeds``.

    Attributes:
        model: the Hugging Face encoder (frozen, eval mode).
        tokenizer: the Hugging Face tokenizer.
        tokenization: bert_score's tokenisation for this scorer
            (:class:`~bsloss.scorer.tokenization.ScorerTokenizer`: ``max_length``, the special
            ids, ``encode``).
        name, num_layers: the hub name and the layer whose hidden states are the embeddings.
        all_layers: the no-grad path returns every layer's hidden states (embeddings first) side
            by side, ``[B, L, (num_hidden_layers + 1) * d]`` (bert_score's ``all_layers``).

    >>> encoder = ScorerEncoder.from_pretrained(device="cpu")
    >>> encoder.describe(), encoder.hidden_size, encoder.tokenization.max_length
    ('sentence-transformers/all-MiniLM-L6-v2 (layer 6)', 384, 512)
    """

    def __init__(self, model: nn.Module, tokenizer, name: str, num_layers: int):
        super().__init__()
        self.model = freeze(model)
        self.eval()
        self.tokenizer = tokenizer
        self.name = name
        self.num_layers = num_layers
        self.tokenization = ScorerTokenizer(
            tokenizer, name, usable_positions(model), has_position_table(model)
        )
        self.linear_weight_dtype: torch.dtype | None = None
        self._inference_model: nn.Module | None = None
        self._compiled_weights: tuple[int, int, int] | None = None  # weights_key() when compiled
        # the model's parameters, listed once per model and load (walking the modules costs
        # ~0.14 ms a call, the versions' sum ~7 us)
        # (model, loads, input embedding, its shape, parameters) when weights_key() last listed
        self._listed: tuple = (None, -1, None, None, [])
        self._listings = 0
        self.all_layers = False

    @classmethod
    def from_pretrained(
        cls,
        model: str | Path | None = None,
        num_layers: int | None = None,
        device: str | torch.device | None = None,
        all_layers: bool = False,
    ) -> ScorerEncoder:
        """Load ``model`` (hub name or local folder; ``None``: embedded all-MiniLM-L6-v2; its hub
        name also loads the embedded copy when installed) with
        :func:`~bsloss.scorer.loading.load_scorer`, on ``device``. ``all_layers``: keep every
        layer and return all their hidden states from the no-grad path."""
        hf_model, tokenizer, name, num_layers = load_scorer(model, num_layers, all_layers)
        encoder = cls(hf_model, tokenizer, name, num_layers).to(resolve_device(device))
        encoder.all_layers = all_layers
        logger.info("bsloss scorer: %s, layer %d, on %s", name, num_layers, encoder.device)
        return encoder

    def keep_frozen(self) -> None:
        """Undo ``requires_grad_(True)`` on a module that holds the scorer.

        ``parent.requires_grad_(True)`` reaches every parameter below ``parent``, the scorer's
        too; the scorer would then collect ``.grad`` (memory, and an optimizer would update it).
        Checked at every forward pass that records gradients (a scan of the parameter flags,
        microseconds): a pass without them gives the scorer no ``.grad``, and the metric's
        encoder batches, hundreds a call, skip the scan.
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
    def max_length(self) -> int:
        """The most tokens the scorer takes, special tokens included."""
        return self.tokenization.max_length

    @property
    def hidden_size(self) -> int:
        return int(self.input_embeddings.weight.shape[1])

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

    def weights_key(self) -> tuple[int, int, int]:
        """What the scorer's weights are, as a cache key can say it without reading them: the
        ``load_state_dict`` calls into its model (``assign=True`` installs new parameters), a
        new model or input embedding or one resized (tokens added), and the in-place changes of
        its parameters (their version counters, summed: a host read of no tensor; parameters
        made under inference mode keep none and count 0). The
        references' cache, the loss's candidate table and the compiled model follow it.
        Inside a compiled loss only the loads are followed."""
        model = self.model
        if torch.compiler.is_compiling():
            # traced (loss.compile()): the loads only, a Python int the graph is guarded on;
            # the version counters are not traceable
            return getattr(model, _LOADS, 0), -1, -1
        if _LOADS not in model.__dict__:
            model.__dict__[_LOADS] = 0
            model.register_load_state_dict_post_hook(_count_load)
        loads = model.__dict__[_LOADS]
        embedding = self.input_embeddings.weight
        old_model, old_loads, old_embedding, old_shape, _ = self._listed
        if (
            old_model is not model
            or old_loads != loads
            or old_embedding is not embedding
            or old_shape != embedding.shape
        ):
            # listed again: new parameter objects are counted, the replaced ones not held; a
            # new model or input embedding, or one resized in place (transformers 5's
            # resize_token_embeddings after tokens were added: the same parameter, another
            # shape, its version unchanged), is a new listing: the key changes (audit h25)
            self._listings += 1
            self._listed = (model, loads, embedding, embedding.shape, list(model.parameters()))
        versions = sum(0 if p.is_inference() else p._version for p in self._listed[4])
        return loads, self._listings, versions

    def compile_inference(self) -> ScorerEncoder:
        """Encode text through ``torch.compile(dynamic=True)`` with inductor's weight freezing.

        Only the no-grad path (:meth:`encode_without_grad`) uses the compiled model; the first
        call compiles (tens of seconds on a CPU; again for a new kind of shape, such as a batch
        of one or texts of one token, sizes Dynamo specialises), later calls are faster.
        Freezing bakes the weights in: compile after moving the encoder to its device.
        """
        self._inference_model = torch.compile(self.model, dynamic=True, options={"freezing": True})
        self._compiled_weights = self.weights_key()
        return self

    def _compiled(self) -> nn.Module | None:
        """The compiled model (:meth:`compile_inference`), compiled again when the weights
        changed since (freezing baked the old ones in)."""
        if self._inference_model is not None and self.weights_key() != self._compiled_weights:
            logger.info("bsloss scorer: the weights changed since compiling: compiling again")
            self.compile_inference()
        return self._inference_model

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
        if torch.is_grad_enabled():
            self.keep_frozen()
        self._check_precision()
        out = self.model(
            input_ids=input_ids,
            attention_mask=self._model_mask(attention_mask),
            inputs_embeds=inputs_embeds,
        )
        return out.last_hidden_state

    def _model_mask(self, attention_mask: Tensor | None) -> Tensor | None:
        """The mask as the model takes it: where the host sets the pace, a ``[B, L]`` mask is
        prepared so that the model does not read it back on the host, a wait for the card
        (:mod:`~bsloss.scorer.attention_masks`)."""
        if attention_mask is not None and attention_mask.dim() == 2 and paced_by_host(self.device):
            return prepared_attention_mask(self.model, attention_mask)
        return attention_mask

    def encode_without_grad(self, input_ids: Tensor, attention_mask: Tensor | None) -> Tensor:
        """:meth:`forward` for text outside autograd: through the compiled model when there is
        one (:meth:`compile_inference`), and every layer's hidden states with ``all_layers``."""
        compiled = self._compiled()
        if self.all_layers:
            self._check_precision()
            # (not `compiled or ...`: a module's truth is its len(), which BERT has not)
            model = compiled if compiled is not None else self.model
            mask = self._model_mask(attention_mask)
            if compiled is not None:
                _rows_and_length_apart(input_ids, mask)
            out = model(input_ids=input_ids, attention_mask=mask, output_hidden_states=True)
            return torch.cat(out.hidden_states, dim=-1)
        if compiled is None or torch.is_grad_enabled():
            return self(input_ids=input_ids, attention_mask=attention_mask)
        self._check_precision()
        mask = self._model_mask(attention_mask)
        _rows_and_length_apart(input_ids, mask)
        out = compiled(input_ids=input_ids, attention_mask=mask)
        return out.last_hidden_state

    def describe(self) -> str:
        return f"{self.name} (layer {self.num_layers})"


def _rows_and_length_apart(input_ids: Tensor, mask: Tensor | None) -> None:
    """Every size of the compiled model's inputs as a dynamic dimension of its own: the ids',
    the mask's and, for a prepared mask (a ``[B, 1, L, L]`` view), its ``[B, L]`` base's,
    which Dynamo sees too. Under ``dynamic=True`` its duck sizing gives sizes equal at the first
    call one symbol, and the metric's buckets (rows and lengths in multiples of 8 or 16) often
    make ``B == L``: the next batch then compiled the model again (~50 s on a CPU, audit h18).
    ``maybe_``: a size of 1, which Dynamo specialises, is no error."""
    for tensor in (input_ids, mask, None if mask is None else mask._base):
        for dim in range(0 if tensor is None else tensor.dim()):
            torch._dynamo.maybe_mark_dynamic(tensor, dim)


def usable_positions(model: nn.Module) -> int:
    """The most tokens ``model``'s position table takes (512 when the config names no
    ``max_position_embeddings``): the limit of a scorer whose tokenizer declares none.

    RoBERTa, XLM-R, CamemBERT, MPNet, Longformer, ESM, I-BERT and the other RoBERTa-layout
    models number positions from ``padding_idx + 1`` (a pad token's position is
    ``padding_idx``), so ``padding_idx + 1`` rows of their table are never a real token's:
    roberta-large's 514 take 512 tokens, and a 513-token text indexed past the table inside
    torch. They are told apart by what they are built from, not by a list of model types
    (which would miss forks and new members): their position table, the module named
    ``position_embeddings``, has a ``padding_idx`` (set from ``config.pad_token_id``, or
    fixed at 1 in MPNet); BERT's, ELECTRA's, ALBERT's and DistilBERT's have none, and BART's
    ``embed_positions`` already holds its offset in extra rows.
    """
    positions = int(getattr(model.config, "max_position_embeddings", None) or 512)
    for name, module in model.named_modules():
        padding_idx = getattr(module, "padding_idx", None)
        if name.rsplit(".", 1)[-1] == "position_embeddings" and isinstance(padding_idx, int):
            return positions - (padding_idx + 1)
    return positions


def has_position_table(model: nn.Module) -> bool:
    """Whether ``model`` numbers its tokens from a table of absolute positions (a module named
    ``position_embeddings`` or ``embed_positions``: BERT, RoBERTa, MPNet, BART), so that no
    text may be longer than the table (DeBERTa-v3's relative positions have none)."""
    return any(
        name.rsplit(".", 1)[-1] in ("position_embeddings", "embed_positions")
        and isinstance(module, nn.Embedding)
        for name, module in model.named_modules()
    )
