"""cache_bytes= / preload=: an LRU of loaded raw items, bounded in bytes, shared by all passes."""

from __future__ import annotations

import asyncio
import random
import threading
from collections import Counter

import numpy as np
import pytest
import torch
from versions import THREAD, method

from torch_spdl import DataLoader, StagedDataset
from torch_spdl.cache import ByteLRU, nbytes

pytestmark = pytest.mark.usefixtures("no_leak")


def test_least_recently_used_entry_is_evicted_first():
    cache = ByteLRU(10)
    cache.put("a", b"1234")
    cache.put("b", b"5678")
    assert cache.get("a") == (True, b"1234")  # a is now more recent than b
    cache.put("c", b"9012")
    assert "b" not in cache and "a" in cache and "c" in cache
    stats = cache.stats()
    assert (stats.items, stats.bytes, stats.evictions) == (2, 8, 1)


def test_an_item_larger_than_the_budget_is_not_cached_and_replacing_updates_the_size():
    cache = ByteLRU(10)
    cache.put("big", b"x" * 11)
    assert "big" not in cache and cache.stats().bytes == 0
    cache.put("k", b"x" * 3)
    cache.put("k", b"x" * 7)
    assert cache.stats().bytes == 7 and cache.stats().items == 1


def test_sizes_are_counted_in_bytes():
    assert nbytes(b"abc") == 3
    assert nbytes(torch.zeros(4, 4, dtype=torch.float32)) == 64
    assert nbytes((b"ab", b"cd")) > 4  # the tuple itself counts too


