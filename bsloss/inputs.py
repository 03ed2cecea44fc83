"""Validation of user input at the public boundary: clear errors that name the argument and the
position, so that the code inside can trust what it is given.

Texts (a list, not a string; each a string of valid Unicode), reference groups, numbers
(integers, finite floats), flags (bools) and tensors (their dtype kind) are checked here once, by
every public entry point.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import numpy as np
import torch

__all__ = [
    "position_of_first",
    "check_text",
    "check_texts",
    "check_reference_groups",
    "check_int",
    "check_flag",
    "check_tensor",
    "as_token_ids",
    "check_targets_shape",
    "validate_pairs",
    "flatten_groups",
]


def position_of_first(bad) -> str:
    """``"[i, j]"``: the index of the first true element of the boolean tensor ``bad`` (which has
    one), as every error that names where a bad input sits writes it (``name[i, j]``).

    >>> import torch
    >>> position_of_first(torch.tensor([[False, False], [False, True]]))
    '[1, 1]'
    """
    return "[" + ", ".join(str(i) for i in bad.nonzero()[0].tolist()) + "]"


def check_text(text: object, name: str) -> str:
    """``text`` itself if it is a string the tokenizers can read.

    Raises:
        TypeError: not a string.
        ValueError: a lone surrogate (``"\\ud800"``, e.g. from a bad decode with
            ``errors="surrogatepass"``), which no tokenizer can encode.
    """
    if not isinstance(text, str):
        raise TypeError(f"{name} must be a string, got {type(text).__name__}")
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as error:
            raise ValueError(
                f"{name} is not valid Unicode: a lone surrogate {text[error.start]!r} at "
                f"character {error.start}"
            ) from None
    return text


# a string, or bytes (whose items are ints): a Sequence, but not a list of texts
_NOT_A_LIST = (str, bytes, bytearray)


def _got(value: object) -> str:
    """What a list of texts was given instead, and how to pass an array's texts."""
    # a numpy array or a pandas Series (a data frame's column) is not a Sequence, and bert_score
    # adds two of them element by element: their list is what to pass (audit h25)
    array = hasattr(value, "tolist") and hasattr(value, "dtype")
    convert = "; pass its .tolist()" if array and not isinstance(value, torch.Tensor) else ""
    return f"got {type(value).__name__}{convert}"


def check_texts(texts: object, name: str) -> list[str]:
    """A list of strings (a single string is refused: it would be read character by
    character)."""
    if isinstance(texts, _NOT_A_LIST) or not isinstance(texts, Sequence):
        raise TypeError(f"{name} must be a list of strings, {_got(texts)}")
    return [check_text(text, f"{name}[{i}]") for i, text in enumerate(texts)]


def check_reference_groups(refs: object, name: str) -> list[list[str]]:
    """One reference group per item: a string, or a non-empty list of strings."""
    if isinstance(refs, _NOT_A_LIST) or not isinstance(refs, Sequence):
        raise TypeError(f"{name} must be a list of strings (or of lists of strings), {_got(refs)}")
    groups: list[list[str]] = []
    for i, ref in enumerate(refs):
        if isinstance(ref, str):
            groups.append([check_text(ref, f"{name}[{i}]")])
            continue
        if isinstance(ref, (bytes, bytearray)) or not isinstance(ref, Sequence):
            raise TypeError(
                f"{name}[{i}] must be a string or a list of strings, got {type(ref).__name__}"
            )
        if len(ref) == 0:
            raise ValueError(f"{name}[{i}] is an empty list: candidate {i} has no reference")
        groups.append([check_text(item, f"{name}[{i}][{k}]") for k, item in enumerate(ref)])
    return groups


