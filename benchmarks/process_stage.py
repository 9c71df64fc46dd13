"""Worker threads against worker processes on a pure-Python (GIL-holding) transform.

Each sample runs a Python loop (no GIL release anywhere), so threads cannot run two samples at
once while processes can. Variants: ``worker_method="thread"`` and ``"process"`` with 1 and 2
workers without hooks (the fetch stage), the same with a ``preprocess`` hook at 2 workers,
torch's own DataLoader with 2 worker processes as a reference, and, as the ceiling, the same
transform mapped by a plain ``multiprocessing`` pool of 2 processes, no loader at all.

Every loader is persistent and warmed up by one epoch first, so the figures are steady-state
throughput (process start-up is printed separately). Every variant runs one epoch per round,
rounds interleaved, and medians are printed, so machine noise hits all variants alike.

Next to samples/s it prints "cores": CPU seconds used by this process and its children during an
epoch, over the epoch's wall time. Threads cannot pass 1.0 on this work; processes can reach the
number of workers, when the machine has that many cores free. On a shared machine the cores show
whether a low figure comes from the loader or from other tenants.
Usage: ``python benchmarks/process_stage.py [--samples N] [--work K] [--rounds R]``.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
from collections.abc import Callable, Iterable

import torch
import torch.utils.data

import torch_spdl
from torch_spdl.bench import memory


def python_loop(index: int, work: int) -> int:
    """GIL-bound work: ``work`` iterations of plain Python arithmetic."""
    acc = index
    for k in range(work):
        acc = (acc * 31 + k) % 1_000_003
    return acc


def python_transform(index: int, work: int) -> torch.Tensor:
    return torch.tensor([index, python_loop(index, work)])


class PythonWork(torch.utils.data.Dataset):
    def __init__(self, samples: int, work: int) -> None:
        self.samples, self.work = samples, work

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, index: int) -> torch.Tensor:
        return python_transform(index, self.work)


class PythonWorkStaged(torch_spdl.StagedDataset):
    """The same work as a ``preprocess`` hook; ``load`` only hands over the index."""

    def __init__(self, samples: int, work: int) -> None:
        self.samples, self.work = samples, work

    def __len__(self) -> int:
        return self.samples

    def load(self, index: int) -> int:
        return index

    def preprocess(self, index: int) -> torch.Tensor:
        return python_transform(index, self.work)


LABEL = {"thread": "threads", "process": "processes"}


def name(method: str, workers: int, hook: bool = False) -> str:
    return f"{LABEL[method]}, {workers} worker{'s' * (workers > 1)}" + (", preprocess" * hook)


def make_loaders(samples: int, work: int) -> dict[str, torch.utils.data.DataLoader]:
    common = dict(batch_size=16, persistent_workers=True)
    plain, staged = PythonWork(samples, work), PythonWorkStaged(samples, work)
    loaders: dict[str, torch.utils.data.DataLoader] = {}
    for method in ("thread", "process"):
        for workers in (1, 2):
            loaders[name(method, workers)] = torch_spdl.DataLoader(
                plain, num_workers=workers, worker_method=method, **common
            )
    for method in ("thread", "process"):
        loaders[name(method, 2, hook=True)] = torch_spdl.DataLoader(
            staged, num_workers=2, worker_method=method, io_workers=2, **common
        )
    loaders["torch DataLoader, 2 processes"] = torch.utils.data.DataLoader(
        plain, num_workers=2, **common
    )
    return loaders


class PoolPass:
    """One pass of the Python work through a process pool, in chunks of a batch, returning plain
    ints: the ceiling, what two processes can do on this machine now."""

    def __init__(self, pool: object, samples: int, work: int) -> None:
        self.pool, self.samples = pool, samples
        self.fn = functools.partial(python_loop, work=work)

    def __iter__(self) -> Iterable[object]:
        return self.pool.imap(self.fn, range(self.samples), chunksize=16)


def cpu_seconds() -> float:
    """CPU time of this process (all threads) and of its live children, from ``/proc``."""
    return time.process_time() + sum(
        memory.cpu_seconds(f"/proc/{pid}/stat") for pid in memory.children()
    )


def epoch(loader: Iterable[object]) -> tuple[float, float]:
    """Seconds for one pass, and cores busy meanwhile."""
    cpu, start = cpu_seconds(), time.perf_counter()
    for _ in loader:
        pass
    wall = time.perf_counter() - start
    return wall, (cpu_seconds() - cpu) / wall


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=400)
    parser.add_argument("--work", type=int, default=20_000, help="loop iterations per sample")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    per_sample = timed(lambda: python_transform(0, args.work))
    print(f"one sample's transform in the main thread: {per_sample * 1e3:.2f} ms")
    loaders: dict[str, Iterable[object]] = dict(make_loaders(args.samples, args.work))
    pool = torch.multiprocessing.Pool(2)
    loaders["ceiling: multiprocessing.Pool(2)"] = PoolPass(pool, args.samples, args.work)
    for label, loader in loaders.items():  # warm-up: workers start and stay (persistent)
        print(f"start-up + first epoch, {label}: {epoch(loader)[0]:.2f} s")

    times: dict[str, list[float]] = {label: [] for label in loaders}
    cores: dict[str, list[float]] = {label: [] for label in loaders}
    for _ in range(args.rounds):
        for label, loader in loaders.items():
            wall, busy = epoch(loader)
            times[label].append(wall)
            cores[label].append(busy)

    load = os.getloadavg()[0]
    print(
        f"\n{args.samples} samples, {args.work} iterations each, median of {args.rounds} rounds "
        f"({os.cpu_count()} CPUs, load average {load:.1f} at the end)"
    )
    rate = {label: args.samples / statistics.median(ts) for label, ts in times.items()}
    for label, value in rate.items():
        busy = statistics.median(cores[label])
        print(f"  {label:<32} {value:>9,.0f} samples/s   {busy:.2f} cores")
    print("\nscaling, 2 workers over 1:")
    for method in ("thread", "process"):
        print(f"  {LABEL[method]}: {rate[name(method, 2)] / rate[name(method, 1)]:.2f}x")
    fetch = rate[name("process", 2)] / rate[name("thread", 2)]
    hook = rate[name("process", 2, hook=True)] / rate[name("thread", 2, hook=True)]
    print(f"processes over threads at 2 workers: {fetch:.2f}x (fetch), {hook:.2f}x (preprocess)")
    ceiling = rate["ceiling: multiprocessing.Pool(2)"]
    print(f"processes, 2 workers, over the ceiling: {rate[name('process', 2)] / ceiling:.2f}x")
    for loader in loaders.values():
        if isinstance(loader, torch_spdl.DataLoader) and loader._iterator is not None:
            loader._iterator.close()
    pool.close()
    pool.join()


if __name__ == "__main__":
    main()