def test_concurrent_use_keeps_the_accounting_exact():
    cache = ByteLRU(5_000)
    gets = Counter()

    def hammer(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(3_000):
            key = rng.randrange(60)
            if rng.random() < 0.5:
                cache.get(key)
                gets[seed] += 1
            else:
                cache.put(key, b"x" * rng.randrange(1, 300))

    threads = [threading.Thread(target=hammer, args=(seed,)) for seed in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    stats = cache.stats()
    entries = list(cache._entries.values())
    assert stats.bytes == sum(size for _, size in entries) == sum(len(v) for v, _ in entries)
    assert stats.bytes <= 5_000 and stats.items == len(entries)
    assert stats.hits + stats.misses == sum(gets.values())


class Counted(StagedDataset):
    """Records how often each index is loaded."""

    def __init__(self, n: int = 24, is_async: bool = False) -> None:
        self.n, self.loads, self.lock = n, Counter(), threading.Lock()
        if is_async:
            self.load = self._load_async

    def __len__(self) -> int:
        return self.n

    def load(self, index: int) -> bytes:
        with self.lock:
            self.loads[index] += 1
        return bytes([index]) * 100

    async def _load_async(self, index: int) -> bytes:
        await asyncio.sleep(0)
        return Counted.load(self, index)

    def preprocess(self, raw: bytes) -> torch.Tensor:
        return torch.tensor(raw[0])


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("is_async", [False, True])
def test_second_pass_is_served_from_the_cache(num_workers, is_async):
    dataset = Counted(is_async=is_async)
    loader = DataLoader(
        dataset, batch_size=5, shuffle=True, num_workers=num_workers, cache_bytes=10_000
    )
    first = sorted(torch.cat(list(loader)).tolist())
    assert dataset.loads == Counter(range(24))
    second = sorted(torch.cat(list(loader)).tolist())
    assert first == second == list(range(24))
    assert dataset.loads == Counter(range(24))  # nothing loaded twice
    stats = loader.cache_stats()
    assert (stats.hits, stats.misses, stats.hit_rate) == (24, 24, 0.5)


def test_a_small_budget_evicts_and_loads_again():
    dataset = Counted()
    loader = DataLoader(dataset, batch_size=4, num_workers=2, cache_bytes=1_000)
    for _ in range(2):
        assert sorted(torch.cat(list(loader)).tolist()) == list(range(24))
    stats = loader.cache_stats()
    assert stats.evictions > 0 and stats.bytes <= 1_000
    assert sum(dataset.loads.values()) > 24


def test_preload_loads_everything_once_before_the_first_batch():
    dataset = Counted()
    loader = DataLoader(dataset, batch_size=6, num_workers=2, preload=True, io_workers=4)
    it = iter(loader)
    assert dataset.loads == Counter(range(24))
    want = [b.tolist() for b in torch.utils.data.DataLoader(Counted(), batch_size=6)]
    assert [b.tolist() for b in it] == want
    assert [b.tolist() for b in loader] == want
    assert dataset.loads == Counter(range(24))
    del it


def test_preload_threads_know_their_worker_and_fakedata_stays_thread_safe():
    import torchvision

    fake = torchvision.datasets.FakeData(size=48, image_size=(3, 8, 8))
    infos = []

    def to_tensor(sample):
        return torch.from_numpy(np.asarray(sample[0])).sum(), sample[1]

    loader = DataLoader(fake, batch_size=8, num_workers=2, preload=True, preprocess_fn=to_tensor)
    want = [to_tensor(fake[i]) for i in range(48)]
    got = [pair for pixels, labels in loader for pair in zip(pixels, labels, strict=True)]
    assert [(int(p), int(t)) for p, t in got] == [(int(p), t) for p, t in want]

    class Info(Counted):
        def load(self, index):
            info = torch.utils.data.get_worker_info()
            infos.append((method(info), info.num_workers))
            return super().load(index)

    list(DataLoader(Info(), preload=True, io_workers=3))
    assert set(infos) == {(THREAD, 3)}


def test_cache_options_set_after_construction_take_effect():
    dataset = Counted()
    loader = DataLoader(dataset, batch_size=6)
    loader.preload = True
    list(loader)
    list(loader)
    assert dataset.loads == Counter(range(24)) and loader.cache_stats().hits == 48


@pytest.mark.parametrize("option", ["cache_bytes", "preload"])
def test_a_cache_assigned_to_a_persistent_loader_is_read(option):
    """The persistent workers' load stage was made without a cache: they start anew with it."""
    dataset = Counted()
    loader = DataLoader(dataset, batch_size=6, num_workers=2, persistent_workers=True)
    list(loader)
    setattr(loader, option, 10_000 if option == "cache_bytes" else True)
    for _ in range(2):
        assert sum(len(batch) for batch in loader) == 24
    loads = 24 + 24  # the pass before the cache; its first pass (or preload) fills it
    assert sum(dataset.loads.values()) == loads and loader.cache_stats().hits >= 24


def test_preload_error_keeps_its_type_and_names_the_index():
    class Broken(Counted):
        def load(self, index):
            if index == 5:
                raise FileNotFoundError("gone")
            return super().load(index)

    loader = DataLoader(Broken(), batch_size=4, preload=True)
    with pytest.raises(FileNotFoundError, match="in stage 'preload' for dataset index 5"):
        iter(loader)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_preload_leaves_a_failing_load_to_the_failure_budget(num_workers):
    """With ``max_failures`` a load that raises in the preload is not cached: every pass loads
    it again, and the budget skips it as without preload, rather than every ``iter()`` raise."""

    class Broken(Counted):
        def load(self, index):
            if index == 5:
                raise FileNotFoundError("gone")
            return super().load(index)

    def passes(**extra):
        loader = DataLoader(
            Broken(), batch_size=4, num_workers=num_workers, max_failures=3, **extra
        )
        return [
            ([batch.tolist() for batch in loader], [f.index for f in loader.stats().skipped])
            for _ in range(2)
        ]

    want = passes(cache_bytes=10_000)
    assert want[0][1] == [5] and want[0] == want[1]
    assert passes(preload=True) == want


@pytest.mark.parametrize("kwargs", [{"cache_bytes": 1000}, {"preload": True}])
def test_caching_needs_a_load_hook(kwargs):
    with pytest.raises(ValueError, match="load hook"):
        DataLoader(torch.utils.data.TensorDataset(torch.zeros(3)), **kwargs)


@pytest.mark.parametrize("size", [0, -5, True, 0.5, float("nan"), float("inf")])
def test_cache_bytes_must_be_positive(size):
    with pytest.raises(ValueError, match="cache_bytes should be a positive number of bytes"):
        DataLoader(Counted(), cache_bytes=size)


def test_cache_bytes_is_a_number_of_bytes():
    """A float reads as the bytes it says (2e9 is 2 GB); a string is no number."""
    loader = DataLoader(Counted(), cache_bytes=2e3)
    assert loader.cache_stats().capacity == 2000
    with pytest.raises(TypeError, match="cache_bytes should be a number of bytes, got '10'"):
        DataLoader(Counted(), cache_bytes="10")


def test_cache_options_are_public_attributes_with_defaults():
    loader = DataLoader(Counted())
    assert loader.cache_bytes is None and loader.preload is False and loader.cache_stats() is None
