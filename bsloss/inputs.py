"""Validation of user text input: clear errors that name the argument and the position."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["validate_pairs", "flatten_groups"]


def _check_texts(texts: object, name: str) -> list:
    if isinstance(texts, str) or not isinstance(texts, Sequence):
        raise TypeError(f"{name} must be a list of strings, got {type(texts).__name__}")
    return list(texts)


def validate_pairs(cands: object, refs: object) -> tuple[list[str], list[list[str]]]:
    """``cands`` (list of str) and ``refs`` (list of str, or list of lists of str) -> candidates
    and reference groups (one group per candidate)."""
    cands = _check_texts(cands, "cands")
    refs = _check_texts(refs, "refs")
    if len(cands) != len(refs):
        raise ValueError(
            f"cands and refs must have the same length: got {len(cands)} candidates and "
            f"{len(refs)} references (groups)"
        )
    for i, cand in enumerate(cands):
        if not isinstance(cand, str):
            raise TypeError(f"cands[{i}] must be a string, got {type(cand).__name__}")
    groups: list[list[str]] = []
    for i, ref in enumerate(refs):
        if isinstance(ref, str):
            groups.append([ref])
            continue
        if not isinstance(ref, Sequence):
            raise TypeError(
                f"refs[{i}] must be a string or a list of strings, got {type(ref).__name__}"
            )
        if len(ref) == 0:
            raise ValueError(f"refs[{i}] is an empty list: candidate {i} has no reference")
        for k, item in enumerate(ref):
            if not isinstance(item, str):
                raise TypeError(f"refs[{i}][{k}] must be a string, got {type(item).__name__}")
        groups.append(list(ref))
    return cands, groups


def flatten_groups(cands: list[str], groups: list[list[str]]):
    """One (candidate, reference) pair per reference, and each pair's group index."""
    pair_cands, pair_refs, owner = [], [], []
    for i, (cand, group) in enumerate(zip(cands, groups, strict=True)):
        for ref in group:
            pair_cands.append(cand)
            pair_refs.append(ref)
            owner.append(i)
    return pair_cands, pair_refs, owner