def check_int(value: object, name: str, minimum: int) -> int:
    """An integer (not a bool, not a float) ``>= minimum``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def check_flag(value: object, name: str) -> bool:
    """``value`` as a bool: a bool, a numpy bool, or the integer 0 or 1 (what bert_score's
    ``if flag:`` takes as a bool); anything else is refused. A plain truth test would read the
    string ``"false"`` as true.

    Raises:
        TypeError: any other value, a string included (``name`` named).

    >>> check_flag(np.True_, "center"), check_flag(0, "center")
    (True, False)
    >>> check_flag("false", "center")
    Traceback (most recent call last):
    TypeError: center must be a bool (or 0, 1), got 'false'
    """
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, numbers.Integral) and value in (0, 1):
        return bool(value)
    raise TypeError(f"{name} must be a bool (or 0, 1), got {value!r}")


def check_tensor(value: object, name: str, kind: str) -> torch.Tensor:
    """``value`` itself if it is a tensor of ``kind`` ``"float"`` or ``"integer"`` dtype
    (``"mask"``: bool or integer).

    Raises:
        TypeError: not a tensor, or another dtype (both named).

    >>> check_tensor(torch.ones(2), "x", "integer")
    Traceback (most recent call last):
    TypeError: x must have an integer dtype, got torch.float32
    """
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    floating, complex_ = value.is_floating_point(), value.is_complex()
    ok = {
        "float": floating,
        "integer": not floating and not complex_ and value.dtype != torch.bool,
        "mask": not floating and not complex_,
    }[kind]
    if not ok:
        wanted = {"float": "a floating", "integer": "an integer", "mask": "a bool or integer"}
        raise TypeError(f"{name} must have {wanted[kind]} dtype, got {value.dtype}")
    return value


def as_token_ids(value: object, name: str) -> torch.Tensor:
    """``value``, a tensor of token ids of any integer dtype, as ``torch.long``.

    The narrow dtypes must not be used as they are: ``uint8`` compares wrongly against a
    vocabulary size it cannot hold (30,522 wraps to 58) and indexes as a mask, ``int8`` and
    ``int16`` do not index at all.

    Raises:
        TypeError: not a tensor, or not of an integer dtype (both named).

    >>> as_token_ids(torch.tensor([101, 102], dtype=torch.uint8), "ids").dtype
    torch.int64
    """
    ids = check_tensor(value, name, "integer")
    return ids if ids.dtype == torch.long else ids.long()


def check_device(value: torch.Tensor, name: str, device: torch.device, owner: str) -> None:
    """Refuse a tensor on another device than ``device`` (that of ``owner``), naming both.

    Raises:
        ValueError: ``value`` is on another device (``cuda:1`` is not ``cuda:0``).

    The message also says how to move the owner instead.

    >>> check_device(torch.ones(2), "logits", torch.device("meta"), "the scorer")
    Traceback (most recent call last):
    ValueError: logits is on cpu but the scorer is on meta; move logits with .to('meta'), ...
    """
    if value.device != device:
        raise ValueError(
            f"{name} is on {value.device} but {owner} is on {device}; move {name} with "
            f".to('{device}'), or the loss with .to('{value.device}')"
        )


def check_targets_shape(
    targets: torch.Tensor, targets_name: str, inputs: torch.Tensor, inputs_name: str
) -> None:
    """``targets`` holds one id per position of ``inputs`` (hidden states ``[..., d]`` or logits
    ``[..., V]``): its shape is theirs without the last dimension.

    Raises:
        ValueError: another shape, naming both arguments and both shapes (``labels must have
            shape [2, 5] (hidden_states [2, 5, 8] without its last dimension), got [2, 4]``).
    """
    expected = list(inputs.shape[:-1])
    if list(targets.shape) != expected:
        raise ValueError(
            f"{targets_name} must have shape {expected} ({inputs_name} {list(inputs.shape)} "
            f"without its last dimension), got {list(targets.shape)}"
        )


def validate_pairs(cands: object, refs: object) -> tuple[list[str], list[list[str]]]:
    """``cands`` (list of str) and ``refs`` (list of str, or list of lists of str) -> candidates
    and reference groups (one group per candidate)."""
    if isinstance(cands, str) or not isinstance(cands, Sequence):
        raise TypeError(f"cands must be a list of strings, {_got(cands)}")
    if isinstance(refs, _NOT_A_LIST) or not isinstance(refs, Sequence):
        raise TypeError(f"refs must be a list of strings, {_got(refs)}")
    if len(cands) != len(refs):
        raise ValueError(
            f"cands and refs must have the same length: got {len(cands)} candidates and "
            f"{len(refs)} references (groups)"
        )
    return check_texts(cands, "cands"), check_reference_groups(refs, "refs")


def flatten_groups(
    cands: list[str], groups: list[list[str]]
) -> tuple[list[str], list[str], list[int]]:
    """One (candidate, reference) pair per reference, and each pair's group index."""
    pair_cands, pair_refs, owner = [], [], []
    for i, (cand, group) in enumerate(zip(cands, groups, strict=True)):
        for ref in group:
            pair_cands.append(cand)
            pair_refs.append(ref)
            owner.append(i)
    return pair_cands, pair_refs, owner
