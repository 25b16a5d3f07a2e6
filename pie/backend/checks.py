"""Checks of a protocol message's fields, shared by the backend's handlers: a field of the
wrong type or shape is a ProtocolError (the whole request is refused); an item whose values
are wrong is an ItemError (that item fails, the rest of its batch runs)."""

from __future__ import annotations

import numpy as np

from pie import protocol as P


class ItemError(ValueError):
    """One item of a batch is invalid; the rest of the batch goes ahead."""


def int_array(values: list, name: str) -> np.ndarray:
    """A list of integers as int64, or ProtocolError (floats and strings are not truncated)."""
    if not isinstance(values, list):
        raise P.ProtocolError(f"{name} must be a list of integers")
    if not values:
        return np.zeros(0, dtype=np.int64)
    try:
        array = np.asarray(values)
    except (ValueError, OverflowError) as e:
        raise P.ProtocolError(f"{name} must be a list of integers ({e})") from None
    if array.ndim != 1 or array.dtype.kind not in "iu":
        raise P.ProtocolError(f"{name} must be a flat list of integers")
    return array.astype(np.int64)


def float_array(values: list, name: str) -> np.ndarray:
    if not isinstance(values, list):
        raise P.ProtocolError(f"{name} must be a list of numbers")
    try:
        array = np.asarray(values, dtype=np.float64) if values else np.zeros(0)
    except (ValueError, TypeError) as e:
        raise P.ProtocolError(f"{name} must be a list of numbers ({e})") from None
    if array.ndim != 1:
        raise P.ProtocolError(f"{name} must be a flat list of numbers")
    return array


def valid_items(n: int, errors: dict[int, str]) -> np.ndarray:
    """Bool mask of the items that have no error."""
    ok = np.ones(n, dtype=bool)
    ok[list(errors)] = False
    return ok


def same_length(kind: str, **arrays: np.ndarray | list) -> int:
    lengths = {name: len(a) for name, a in arrays.items()}
    if len(set(lengths.values())) > 1:
        raise P.ProtocolError(f"{kind}: fields differ in length: {lengths}")
    return next(iter(lengths.values()), 0)


def check_indptr(kind: str, indptr: np.ndarray, flat_len: int, n_items: int, name: str) -> None:
    if len(indptr) != n_items + 1:
        raise P.ProtocolError(f"{kind}.{name} must have {n_items + 1} entries, has {len(indptr)}")
    if indptr[0] != 0 or indptr[-1] != flat_len or np.any(np.diff(indptr) < 0):
        raise P.ProtocolError(
            f"{kind}.{name} must rise from 0 to {flat_len} (the flattened list's length)"
        )
