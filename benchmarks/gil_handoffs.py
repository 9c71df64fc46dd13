"""How long per-image work takes beside a Python thread that never lets the GIL go.

Each torch call lets the GIL go, and so does freeing a tensor (torch releases it around the
destructor). Beside a thread that holds the GIL, a release that lasts long enough to be taken
over costs the caller up to a switch interval to take it back. This times, in this process, each
piece of per-image work that docs/performance.md ("Tensors made and freed are hand-offs too")
reports, next to the way it was done before, beside such a thread:

- ``RandomResizedCrop(224)`` on workload A's images (ms per image);
- ``collate_images`` of 64 channels-last 224 px images against a ``copy_`` per image;
- 256 JPEG magic checks through NumPy against a torch slice each;
- an ``EncodedBatch``'s 256 views rebuilt (made and freed) by slices against ``split``.

Run: ``python benchmarks/gil_handoffs.py [--rounds N] [--interval S]``. The rows alternate
round by round; medians are printed.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torchvision import datasets

from torch_spdl.bench.data import synthetic_imagefolder
from torch_spdl.io import RandomResizedCrop, collate_images
from torch_spdl.io.device_decode import _unpacked
from torch_spdl.io.image import _JPEG_MAGIC, _starts_with

BATCH = 64
PARTS = 256


@contextmanager
def busy_thread(interval: float) -> Iterator[list[int]]:
    """A thread that runs Python without a break (a training loop at its worst), with the
    switch interval set to ``interval`` for the duration. It yields the thread's count of its
    turns round the loop: it counts only while it holds the GIL."""
    stop = threading.Event()
    old = sys.getswitchinterval()
    spins = [0]

    def spin() -> None:
        while not stop.is_set():
            spins[0] += 1

    sys.setswitchinterval(interval)
    thread = threading.Thread(target=spin, name="busy")
    thread.start()
    try:
        yield spins
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(old)


def image_rows(count: int) -> dict[str, Callable[[], object]]:
    """The transform on ``count`` of workload A's images, the crop decoded alone and whole."""
    folder = datasets.ImageFolder(str(synthetic_imagefolder()))
    data = [bytearray(Path(path).read_bytes()) for path, _ in folder.samples[:count]]
    rows = {}
    for name, transform in (
        ("RandomResizedCrop, region", RandomResizedCrop(224)),
        ("RandomResizedCrop, whole", RandomResizedCrop(224, region=False)),
    ):
        rows[name] = lambda t=transform: [t(d) for d in data]
    return rows


def batch_rows() -> dict[str, Callable[[], object]]:
    """Per-batch work as it is done now, and as it was."""
    images = [
        torch.randint(0, 256, (1, 224, 224, 3), dtype=torch.uint8).permute(0, 3, 1, 2)[0]
        for _ in range(BATCH)
    ]

    def batch() -> torch.Tensor:
        shape = (BATCH, 3, 224, 224)
        return torch.empty(shape, dtype=torch.uint8, memory_format=torch.channels_last)

    def copy_each() -> torch.Tensor:
        out = batch()
        for slot, image in zip(out, images, strict=True):
            slot.copy_(image)
        return out

    lengths = [40_000 + i for i in range(PARTS)]
    packed = torch.randint(0, 256, (sum(lengths),), dtype=torch.uint8)
    ends = itertools.accumulate(lengths)
    views = [packed[end - n : end] for end, n in zip(ends, lengths, strict=True)]
    draws = [((0, 0, 8, 8), False, True)] * PARTS
    cpu = torch.device("cpu")
    return {
        "collate_images (one torch.stack)": lambda: collate_images(images, batch()),
        "a copy_ per image": copy_each,
        f"{PARTS} magic checks, NumPy": lambda: [_starts_with(v, _JPEG_MAGIC) for v in views],
        f"{PARTS} magic checks, torch slices": lambda: [
            v[:3].numpy().tobytes() == _JPEG_MAGIC for v in views
        ],
        f"{PARTS} views by slices (EncodedBatch)": lambda: _unpacked(
            packed, lengths, draws, (8, 8), "RGB", cpu
        ),
        f"{PARTS} views by split": lambda: packed.split(lengths),
    }


def timed(fn: Callable[[], object]) -> float:
    """Seconds for one call, the result freed inside the timing (frees are hand-offs too)."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--interval", type=float, default=0.005, help="switch interval, s")
    parser.add_argument("--images", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = {**image_rows(args.images), **batch_rows()}
    alone = {name: min(timed(fn) for _ in range(3)) for name, fn in rows.items()}
    beside: dict[str, list[float]] = {name: [] for name in rows}
    with busy_thread(args.interval):
        for _ in range(args.rounds):
            for name, fn in rows.items():
                beside[name].append(timed(fn))
    print(f"switch interval {args.interval * 1e3:g} ms, {args.rounds} rounds, medians (ms)")
    print(f"{'':42s} {'alone':>9s} {'beside':>9s}")
    for name in rows:
        per = args.images if name.startswith("RandomResizedCrop") else 1
        unit = " per image" if per > 1 else ""
        median = statistics.median(beside[name]) / per
        print(f"{name + unit:42s} {alone[name] / per * 1e3:9.2f} {median * 1e3:9.1f}")


if __name__ == "__main__":
    main()
