"""What ``default_collate`` costs in a worker thread: a batch in shared memory or in its own.

torch's ``collate_tensor_fn`` stacks into a new shared-memory segment wherever
``get_worker_info()`` answers, as it does in torch_spdl's worker threads. torch_spdl hides a
worker thread's own info for that stack (``torch_spdl.workers.collate_in_process_memory``).
This times both on worker threads, in interleaved rounds:

- ``own memory``: the loader as shipped;
- ``shared memory``: torch's own entry put back in ``default_collate_fn_map``, as before.

The dataset returns decoded images (uint8 ``3×224×224``, a clone each, which is all of a
sample's work), batches of 64; each batch is fed to workload D's training step, calibrated to
``--step-ms`` of tiny torch ops that need the GIL. Reported: images/s, the CPU time of the
whole process per image, and the step's time beside the loader. Medians over ``--rounds``.

Usage: ``python benchmarks/thread_collate.py [--rounds R] [--batches N] [--workers W]
[--step-ms MS]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

import torch_spdl
from torch_spdl import compat
from torch_spdl.bench import training

BATCH = 64


class Decoded(torch.utils.data.Dataset):
    """``n`` decoded images, each a fresh copy of one."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.image = torch.randint(0, 256, (3, 224, 224), dtype=torch.uint8)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.image.clone()


def one_pass(loader: Any, step: training.Step) -> tuple[float, float, float]:
    """Images/s, process CPU µs per image, and the step's mean ms, over one pass."""
    images = steps = 0
    stepping = 0.0
    start, cpu = time.perf_counter(), time.process_time()
    for batch in loader:
        images += len(batch)
        began = time.perf_counter()
        step(batch)
        stepping += time.perf_counter() - began
        steps += 1
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    return images / wall, cpu / images * 1e6, stepping / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batches", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--step-ms", type=float, default=2.0)
    args = parser.parse_args()

    table = compat.default_collate_fn_map()
    if table is None or not hasattr(table[torch.Tensor], "__wrapped__"):
        raise SystemExit("this torch has no default_collate_fn_map: nothing to compare")
    entries = {"own memory": table[torch.Tensor], "shared memory": table[torch.Tensor].__wrapped__}
    step = training.calibrate(args.step_ms)
    alone = statistics.median(_timed(step) for _ in range(20))
    dataset = Decoded(args.batches * BATCH)
    results: dict[str, list[tuple[float, float, float]]] = {name: [] for name in entries}
    try:
        for round_ in range(args.rounds):
            for name, entry in entries.items():
                table[torch.Tensor] = entry
                loader = torch_spdl.DataLoader(
                    dataset, batch_size=BATCH, num_workers=args.workers, worker_method="thread"
                )
                results[name].append(one_pass(loader, step))
                rate, cpu, stepped = results[name][-1]
                print(
                    f"round {round_ + 1} {name:13s} {rate:8.0f} img/s {cpu:6.1f} µs CPU/img "
                    f"step {stepped:5.2f} ms",
                    flush=True,
                )
    finally:
        table[torch.Tensor] = entries["own memory"]
    print(f"\nstep alone: {alone:.2f} ms; medians of {args.rounds} rounds, {args.workers} threads")
    print("| batch stacked in | images/s | CPU µs per image | step beside the loader (ms) |")
    print("|---|---:|---:|---:|")
    for name, rows in results.items():
        rate, cpu, stepped = (statistics.median(column) for column in zip(*rows, strict=True))
        print(f"| {name} | {rate:,.0f} | {cpu:.1f} | {stepped:.2f} |")


def _timed(step: training.Step) -> float:
    batch = torch.zeros(BATCH, 3, 224, 224, dtype=torch.uint8)
    began = time.perf_counter()
    step(batch)
    return (time.perf_counter() - began) * 1e3


if __name__ == "__main__":
    main()
