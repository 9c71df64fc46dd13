"""A thread-safe LRU cache of loaded raw items, bounded in bytes.

It sits on the ``load`` hook: what is cached is what storage returned (file bytes, a decoded
array), never a preprocessed sample, so random augmentations still differ every epoch. Many I/O
threads read and fill it at once, so every operation holds one lock; the lock is never held while
loading, and two threads that miss the same index at once both load it (the second ``put`` just
refreshes the entry) rather than one waiting on the other.
"""

from __future__ import annotations

import math
import numbers
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


def nbytes(value: Any) -> int:
    """Memory held by ``value``, for the cache's budget: exact for bytes, tensors and arrays."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return len(value)
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, np.ndarray):
        return value.nbytes
    if isinstance(value, (tuple, list)):
        return sys.getsizeof(value) + sum(nbytes(item) for item in value)
    if isinstance(value, dict):
        return sys.getsizeof(value) + sum(nbytes(k) + nbytes(v) for k, v in value.items())
    return sys.getsizeof(value)


@dataclass(frozen=True)
class CacheStats:
    hits: int
    misses: int
    evictions: int
    items: int
    bytes: int
    capacity: int | None

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


def check_capacity(capacity: Any) -> int | None:
    """torch-style validation of ``cache_bytes``: None (unbounded), or a number of bytes of at
    least 1 (``2e9`` reads as 2 GB), as a whole number of bytes."""
    if capacity is None:
        return None
    if not isinstance(capacity, numbers.Real):
        raise TypeError(f"cache_bytes should be a number of bytes, got {capacity!r}")
    value = float(capacity)
    if isinstance(capacity, bool) or not (math.isfinite(value) and value >= 1):
        raise ValueError(f"cache_bytes should be a positive number of bytes, got {capacity!r}")
    return capacity if isinstance(capacity, int) else int(value)


class ByteLRU:
    """Least-recently-used entries are evicted until the total fits ``capacity`` bytes
    (``None``: unbounded). An item larger than the whole capacity is not cached at all."""

    def __init__(self, capacity: int | None) -> None:
        self.capacity = check_capacity(capacity)
        self._entries: OrderedDict[Hashable, tuple[Any, int]] = OrderedDict()
        self._bytes = 0
        self._hits = self._misses = self._evictions = 0
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> tuple[bool, Any]:
        """``(True, value)`` on a hit (now the most recently used), else ``(False, None)``."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self._misses += 1
                return False, None
            self._entries.move_to_end(key)
            self._hits += 1
            return True, entry[0]

    def put(self, key: Hashable, value: Any) -> None:
        size = nbytes(value)
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old[1]
            if self.capacity is not None and size > self.capacity:
                return
            self._entries[key] = (value, size)
            self._bytes += size
            while self.capacity is not None and self._bytes > self.capacity:
                _, (_, evicted) = self._entries.popitem(last=False)
                self._bytes -= evicted
                self._evictions += 1

    def __contains__(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._entries

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(
                self._hits,
                self._misses,
                self._evictions,
                len(self._entries),
                self._bytes,
                self.capacity,
            )


def cached(load: Callable[[Any], Any], cache: ByteLRU, is_async: bool) -> Callable[[Any], Any]:
    """``load`` reading through ``cache``; the same kind of callable (sync or async) as ``load``."""
    if is_async:

        async def load_async(index: Any) -> Any:
            hit, value = cache.get(index)
            if not hit:
                value = await load(index)
                cache.put(index, value)
            return value

        return load_async

    def load_sync(index: Any) -> Any:
        hit, value = cache.get(index)
        if not hit:
            value = load(index)
            cache.put(index, value)
        return value

    return load_sync
