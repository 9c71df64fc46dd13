"""Iterating a loader past its errors, as torch's DataLoader allows, for comparing two loaders."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


def drain(iterator: Iterator[Any]) -> list[Any]:
    """Every batch as a list, and ``"error"`` for each ValueError, until the iterator ends."""
    out: list[Any] = []
    while True:
        try:
            out.append(next(iterator).tolist())
        except StopIteration:
            return out
        except ValueError:
            out.append("error")
