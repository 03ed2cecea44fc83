r"""The candidates, whichever their source, as the scorer's hidden states: the first half of
:class:`~bsloss.BERTScoreLoss` (the second, :func:`~bsloss.functional.bert_score`, matches them
to the references).

A candidate comes as one of five types (:mod:`bsloss.candidate_inputs`, which checks their type
and shape where they are built; their device and vocabulary are checked here):

- ``Logits`` or ``Probabilities`` ``[B, L, V]``: the generator's distributions :math:`p_t`, whose
  expected embeddings :math:`e_t = \sum_v p_t(v) E[v]` (after the candidate transforms of
  :mod:`bsloss.candidate_transforms`) the scorer reads (:mod:`bsloss.distributions`);
- ``LMHeadInputs`` ``[B, L, d_model]`` with the LM head: the same expectation computed chunk by
  chunk over the vocabulary, never materialising the logits
  (:mod:`bsloss.functional.fused_expectation`), with the targets' log-likelihood from that pass;
- ``TokenIds`` ``[B, L]``: the rows of the embedding table of the generator's tokens;
- ``Embeddings`` ``[B, L, d]``: the scorer's hidden states (its output, as
  :meth:`~bsloss.BERTScoreLoss.encode_references` returns them) with their importance weights,
  taken as they are: no scorer pass.

When the generator's vocabulary is not the scorer's, the table :math:`E` is the bridge's
(:mod:`bsloss.bridge`, whose mode object decides what is encoded): in ``"retokenize"`` mode the
decoded text is also encoded with the scorer's own tokenisation (no gradient), and its score
is the loss's value while the expected embeddings give the gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from bsloss._warnings import warn_user
from bsloss.bridge import BridgeMode
from bsloss.candidate_inputs import (
    CandidateInput,
    Embeddings,
    LMHeadInputs,
    Logits,
    Probabilities,
    TokenIds,
)
from bsloss.candidate_transforms import CandidateOptions
from bsloss.distributions import (
    all_true,
    check_finite_tensor,
    expected_inputs,
    most_probable_tokens,
    select_positions,
    token_distribution,
)
from bsloss.functional.fused_expectation import (
    IGNORE_INDEX,
    FusedHeadOutput,
    check_target_ids,
    fused_expected_inputs,
)
from bsloss.functional.gumbel_noise import draw_seed_tensor
from bsloss.inputs import (
    as_token_ids,
    check_device,
    check_targets_shape,
    check_tensor,
    position_of_first,
)
from bsloss.scorer.encoder import ScorerEncoder
from bsloss.special_tokens import splice_special_tokens

__all__ = ["CandidateEncoder", "EncodedCandidates"]


class EncodedCandidates(NamedTuple):
    """Candidates through the scorer: hidden states ``[B, L', d]``, mask and importance
    weights; the ``[B, L]`` log-likelihood of ``target_ids`` (fused path); and, in
    ``bridge_mode="retokenize"``, the decoded texts' own encoding (no gradient), whose score is
    the loss's value while ``hidden`` gives its gradient (:mod:`bsloss.bridge`)."""

    hidden: Tensor
    mask: Tensor
    weights: Tensor
    log_likelihood: Tensor | None = None
    exact: tuple[Tensor, Tensor, Tensor] | None = None


class CandidateEncoder:
    """Encodes candidates of any source with the frozen scorer, through the bridge mode and
    under the candidate transforms chosen when the loss was built.

    Args:
        encoder: the scorer.
        bridging: the bridge mode (:func:`bsloss.bridge.resolve_bridge_mode`).
        candidates: the resolved candidate transforms.
        idf: the loss weighs tokens by idf (``Embeddings`` must then bring their weights).

    The importance weights of the scorer's tokens are passed to each call (they are the loss's
    buffer, which follows the loss to its device). After a call that decodes (retokenize mode),
    ``last_texts`` holds the decoded candidates that were scored.
    """

    def __init__(
        self,
        encoder: ScorerEncoder,
        bridging: BridgeMode,
        candidates: CandidateOptions,
        idf: bool = False,
    ):
        self.encoder, self.bridging, self.candidates = encoder, bridging, candidates
        self.idf = idf
        self.last_texts: list[str] = []
        # the generator table and its word-start twin (or None) per (device, dtype, size, ...)
        self._tables: dict[tuple, tuple[Tensor, Tensor | None]] = {}
        self._special: dict[tuple, Tensor] = {}  # per (device, vocabulary): not content
        self._warned_noise_unused = False

    @property
    def generator_vocab_size(self) -> int:
        return self.bridging.vocab_size(self.encoder.input_embeddings.num_embeddings)

    def clear_cache(self) -> None:
        """Forget the generator embedding tables (built again on the next call)."""
        self._tables.clear()
        self._special.clear()

    def generator_table(self, scorer_weights: Tensor, size: int | None = None) -> Tensor:
        """``[V_gen, d + 1]``: input embeddings and importance weights of the generator's tokens
        (through the bridge when vocabularies differ). The scorer is frozen, so it is built once
        per device, dtype and state of the weights (:meth:`ScorerEncoder.weights_key`: a
        ``load_state_dict`` into the scorer builds it again, as do in-place changes of the
        weights or of ``scorer_weights``). ``size``: the candidates' vocabulary when a bridged
        head has rows past the tokenizer's tokens (:meth:`check_vocab`): those rows are 0,
        embedding and weight (they make no text)."""
        return self._generator_tables(scorer_weights, size)[0]

    def word_start_table(self, scorer_weights: Tensor, size: int | None = None) -> Tensor | None:
        """``[V_gen, d + 1]``: :meth:`generator_table` of the generator's tokens as word starts
        (:meth:`~bsloss.bridge.BridgeMode.tables`), for the candidate positions that
        begin a word of the decoded text; ``None`` where it would be the same table. Built and
        kept with it: through Gemma's bridge a second ``[262144, d + 1]`` table."""
        return self._generator_tables(scorer_weights, size)[1]

    def _generator_tables(
        self, scorer_weights: Tensor, size: int | None
    ) -> tuple[Tensor, Tensor | None]:
        table = self.encoder.input_embeddings.weight
        size = self.generator_vocab_size if size is None else size
        weights_version = (
            0
            if torch.compiler.is_compiling() or scorer_weights.is_inference()
            else scorer_weights._version
        )
        key = (table.device, table.dtype, self.encoder.weights_key(), weights_version)
        built = self._tables.get(key)
        if built is None or built[0].shape[0] < size:
            # a plain tensor even when first built under torch.inference_mode(): a later
            # training call saves it for backward
            with torch.inference_mode(False), torch.no_grad():
                self._tables = {}  # the old tables go before the new are built
                built = self.bridging.tables(table.detach(), scorer_weights, size)
                self._tables[key] = built
        if built[0].shape[0] == size:
            return built
        # built for a larger vocabulary (a bridged head padded past the tokenizer's tokens):
        # the rows past it are 0, so its first rows are this one's tables. Keyed on the size,
        # token ids (the tokenizer's size) and a padded head's logits, alternating, built
        # Gemma's tables again at every call (audit h26: ~0.9 s a call on a CPU)
        own, starts = built
        return own[:size], None if starts is None else starts[:size]

    def check_vocab(self, size: int, name: str) -> None:
        """Refuse candidates over ``size`` tokens where the scorer or the bridge takes another
        number. Through a bridge a head may have more rows than the generator's tokenizer has
        tokens (T5's 32,128 for 32,100, Qwen2.5's 151,936 for 151,665: padded to a multiple of
        64 or 128): its rows past them make no text, and count as special tokens."""
        expected = self.generator_vocab_size
        if size == expected:
            return
        if self.bridging.bridge is not None and size > expected:
            self.bridging.check_padded_rows(name, size)
            return
        raise ValueError(self.bridging.vocabulary_error(name, size, expected))

    def _check_mask(self, source: Tensor, name: str, candidate_mask: Tensor | None) -> Tensor:
        """The candidates' ``[B, L]`` bool mask, validated (``source`` on the scorer's device)."""
        check_device(source, name, self.encoder.device, "the scorer")
        if candidate_mask is None:
            candidate_mask = torch.ones(source.shape[:2], dtype=torch.bool, device=source.device)
        check_tensor(candidate_mask, "candidate_mask", "mask")
        if tuple(candidate_mask.shape) != tuple(source.shape[:2]):
            raise ValueError(
                f"candidate_mask must have shape {list(source.shape[:2])} "
                f"([B, L] of the candidates), got {list(candidate_mask.shape)}"
            )
        return candidate_mask.to(source.device).bool()

    def _fit_candidates(self, mask: Tensor, name: str) -> Tensor:
        """Keep at most as many real tokens per row as the scorer takes between its special
        tokens; warn naming the rows cut (their later tokens get no score and no gradient)."""
        limit = self.encoder.tokenization.content_length
        if mask.shape[1] <= limit:
            return mask
        rank = torch.cumsum(mask.long(), dim=1)
        cut = mask & (rank > limit)
        rows = cut.any(dim=1).nonzero().flatten().tolist()
        if not rows:
            return mask
        shown = ", ".join(f"{name}[{i}]" for i in rows[:10]) + (", ..." if len(rows) > 10 else "")
        fate = self.bridging.truncation
        warn_user(
            f"{len(rows)} of {mask.shape[0]} candidates have more than {limit} real tokens, "
            f"the most {self.encoder.name} takes between its special tokens ({shown}); {fate}"
        )
        return mask & ~cut

    def encode(
        self,
        scorer_weights: Tensor,
        candidates: CandidateInput,
        candidate_mask: Tensor | None = None,
        target_ids: Tensor | None = None,
    ) -> EncodedCandidates:
        """The candidates, whichever their type (:mod:`bsloss.candidate_inputs`, which checked
        their type and shape), encoded by the scorer: one method per type below.

        Args:
            scorer_weights: ``[V_scorer]`` importance weights of the scorer's tokens.
            candidates: a :class:`~bsloss.candidate_inputs.CandidateInput`.
            candidate_mask: ``[B, L]``, true on real candidate tokens (default: all).
            target_ids: ``[B, L]`` targets whose log-likelihood the fused pass also returns
                (:class:`~bsloss.candidate_inputs.LMHeadInputs` only).

        Returns:
            :class:`EncodedCandidates`.

        Raises:
            TypeError, ValueError: a wrong device, NaN/Inf, ids outside the vocabulary,
                targets without the LM head's input (all named).
        """
        name, source = candidates.name, candidates.tensor
        candidate_mask = self._check_mask(source, name, candidate_mask)
        if target_ids is not None and not isinstance(candidates, LMHeadInputs):
            raise ValueError(
                "the cross-entropy's target_ids go with hidden_states (LMHeadInputs: the LM "
                f"head's chunked pass), not with {name}"
            )
        if source.shape[0] == 0:
            return self._encode_nothing(source, name, target_ids)
        if isinstance(candidates, (Embeddings, TokenIds)):
            self._warn_noise_unused(name)
        if isinstance(candidates, Embeddings):
            return self._encode_embeddings(candidates, candidate_mask)
        if isinstance(candidates, TokenIds):
            return self._encode_ids(source, candidate_mask, name, scorer_weights)
        return self._encode_distributions(candidates, candidate_mask, target_ids, scorer_weights)

    def _warn_noise_unused(self, name: str) -> None:
        """Token ids are chosen tokens and embeddings have no scores: the candidate transforms
        have nothing to act on there. TopK and StraightThrough leave a chosen token as it is;
        Gumbel noise would have sampled it, and a loss built with it scored these candidates
        without any (audit h35): said once per loss."""
        if self.candidates.gumbel_temperature is None or self._warned_noise_unused:
            return
        self._warned_noise_unused = True
        warn_user(
            f"this loss samples its candidates with Gumbel noise, and {name} are already "
            "tokens (or the scorer's vectors), with no scores to add noise to: scored as "
            "they are, without noise (pass Logits or LMHeadInputs to sample); this loss "
            "warns once"
        )

    def _encode_nothing(
        self, source: Tensor, name: str, target_ids: Tensor | None
    ) -> EncodedCandidates:
        """An empty batch: nothing to encode (kept on the graph of the input)."""
        nothing = source.reshape(-1)[:0].float()
        empty_mask = torch.zeros(0, 0, dtype=torch.bool, device=source.device)
        hidden = nothing.reshape(0, 0, self.encoder.hidden_size)
        # the CE keeps its [0, L] (per-token weights [B, L] multiply it at every B)
        log_likelihood = None if target_ids is None else nothing.reshape(0, target_ids.shape[1])
        encoded = (hidden, empty_mask, nothing.reshape(0, 0))
        # a decoding bridge scores distributions twice (the gradient's encoding and the text's)
        twice = self.bridging.decodes and name not in ("candidate_ids", "embeddings")
        return EncodedCandidates(*encoded, log_likelihood, encoded if twice else None)

    def _encode_embeddings(
        self, candidates: Embeddings, candidate_mask: Tensor
    ) -> EncodedCandidates:
        """Scorer hidden states given as the candidates, with their weights: taken as they
        are (without weights, 1 at every masked position)."""
        embeddings, weights = candidates.values, candidates.weights
        if embeddings.shape[-1] != self.encoder.hidden_size:
            raise ValueError(
                f"embeddings must be [B, L, {self.encoder.hidden_size}] scorer "
                f"hidden states, got {list(embeddings.shape)}"
            )
        check_finite_tensor(embeddings, "embeddings")
        if weights is None:
            if self.idf:
                raise ValueError(
                    "this loss weighs tokens by idf, and embeddings come without their tokens: "
                    "pass Embeddings(hidden, weights) (encode_references returns the weights)"
                )
            return EncodedCandidates(embeddings, candidate_mask, candidate_mask.to(torch.float32))
        check_device(weights, "weights", embeddings.device, "embeddings")
        return EncodedCandidates(embeddings, candidate_mask, weights.float() * candidate_mask)

    def _encode_ids(
        self, candidate_ids: Tensor, candidate_mask: Tensor, name: str, scorer_weights: Tensor
    ) -> EncodedCandidates:
        """Token ids: their rows of the generator table, or (a decoding bridge) their text."""
        table, start_table = self._generator_tables(scorer_weights, None)
        bad = (candidate_ids < 0) | (candidate_ids >= table.shape[0])
        if (bad & candidate_mask).any():
            raise ValueError(
                f"candidate_ids has ids outside [0, {table.shape[0]}) at "
                f"candidate_ids{position_of_first(bad & candidate_mask)}"
            )
        ids = candidate_ids.clamp(0, table.shape[0] - 1)
        if self.bridging.decodes:  # the decoded text, whole: the scorer's own limit
            return EncodedCandidates(*self._retokenized(ids, candidate_mask, scorer_weights))
        starts = self.bridging.word_starts(ids, candidate_mask)
        candidate_mask = self._fit_candidates(
            self._content(ids, candidate_mask, table.shape[0]), name
        )
        rows = table[ids]
        if starts is not None:  # a token that begins a word: its pieces as a word start
            rows = torch.where(starts[..., None], start_table[ids], rows)
        return EncodedCandidates(
            *self._encode_inputs(rows[..., :-1], rows[..., -1], candidate_mask)
        )

    def _encode_distributions(
        self,
        candidates: Logits | Probabilities | LMHeadInputs,
        candidate_mask: Tensor,
        target_ids: Tensor | None,
        scorer_weights: Tensor,
    ) -> EncodedCandidates:
        """Distributions (``[B, L, V]`` logits or probabilities, or the LM head's input): their
        expected embeddings and weights under the candidate transforms; with a decoding bridge
        also the decoded argmax text's encoding (``exact``, no gradient)."""
        size, source = candidates.tensor.shape[-1], candidates.name
        if isinstance(candidates, LMHeadInputs):
            weight = getattr(candidates.head, "weight", candidates.head)
            whole = isinstance(weight, Tensor) and weight.dim() == 2
            size, source = (weight.shape[0] if whole else None), "output_embeddings"
        if size is not None:
            self.check_vocab(size, source)
        # both tables here, before the device read below: a compiled loss would guard on the
        # cache a second time after it, and compile again once it is filled
        table, start_table = self._generator_tables(scorer_weights, size)
        name = candidates.name
        whole_mask = candidate_mask
        log_likelihood = None
        # one seed per call: the dense and the fused path draw the same Gumbel noise from it;
        # a tensor, so that a compiled loss takes each call's seed as an input, not a constant
        seed = (
            None
            if self.candidates.gumbel_temperature is None
            else draw_seed_tensor(candidates.tensor.device)
        )
        if isinstance(candidates, LMHeadInputs):
            # hidden states are checked where the pass uses them, by its one read of the
            # device: a read here would wait for the whole model's forward
            # every masked position goes through the head, for its most probable token: it
            # decides which positions are content (and so which the scorer's limit cuts), and
            # a decoding bridge decodes the whole candidate, as from logits
            inputs, weights, log_likelihood, tokens, check_logits = self._fused_inputs(
                seed, candidates, target_ids, whole_mask, table
            )
        else:
            logits, probs = (
                (candidates.values, None)
                if isinstance(candidates, Logits)
                else (None, candidates.values)
            )
            distribution = token_distribution(
                logits, probs, **self.candidates.keywords(), gumbel_seed=seed, mask=whole_mask
            )
            inputs, weights = expected_inputs(distribution, table)
            # float64 logits give float64 expectations; the scorer runs in its own dtype
            inputs = inputs.to(table.dtype)
            tokens = most_probable_tokens(distribution)
            check_logits = _nothing_to_check  # checked before the expectation
        # a position whose most probable token is a special one is not content, as in the
        # decoded text; in retokenize mode that text is scored whole (the scorer's limit
        # applies to its pieces) and the one-position-per-token encoding giving the gradient
        # is cut
        candidate_mask = self._fit_candidates(
            self._content(tokens, whole_mask, table.shape[0]), name
        )
        starts = self.bridging.word_starts(tokens, whole_mask)
        if starts is not None:
            # the positions whose most probable token begins a word of the decoded text take
            # the expectation over the tokens as word starts: a second product, over them only
            # (one read of the device, for their number)
            rows = (starts & candidate_mask).flatten().nonzero().squeeze(1)
            if rows.numel():
                if isinstance(candidates, LMHeadInputs):
                    # the first pass's rows, whose finiteness it reads
                    values = self._head_pass(seed, candidates, rows, start_table).expected
                    row_inputs, row_weights = values[:, :-1], values[:, -1]
                else:
                    sub = select_positions(distribution, rows)
                    row_inputs, row_weights = (v[0] for v in expected_inputs(sub, start_table))
                inputs, weights = _replaced_rows(
                    inputs, weights, rows, row_inputs.to(table.dtype), row_weights
                )
        encoded = self._encode_inputs(inputs, weights, candidate_mask)
        check_logits()  # the head pass's finiteness, read once the scorer's forward is queued
        exact = None
        if self.bridging.decodes:
            with torch.no_grad():
                exact = self._retokenized(tokens, whole_mask, scorer_weights)
        return EncodedCandidates(*encoded, log_likelihood, exact)

    def _content(self, tokens: Tensor, mask: Tensor, size: int) -> Tensor:
        """``mask`` less the positions whose token (``[B, L]``, in the vocabulary of ``size``
        tokens: the generator's, or a bridged head's with rows past it) is not content: the
        special tokens of :meth:`~bsloss.bridge.BridgeMode.special_tokens`.

        For distributions ``tokens`` are the most probable ones, ties going to the smallest id:
        an exactly flat or tied distribution counts as its smallest tied id, a special token in
        most vocabularies (``[PAD]``/``<pad>`` at id 0). Its position is dropped here and gets
        no gradient (a zero-initialised LM head gets none: initialise it with nonzero
        weights)."""
        device = tokens.device
        key = (device, size)
        if key not in self._special:
            pad = self.encoder.tokenizer.pad_token_id
            ids = {*self.encoder.tokenization.special_token_ids, pad} - {None}
            scorer_special = torch.tensor(sorted(ids), dtype=torch.long, device=device)
            scorer_vocab = self.encoder.input_embeddings.num_embeddings
            special = self.bridging.special_tokens(scorer_special, scorer_vocab).to(device)
            # a bridged head's rows past the tokenizer's tokens (check_vocab) are no content
            special = F.pad(special, (0, size - special.shape[0]), value=True)
            self._special[key] = special
        return mask & ~self._special[key][tokens]

    def _retokenized(
        self, tokens: Tensor, mask: Tensor, scorer_weights: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The scorer's encoding of the decoded ``tokens``, tokenised as the metric tokenises
        text (:mod:`bsloss.bridge`); ``self.last_texts`` keeps the decoded texts."""
        batch = self.bridging.retokenize(tokens, mask)
        self.last_texts = batch.texts
        inputs = self.encoder.input_embeddings.weight.detach()[batch.piece_ids]
        weights = scorer_weights[batch.piece_ids].to(inputs.dtype)
        return self._encode_inputs(inputs, weights, batch.piece_mask)

    def _encode_inputs(self, inputs: Tensor, weights: Tensor, candidate_mask: Tensor):
        tokens = self.encoder.tokenization
        # the weights follow the tokens to their packed slots; special tokens weigh 0
        spliced = splice_special_tokens(
            inputs,
            candidate_mask,
            self.encoder.input_embeddings.weight,
            tokens.prefix_ids,
            tokens.suffix_ids,
            tokens.max_length,
            token_weights=weights,
        )
        hidden = self.encoder(inputs_embeds=spliced.inputs, attention_mask=spliced.attention.long())
        return hidden, spliced.attention, spliced.weights

    def _head_pass(
        self,
        seed: Tensor | None,
        candidates: LMHeadInputs,
        rows: Tensor,
        table: Tensor,
        **targets: object,
    ) -> FusedHeadOutput:
        """The LM head's pass over the flat positions ``rows`` of ``[B, L]`` with ``table``,
        under the loss's candidate options; the Gumbel noise is addressed by the position in
        ``[B, L]``, as on the dense path, so every pass of a call draws the same. Finiteness is
        returned unread (the caller reads it once); ``targets``: ``target_ids`` and
        ``check_targets`` of :func:`fused_expected_inputs`."""
        return fused_expected_inputs(
            candidates.hidden_states.flatten(0, 1).index_select(0, rows),
            candidates.head,
            table,
            softcap=candidates.softcap,
            temperature=candidates.temperature,
            top_k=self.candidates.top_k,
            straight_through=self.candidates.straight_through,
            gumbel_temperature=self.candidates.gumbel_temperature,
            gumbel_seed=seed,
            row_ids=rows,
            check_finite=False,
            **targets,
        )

    def _fused_inputs(
        self,
        seed: Tensor | None,
        candidates: LMHeadInputs,
        target_ids: Tensor | None,
        candidate_mask: Tensor,
        table: Tensor,
    ) -> tuple[Tensor, Tensor, Tensor | None, Tensor, Callable[[], None]]:
        """Expected inputs and weights ``[B, L, d]``, ``[B, L]`` from the LM head's input and
        weight, chunked (:mod:`bsloss.functional.fused_expectation`), the targets'
        log-likelihood ``[B, L]`` from the same pass, the most probable tokens ``[B, L]``
        (what ``bridge_mode="retokenize"`` decodes), and the check that the pass's logits were
        finite, to call once more work is queued: on a GPU its read waits for the whole pass,
        and the host would sit idle while the card runs it."""
        hidden_states, output_embeddings = candidates.hidden_states, candidates.head
        softcap, temperature = candidates.softcap, candidates.temperature
        weight = getattr(output_embeddings, "weight", output_embeddings)
        if isinstance(weight, Tensor) and weight.dim() == 2:  # its rows: checked by the caller
            check_device(weight, "output_embeddings", hidden_states.device, "hidden_states")
        # Only the positions that are scored (or decoded) or have a target go through the head.
        selected = candidate_mask
        if target_ids is not None:
            target_ids = as_token_ids(target_ids, "target_ids")
            check_device(target_ids, "target_ids", hidden_states.device, "hidden_states")
            check_targets_shape(target_ids, "target_ids", hidden_states, "hidden_states")
            selected = candidate_mask | (target_ids != IGNORE_INDEX)
        # one read of the device for the selection (its size); gathers and scatters by these
        # row ids read nothing more, forward or backward (boolean indexing would, each time)
        row_ids = selected.flatten().nonzero().squeeze(1)
        batch, length = selected.shape
        # the targets' range is checked here, where an error can name [b, t] (the pass would
        # name a row of the selection); right after the read above, this one waits for little
        checked_here = target_ids is not None and isinstance(weight, Tensor) and weight.dim() == 2
        if checked_here:
            check_target_ids(target_ids, weight.shape[0])

        out = self._head_pass(
            seed,
            candidates,
            row_ids,
            table,
            target_ids=None if target_ids is None else target_ids.flatten()[row_ids],
            check_targets=not checked_here,
        )

        def check_logits() -> None:
            """A ValueError naming the first row whose logits were not all finite."""
            if out.finite is None or all_true(out.finite):  # the pass's one read
                return
            # the culprit, when it is (among the positions the pass used)
            check_finite_tensor(torch.where(selected[..., None], hidden_states, 0), "hidden_states")
            row = int(row_ids[(~out.finite).nonzero()[0]])
            where = list(divmod(row, length))  # the pass's row -> [b, t]
            raise ValueError(
                f"LMHeadInputs: the logits of hidden_states{where} under the head are NaN or Inf "
                "(NaN or Inf in hidden_states or the head's weight or bias, a -inf bias masking "
                f"tokens, which this pass does not take, a float16 overflow of h W^T, or "
                f"softcap={softcap} / temperature={temperature} making them overflow; passed "
                "by the deprecated keywords, they are logit_softcap / generator_temperature)"
            )

        # float64 hidden states give float64 expectations; the scorer runs in its own dtype
        expected = out.expected.to(table.dtype)

        def unselected(rows: Tensor) -> Tensor:  # [N, ...] -> [B, L, ...], 0 where unselected
            full = rows.new_zeros(batch * length, *rows.shape[1:])
            return full.index_copy(0, row_ids, rows).view(batch, length, *rows.shape[1:])

        full = unselected(expected)
        # the chunked and the Triton pass track the argmax (the SDPA path, which does not, is
        # not taken here); 0 at the positions that did not go through the head
        tokens = unselected(out.tokens)
        log_likelihood = None
        if out.log_likelihood is not None:
            log_likelihood = unselected(out.log_likelihood)
        return full[..., :-1], full[..., -1], log_likelihood, tokens, check_logits


def _replaced_rows(
    inputs: Tensor, weights: Tensor, rows: Tensor, row_inputs: Tensor, row_weights: Tensor
) -> tuple[Tensor, Tensor]:
    """``inputs [B, L, d]`` and ``weights [B, L]`` with the flat positions ``rows`` replaced
    by ``row_inputs [N, d]`` and ``row_weights [N]`` (out of place: the gradient reaches
    both)."""
    flat_inputs = inputs.flatten(0, 1).index_copy(0, rows, row_inputs.to(inputs.dtype))
    flat_weights = weights.flatten().index_copy(0, rows, row_weights.to(weights.dtype))
    return flat_inputs.view_as(inputs), flat_weights.view_as(weights)


def _nothing_to_check() -> None:
    """The check of a path that checked its input before it used it."""
