"""Similarity heatmap of one candidate/reference pair, with each token's match marked
(like bert_score's ``plot_example``). Needs matplotlib (``pip install bsloss[plot]``)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from bsloss.functional.matching import SMALLEST_TEMPERATURE, check_temperature
from bsloss.functional.similarity import cosine_similarity
from bsloss.inputs import check_text

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from bsloss.metric import BERTScorer

__all__ = ["pair_similarity", "pair_scores", "draw_pair", "check_image_path"]


@torch.inference_mode()
def pair_similarity(
    scorer: BERTScorer, candidate: str, reference: str
) -> tuple[Tensor, list[str], list[str]]:
    """Cosine similarities ``[Lc, Lr]`` of one pair (special tokens dropped), and the tokens.
    With ``all_layers``, those of the scorer's layer ``num_layers``.

    Raises:
        TypeError, ValueError: a text that is not a string, or has no token to draw.
    """
    for text, name in ((candidate, "candidate"), (reference, "reference")):
        check_text(text, name)
    embedded = scorer.embed([candidate, reference])
    (cand, cand_ids), (ref, ref_ids) = embedded[candidate], embedded[reference]
    cand, ref = _drawn_layer(scorer, cand), _drawn_layer(scorer, ref)
    # on the ids' device: a CUDA scorer's ids cannot be compared with a CPU tensor
    special = torch.tensor(scorer.encoder.tokenization.special_token_ids, device=cand_ids.device)
    keep_c = ~torch.isin(cand_ids, special)
    keep_r = ~torch.isin(ref_ids, special)
    sim = cosine_similarity(cand[keep_c][None], ref[keep_r][None], normalized=True)[0]
    for kept, name in ((keep_c, "candidate"), (keep_r, "reference")):
        if not kept.any():
            raise ValueError(
                f"{name} has no token to draw: the text is empty, whitespace only, or only the "
                "scorer's special tokens (such as the literal text '[CLS]')"
            )
    tokens = scorer.encoder.tokenizer.convert_ids_to_tokens
    return sim.cpu(), tokens(cand_ids[keep_c].tolist()), tokens(ref_ids[keep_r].tolist())


@torch.inference_mode()
def pair_scores(
    scorer: BERTScorer, candidate: str, reference: str, temperature: float | None = None
) -> tuple[float, float, float]:
    """P, R, F of one pair: the scorer's (hard matching) or, with ``temperature``, the softmax
    matching's at that temperature, with the scorer's weights and baseline alike, so a heatmap's
    title gives the scores of the matching it shades. With ``all_layers``, those of layer
    ``num_layers`` (the layer :func:`pair_similarity` gives)."""
    if temperature is None:
        prf = scorer.score([candidate], [reference])
        if scorer.all_layers:  # [layers, 1] each: the drawn layer's row
            prf = tuple(x[scorer.num_layers] for x in prf)
        return tuple(x.item() for x in prf)
    from bsloss.functional import bert_score, rescale_with_baseline
    from bsloss.scorer.batching import pad_embedded

    embedded = {
        text: (_drawn_layer(scorer, emb), ids)
        for text, (emb, ids) in scorer.embed([candidate, reference]).items()
    }
    table = scorer._current_weight_table()  # idf=True: from the references, as in score()
    if table is None:
        table = scorer._idf_from_references([reference])
    table = table.to(embedded[candidate][0].device, torch.float32)
    cand, cand_mask, cand_weights = pad_embedded([embedded[candidate]], table)
    ref, ref_mask, ref_weights = pad_embedded([embedded[reference]], table)
    prf = bert_score(
        cand, ref, cand_mask, ref_mask, cand_weights, ref_weights,
        matching="softmax", temperature=temperature, normalized=True,
    )  # fmt: skip
    scores = torch.stack(prf, dim=-1).float().cpu()
    if scorer.baseline is not None:
        baseline = scorer.baseline[scorer.num_layers] if scorer.all_layers else scorer.baseline
        scores = rescale_with_baseline(scores, baseline.float())
    return tuple(scores[0].tolist())


def _drawn_layer(scorer: BERTScorer, embeddings: Tensor) -> Tensor:
    """``[L, d]`` embeddings of the layer a plot shows: with ``all_layers`` the scorer embeds
    every layer side by side (``[L, layers * d]``, each unit-norm on its own), and their dot
    products would add the layers' cosines (up to ``layers``). The plot shows layer
    ``num_layers``: the layer the scorer names (in its hash), and the one it scores without
    ``all_layers``."""
    if not scorer.all_layers:
        return embeddings
    return embeddings.unflatten(-1, (scorer._layer_count(), -1))[:, scorer.num_layers]


def _matplotlib():
    """matplotlib (with its ``figure`` module), or an ImportError that says what to install."""
    try:
        import matplotlib
        import matplotlib.figure  # noqa: F401
    except ImportError as error:
        raise ImportError(
            'plotting needs matplotlib, which is not installed: pip install "bsloss[plot]" '
            "(or pip install matplotlib)"
        ) from error
    return matplotlib


def check_image_path(fname: str | Path) -> Path:
    """``fname`` as the path matplotlib writes: its extension a format it knows (none: the
    default format's added, ``.png``, as ``savefig`` adds it), not a directory, in an existing
    folder.

    Raises:
        ValueError: an unknown extension, a directory, or a missing folder.
    """
    Figure = _matplotlib().figure.Figure
    path = Path(fname)
    if path.is_dir():
        raise ValueError(f"output {path} is a directory; give an image file name")
    formats = Figure().canvas.get_supported_filetypes()
    extension = path.suffix.lower().lstrip(".")
    if extension and extension not in formats:
        raise ValueError(
            f"output {path}: matplotlib cannot write .{extension} images; use one of "
            f"{', '.join('.' + f for f in sorted(formats))}"
        )
    if not path.parent.is_dir():
        raise ValueError(f"output {path}: the folder {path.parent} does not exist")
    if not extension:
        path = path.with_name(f"{path.name}.{_matplotlib().rcParams['savefig.format']}")
    return path


def draw_pair(
    scorer: BERTScorer,
    candidate: str,
    reference: str,
    fname: str | Path | None = None,
    temperature: float | None = None,
    ax: Axes | None = None,
) -> Figure:
    """Heatmap of the token similarities of one pair under ``scorer``; a dot marks each
    candidate token's best reference token (precision), a ring each reference token's best
    candidate token (recall). With ``temperature``, the cell shading is the row softmax
    ``softmax_j(s_ij / T)`` instead (the soft matching plan), and the title's P, R, F are the
    softmax matching's at ``T`` (:func:`pair_scores`). Special tokens are not drawn, so a
    mark is the best match among the words shown.

    Args:
        scorer: the :class:`~bsloss.BERTScorer`.
        candidate, reference: the pair of texts.
        fname: image file to save to (``.png``, ``.pdf``); ``None`` or ``""``: not saved.
            Without ``ax``, a figure that is saved is drawn outside pyplot
            (``matplotlib.figure.Figure``), so that saving changes no global state: the
            backend stays as it is and pyplot keeps no open figure; without ``fname`` it is a
            pyplot figure, shown under the current backend.
        temperature: shade the soft matching plan ``softmax(s / T)`` instead of ``s``.
        ax: a matplotlib axes to draw into.

    With ``all_layers``, the heatmap and the title are those of the scorer's layer
    ``num_layers``.

    Returns:
        The matplotlib figure.

    Raises:
        ImportError: matplotlib is not installed.
        TypeError, ValueError: a text that is not a string or has no token, a ``temperature``
            that is not a finite number > 0, or an image format matplotlib cannot write.

    >>> import bsloss
    >>> figure = draw_pair(bsloss.BERTScorer(), "the cat sat", "a cat was sitting")
    >>> len(figure.axes) >= 1
    True
    """
    if temperature is not None:
        temperature = check_temperature(temperature, smallest=SMALLEST_TEMPERATURE)
    matplotlib = _matplotlib()
    fname = fname or None
    if fname is not None:
        check_image_path(fname)
    sim, cand_tokens, ref_tokens = pair_similarity(scorer, candidate, reference)
    shown: Tensor = sim if temperature is None else torch.softmax(sim / temperature, dim=1)
    if ax is None:
        width = max(4.0, 0.45 * len(ref_tokens) + 2)
        height = max(3.0, 0.45 * len(cand_tokens) + 1.5)
        if fname is not None:
            # only a file is wanted: a figure outside pyplot, which leaves the process's
            # backend alone (a notebook's inline one, a script's Tk or Qt) and is not kept
            # open by pyplot (a loop of plots would pile them up)
            fig = matplotlib.figure.Figure(figsize=(width, height))
            ax = fig.subplots()
        else:
            import matplotlib.pyplot as plt

            fig, ax = plt.subplots(figsize=(width, height))
    else:
        fig = ax.figure
    image = ax.imshow(shown.numpy(), cmap="Blues", vmin=0 if temperature else None)
    rows = torch.arange(len(cand_tokens))
    ax.scatter(sim.argmax(dim=1).numpy(), rows.numpy(), s=18, c="crimson", label="P match")
    ax.scatter(
        torch.arange(len(ref_tokens)).numpy(),
        sim.argmax(dim=0).numpy(),
        s=90,
        facecolors="none",
        edgecolors="orange",
        label="R match",
    )
    ax.set_xticks(range(len(ref_tokens)), ref_tokens, rotation=60, ha="right")
    ax.set_yticks(range(len(cand_tokens)), cand_tokens)
    ax.set_xlabel("reference")
    ax.set_ylabel("candidate")
    p, r, f = pair_scores(scorer, candidate, reference, temperature)
    kind = "cosine similarity" if temperature is None else f"softmax plan, T={temperature}, soft"
    ax.set_title(f"{kind}   P={p:.3f} R={r:.3f} F={f:.3f}", fontsize=9)
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
    ax.legend(loc="upper right", fontsize=7, framealpha=0.8)
    fig.tight_layout()
    if fname is not None:
        fig.savefig(fname, dpi=120)
    return fig
