r"""A model's forward pass that stops before its LM head, and the one token cross-entropy.

A language model's last step, :math:`z = \kappa \tanh\big((h W^\top + b) / \kappa\big)`, makes
``[B, L, V]`` logits: 4 GB in float32 for a batch of 16 x 256 tokens of Gemma 3's 262,144-token
vocabulary. Training needs them only inside two sums over the vocabulary, the cross-entropy's
normaliser and the BERTScore loss's expected embedding, which
:mod:`bsloss.functional.fused_expectation` computes chunk by chunk from :math:`h` and :math:`W`.

:func:`lm_head_inputs` is the model's own forward with the head taken out: inside the block the
output-embedding module is a pass-through (so ``outputs.logits`` are the head's input
:math:`h`), a soft-cap (Gemma 2's ``final_logit_softcapping``, wherever the forward reads it:
the config, its text config or its decoder's) and BART's ``final_logits_bias`` are off, and the
block yields the head (:class:`LMHead`: weight, bias, soft-cap) whose :meth:`LMHead.inputs`
:class:`~bsloss.BERTScoreLoss` takes as its candidates. It works for causal and
encoder-decoder models, tied or untied heads, under DDP (the head's weight is a parameter of the
model; its gradient arrives in the same backward pass) and under FSDP 2 (``fully_shard``): there
the head's weight is sharded outside its unit's forward, so the chunked computation runs through
:meth:`LMHead.run`, which calls it as a forward method of that unit
(``torch.distributed.fsdp.register_fsdp_forward_method``): FSDP gathers the weight before,
re-shards it after, gathers it again for the backward pass and reduce-scatters its gradient.
The first FSDP (the ``FullyShardedDataParallel`` wrapper) is refused, named: it gathers only
inside its wrapper's ``forward``; use ``fully_shard`` or the dense path
(``BERTScoreTrainerMixin(bertscore_fused=False)``).

:func:`token_cross_entropy` is the package's one cross-entropy of target tokens, from dense
logits or chunked from :math:`h` and the head.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from bsloss.candidate_inputs import LMHeadInputs
from bsloss.functional.fused_expectation import (
    IGNORE_INDEX,
    check_target_ids,
    fused_token_log_likelihood,
)
from bsloss.inputs import as_token_ids, check_targets_shape

__all__ = ["IGNORE_INDEX", "LMHead", "lm_head_inputs", "lm_head_refusal", "token_cross_entropy"]


class LMHead(nn.Module):
    """The LM head's weight ``[V, d]`` and bias (references to the model's parameters, not
    copies) and the model's final logit soft-cap (``None`` for most models);
    :meth:`inputs` gives :class:`~bsloss.BERTScoreLoss` the head's input with the head and its
    soft-cap as one value.

    Under FSDP 2 the weight is usable only inside :meth:`run`; elsewhere it is a shard."""

    def __init__(
        self,
        weight: Tensor,
        bias: Tensor | None,
        softcap: float | None,
        *,
        module: nn.Module | None = None,
        extra_bias: Tensor | None = None,
        owner: nn.Module | None = None,
    ):
        super().__init__()
        self.weight, self.bias, self.softcap = weight, bias, softcap
        # FSDP 2: the head module (its weight read afresh inside the owner's forward), BART's
        # final_logits_bias, and the fully_shard unit whose forward gathers the weight
        self._module, self._extra_bias, self._owner = module, extra_bias, owner

    def inputs(self, hidden_states: Tensor, temperature: float = 1.0) -> LMHeadInputs:
        """The head's input ``[B, L, d]`` with this head and its soft-cap, as the loss takes it
        (:class:`~bsloss.candidate_inputs.LMHeadInputs`)."""
        return LMHeadInputs(hidden_states, self, softcap=self.softcap, temperature=temperature)

    def run(self, compute: Callable[..., Any], *args: Any) -> Any:
        """``compute(head, *args)``: the chunked computation over the head's weight. Under FSDP 2
        it runs as a forward method of the unit that owns the weight (gathered for it, and for
        its backward pass); ``compute``'s output must be a tensor or a tuple / list / dict of
        tensors (FSDP hooks the backward pass on them)."""
        if self._owner is None:
            return compute(self, *args)
        return self._owner._bsloss_head_forward(self._gathered_call, compute, *args)

    def _gathered_call(self, compute: Callable[..., Any], *args: Any) -> Any:
        module = self._module
        bias = module.bias
        if self._extra_bias is not None:
            bias = self._extra_bias[0] if bias is None else bias + self._extra_bias[0]
        return compute(LMHead(module.weight, bias, self.softcap), *args)


def _head_forward(call: Callable[..., Any], *args: Any) -> Any:
    return call(*args)


def _fsdp2_owner(chain: list[nn.Module]) -> nn.Module | None:
    """The ``fully_shard`` unit that manages the head's weight (of ``chain``, the modules from
    the model down to the head, the nearest sharded one), prepared for :meth:`LMHead.run`;
    None when nothing is sharded."""
    try:
        from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method
    except ImportError:  # a torch without FSDP 2
        return None
    owner = next((m for m in reversed(chain) if isinstance(m, FSDPModule)), None)
    if owner is not None and not hasattr(owner, "_bsloss_head_forward"):
        owner._bsloss_head_forward = _head_forward
        register_fsdp_forward_method(owner, "_bsloss_head_forward")
    return owner


class _PassThrough(nn.Module):
    def forward(self, hidden: Tensor) -> Tensor:
        return hidden


def _refuse_fsdp1(model: nn.Module) -> None:
    for module in model.modules():
        if type(module).__name__ == "FullyShardedDataParallel":
            raise ValueError(
                "lm_head_inputs: the model is wrapped in FullyShardedDataParallel (FSDP 1), whose "
                "LM-head weight is gathered only inside the wrapper's forward; shard it with "
                "fully_shard (FSDP 2) or use the dense path (bertscore_fused=False)"
            )


SOFTCAP_ATTRIBUTE = "final_logit_softcapping"


def _module_chain(model: nn.Module, module: nn.Module) -> tuple[list[nn.Module], str]:
    """The modules from ``model`` down to ``module`` (a descendant), and its name in its
    parent."""
    for path, candidate in model.named_modules():
        if candidate is module and path:
            names = path.split(".")
            depths = range(len(names) + 1)
            return [model.get_submodule(".".join(names[:depth])) for depth in depths], names[-1]
    raise ValueError(
        f"lm_head_inputs: the output embedding is not a submodule of {type(model).__name__}"
    )


def _final_logits_bias_owner(modules: list[nn.Module]) -> nn.Module | None:
    """The innermost of ``modules`` holding a ``final_logits_bias`` tensor of its own (not one
    read through a wrapper's attribute forwarding), or None."""
    for module in reversed(modules):
        held = {**module._parameters, **module._buffers, **vars(module)}.get("final_logits_bias")
        if isinstance(held, Tensor):
            return module
    return None


def _configs_read_for_the_cap(model: nn.Module, modules: list[nn.Module]) -> list[Any]:
    """The configs a forward that applies the head may read its soft-cap from: each module's
    own (Gemma 2 / 3: ``self.config``), its text config (Gemma 3n / 4 conditional generation:
    ``config.get_text_config()``) and decoder sub-config (T5Gemma: ``get_decoder().config``)."""
    configs = [getattr(m, "config", None) for m in modules]
    for config in list(configs):
        configs += [getattr(config, name, None) for name in ("text_config", "decoder", "generator")]
        if hasattr(config, "get_text_config"):
            # (it refuses when several text configs exist; those are collected by name above)
            with contextlib.suppress(ValueError):
                configs.append(config.get_text_config())
    get_decoder = getattr(model, "get_decoder", None)
    if callable(get_decoder):
        with contextlib.suppress(AttributeError, NotImplementedError):  # has no decoder
            configs.append(getattr(get_decoder(), "config", None))
    unique = {id(c): c for c in configs if c is not None and hasattr(c, SOFTCAP_ATTRIBUTE)}
    return list(unique.values())


@functools.cache
def _source_names_the_cap(cls: type) -> bool | None:
    """Whether the source file that defines ``cls`` names ``final_logit_softcapping`` anywhere
    (its forward or a helper beside it); None when that source cannot be read (a class made at
    run time, a frozen or compiled module)."""
    try:
        return SOFTCAP_ATTRIBUTE in inspect.getsource(inspect.getmodule(cls))
    except (OSError, TypeError):
        return None


def _forward_may_read_the_cap(modules: list[nn.Module]) -> bool:
    """False when no forward that runs the head can read a ``final_logit_softcapping``: every
    class that defines a ``forward`` in the modules' class hierarchies (a subclass's own and the
    one it inherits) comes from a source file that never names it. A config may hold a cap its
    model does not apply: transformers 5.17's PaliGemma keeps Gemma 2's cap in its text config
    and never reads it (5.24's applies it); carried to the loss, the cap bent logits the model
    leaves straight. True (the config is trusted) when some such source cannot be read."""
    for module in modules:
        for cls in type(module).__mro__:
            defines_forward = cls is not nn.Module and "forward" in vars(cls)
            if defines_forward and _source_names_the_cap(cls) is not False:
                return True
    return False


def _softcap_places(model: nn.Module, modules: list[nn.Module]) -> tuple[list[Any], float | None]:
    """Every object whose ``final_logit_softcapping`` the forward may read (the configs above and
    a module that copied it, as DiffusionGemma does), and the one cap they hold; none where no
    forward that runs the head reads one (:func:`_forward_may_read_the_cap`).

    Raises ValueError naming ``model``'s class for a cap it cannot account for: holders that
    disagree, or another soft-cap after the head (a ``*softcap*`` attribute or submodule of
    the modules that run the head, such as Inkling 2's ``logit_softcap``)."""
    cls = type(model).__name__
    reads_the_cap = _forward_may_read_the_cap(modules)
    places = _configs_read_for_the_cap(model, modules) if reads_the_cap else []
    for module in modules:
        for name, value in {**vars(module), **module._modules}.items():
            if name == SOFTCAP_ATTRIBUTE:
                if reads_the_cap:
                    places.append(module)
            elif "softcap" in name and value is not None:
                raise ValueError(
                    f"lm_head_inputs: {cls} applies a soft-cap after its LM head that cannot be "
                    f"switched off ({type(module).__name__}.{name} = {value!r}); use the dense "
                    "path (bertscore_fused=False)"
                )
    caps = {getattr(place, SOFTCAP_ATTRIBUTE) for place in places} - {None}
    if len(caps) > 1:
        held = [f"{type(place).__name__}: {getattr(place, SOFTCAP_ATTRIBUTE)}" for place in places]
        raise ValueError(
            f"lm_head_inputs: {cls} holds different final logit soft-caps "
            f"({', '.join(held)}); cannot tell which its forward applies; use the dense path "
            "(bertscore_fused=False)"
        )
    return places, next(iter(caps), None)


@contextlib.contextmanager
def _softcap_off(model: nn.Module, places: list[Any]) -> Iterator[None]:
    """``final_logit_softcapping = None`` on every place that holds a cap, for the block; each
    restored after. Refused, named, where a place does not take it."""
    switched: list[tuple[Any, float]] = []
    try:
        for place in places:
            cap = getattr(place, SOFTCAP_ATTRIBUTE)
            if cap is None:
                continue
            with contextlib.suppress(AttributeError, TypeError):  # a read-only attribute
                setattr(place, SOFTCAP_ATTRIBUTE, None)
                switched.append((place, cap))
            if getattr(place, SOFTCAP_ATTRIBUTE) is not None:
                raise ValueError(
                    f"lm_head_inputs: {type(model).__name__}'s soft-cap "
                    f"{type(place).__name__}.{SOFTCAP_ATTRIBUTE} cannot be switched off; use "
                    "the dense path (bertscore_fused=False)"
                )
        yield
    finally:
        for place, cap in switched:
            setattr(place, SOFTCAP_ATTRIBUTE, cap)


def _plain_head(model: nn.Module) -> nn.Module:
    """The model's output embedding, refused, named, unless it is a plain ``nn.Linear`` (its
    output is ``h Wᵀ + b``, which the chunked pass recomputes from the weight and bias; a LoRA,
    quantised or wrapped head computes something else)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(head, _PassThrough):  # its head is out for an lm_head_inputs block now
        raise ValueError(
            f"lm_head_inputs: {type(model).__name__} is inside an lm_head_inputs block already "
            "(its LM head is taken out until the block ends); the blocks do not nest"
        )
    if head is None or not isinstance(getattr(head, "weight", None), Tensor):
        raise ValueError(
            f"lm_head_inputs: {type(model).__name__} has no output embedding (LM head) with a "
            "weight; pass the model itself, not a wrapper (accelerator.unwrap_model(model))"
        )
    if not isinstance(head, nn.Linear) or type(head).forward is not nn.Linear.forward:
        raise ValueError(
            f"lm_head_inputs: {type(model).__name__}'s LM head is a "
            f"{type(head).__module__}.{type(head).__qualname__}, not a plain torch.nn.Linear: "
            "its output is not h @ weight.T + bias; use the dense path (bertscore_fused=False)"
        )
    return head


def lm_head_refusal(model: nn.Module) -> str | None:
    """Why :func:`lm_head_inputs` refuses ``model`` (its error message), or None when it serves
    it. :class:`~bsloss.integrations.huggingface.BERTScoreTrainerMixin` takes the fused path by
    default only when this is None."""
    try:
        with lm_head_inputs(model):
            pass
    except ValueError as error:
        return str(error)
    return None


@contextlib.contextmanager
def lm_head_inputs(model: nn.Module) -> Iterator[LMHead]:
    """Within the block ``model(...)`` returns the LM head's input ``[B, L, d]`` as its
    ``.logits``; yields the :class:`LMHead` to score them with.

    The final logit soft-cap is found wherever the forward reads it (``final_logit_softcapping``
    of the model's config, its text config or decoder sub-config, or the model's own attribute),
    switched off there for the block, restored after, and carried as ``head.softcap``. A cap
    that no forward running the head reads (the source files of their classes never name
    ``final_logit_softcapping``, as transformers 5.17's PaliGemma, whose text config holds one)
    is left alone: ``head.softcap`` is then None, as the model's own logits are uncapped.

    Args:
        model: a transformers model with an output embedding (``get_output_embeddings()``),
            not wrapped (pass ``accelerator.unwrap_model(model)``; a DDP wrapper around it may
            run the forward).

    Raises:
        ValueError: naming the model's class: it has no output embedding, its head is not a
            plain ``nn.Linear`` (LoRA, quantised, wrapped), it applies a soft-cap after the head
            that cannot be switched off or holds different caps in different configs, or it is
            wrapped in FSDP 1's ``FullyShardedDataParallel``.

    >>> import torch, transformers
    >>> config = transformers.GPT2Config(
    ...     vocab_size=50, n_embd=8, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0
    ... )
    >>> model = transformers.GPT2LMHeadModel(config).eval()
    >>> ids = torch.tensor([[1, 2, 3]])
    >>> with lm_head_inputs(model) as head:
    ...     hidden = model(input_ids=ids).logits
    >>> hidden.shape, torch.allclose(hidden @ head.weight.T, model(input_ids=ids).logits)
    (torch.Size([1, 3, 8]), True)
    """
    head = _plain_head(model)
    _refuse_fsdp1(model)
    chain, name = _module_chain(model, head)
    parent, runs_the_head = chain[-2], chain[:-1]
    places, softcap = _softcap_places(model, runs_the_head)
    bias = head.bias
    # BART (Marian, mBART, Pegasus...) adds its final_logits_bias after the head, in the forward
    # of the module that holds it: switched off there (a PEFT wrapper only forwards reads)
    bias_owner = _final_logits_bias_owner(runs_the_head)
    extra = None if bias_owner is None else bias_owner.final_logits_bias
    if extra is not None:
        bias = extra[0] if bias is None else bias + extra[0]
    # the soft-cap is applied after the head: off in the model, given to the loss instead
    with _softcap_off(model, places):
        owner = _fsdp2_owner(chain)
        try:
            if extra is not None:
                bias_owner.final_logits_bias = torch.zeros_like(extra[:, :1])
            setattr(parent, name, _PassThrough())
            yield LMHead(
                head.weight,
                bias,
                softcap,
                module=head,
                extra_bias=extra,
                owner=owner,
            )
        finally:
            setattr(parent, name, head)
            if extra is not None:
                bias_owner.final_logits_bias = extra


def token_cross_entropy(
    labels: Tensor,
    *,
    logits: Tensor | None = None,
    hidden_states: Tensor | None = None,
    head: LMHead | Tensor | nn.Module | None = None,
    reduction: str = "mean",
    check_targets: bool = True,
) -> Tensor:
    """``-log q(labels)`` per target token (``-100`` ignored), from ``[..., V]`` logits or, without
    them, chunked from the head's input ``hidden_states`` ``[..., d]`` and ``head`` (an
    :class:`LMHead`, whose soft-cap applies, or a weight / module).

    Args:
        labels: integer targets, the shape of the logits' leading dimensions.
        logits, hidden_states: exactly one.
        head: with ``hidden_states``.
        reduction: ``"mean"`` over the target tokens (0 when there are none), ``"sum"``, or
            ``"none"`` (the shape of ``labels``, 0 at ignored positions).
        check_targets: refuse labels outside ``[0, V)`` (other than ``-100``), naming the
            first as ``labels[b, t]``: one read of the device (torch's own check fails as an
            ``IndexError`` on the CPU, a device-side assert that breaks the process's CUDA
            context on a GPU). ``False`` for a caller that has checked them.

    Raises:
        ValueError: not exactly one of ``logits`` / ``hidden_states``, a missing ``head``, an
            unknown ``reduction``, ``labels`` of another shape than their leading dimensions
            (both named), or outside the vocabulary (named).

    >>> import torch
    >>> logits, labels = torch.randn(2, 3, 10), torch.tensor([[1, 2, -100], [3, 4, 5]])
    >>> ce = token_cross_entropy(labels, logits=logits)
    >>> torch.allclose(ce, torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels))
    True
    """
    if (logits is None) == (hidden_states is None):
        raise ValueError("token_cross_entropy: pass exactly one of logits or hidden_states")
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    inputs, name = (hidden_states, "hidden_states") if logits is None else (logits, "logits")
    labels = as_token_ids(labels, "labels")
    check_targets_shape(labels, "labels", inputs, name)
    flat_labels = labels.reshape(-1)
    if logits is not None:
        if check_targets:
            check_target_ids(labels, logits.shape[-1], "labels")
        per_token = nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(),
            flat_labels,
            ignore_index=IGNORE_INDEX,
            reduction="none",
        )
    else:
        if head is None:
            raise ValueError("token_cross_entropy: hidden_states needs head (the LM head)")
        # only the positions with a target go through the head: in a causal LM's batch the
        # prompt's positions (labels -100) are often most of it, and each costs a pass over V
        # (one read of the device for their number; gathered and put back by their ids, which
        # read nothing more, forward or backward, where boolean indexing would each time)
        rows = (flat_labels != IGNORE_INDEX).nonzero().squeeze(1)
        # the range is checked on the labels, where an error can name [b, t] (the pass would
        # name a row of the selection); right after the read above, this one waits for little
        weight = getattr(head, "weight", head)
        checked_here = isinstance(weight, Tensor) and weight.dim() == 2
        if checked_here and check_targets:
            check_target_ids(labels, weight.shape[0], "labels")
        log_likelihood = fused_token_log_likelihood(
            hidden_states.reshape(-1, hidden_states.shape[-1]).index_select(0, rows),
            head,
            flat_labels[rows],
            softcap=getattr(head, "softcap", None),
            check_targets=check_targets and not checked_here,
        )
        per_token = log_likelihood.new_zeros(flat_labels.shape).index_copy(0, rows, -log_likelihood)
    if reduction == "none":
        return per_token.reshape(labels.shape)
    total = per_token.sum()
    if reduction == "sum":
        return total
    return total / (flat_labels != IGNORE_INDEX).sum().clamp_min(1)
