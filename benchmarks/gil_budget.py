"""What a training loop that launches ops loses to each tensor another thread makes and frees.

A training step that launches a GPU model's kernels is Python and torch calls on one thread,
busy for its whole step where the model is launch-bound. Workload D's step (tiny in-place torch
ops, calibrated to ``--step-ms`` alone) stands in for it. Beside it, a second thread does what the
GPU decode's transfer stage does per batch in the main process: it makes ``k`` tensors (views of
one buffer, as the encoded images are) and frees them, once per step, as a batch arrives. Each of
those calls lets the GIL go, and the step's thread, which lets it go at each of its own ops, has
to win it back.

The table gives the step's median time beside the thread against alone, and what each tensor
made and freed cost the step. That cost, against the share of a step a loader may take from the
training loop, says how many tensors a batch may make in the main process: for 97 % of a
launch-bound model's speed, 3 % of its step.

A second table times freeing a batch that came through shared memory (torch's
``share_memory_()``, as batches from worker processes do, torch's included), and how much of
that time a Python thread beside it got the GIL: the rest the free held it; and the same with
the pages given back first without the GIL, as the loader does (``torch_spdl.shared_pages``).

Usage: ``python benchmarks/gil_budget.py [--step-ms MS] [--steps N] [--rounds R]``.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch
from gil_handoffs import busy_thread

from torch_spdl import shared_pages
from torch_spdl.bench import training

COUNTS = (0, 64, 256, 512, 1024)


class Transfer:
    """A thread that makes and frees ``count`` tensors each time :meth:`batch` is called."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.buffer = torch.zeros(count * 16 + 16, dtype=torch.uint8)
        self.arrived = threading.Semaphore(0)
        self.done = threading.Semaphore(0)
        self.stopped = False
        self.thread = threading.Thread(target=self._run, name="transfer")
        self.thread.start()

    def batch(self) -> None:
        self.arrived.release()

    def _run(self) -> None:
        while True:
            self.arrived.acquire()
            if self.stopped:
                return
            views = [self.buffer[16 * i : 16 * i + 16] for i in range(self.count)]
            del views
            self.done.release()

    def stop(self) -> None:
        self.stopped = True
        self.arrived.release()
        self.thread.join()


def steps(step: training.Step, count: int | None, n: int) -> float:
    """The median step time in ms over ``n`` steps; beside a :class:`Transfer` of ``count``
    tensors a batch, or alone where ``count`` is None."""
    transfer = None if count is None else Transfer(count)
    times = []
    try:
        for _ in range(n):
            if transfer is not None:
                transfer.batch()
            began = time.perf_counter()
            step(None)
            times.append(time.perf_counter() - began)
            if transfer is not None:
                transfer.done.acquire()  # the next batch arrives once this one is through
    finally:
        if transfer is not None:
            transfer.stop()
    return statistics.median(times) * 1e3


def shared_free(megabytes: float, release: bool, repeats: int = 7) -> tuple[float, float]:
    """Median ms to free a shared-memory tensor of ``megabytes``, its pages given back first
    without the GIL where ``release`` (:mod:`torch_spdl.shared_pages`, as the loader does with
    the segments it made for one message), and the ms of it that a spinning Python thread
    beside it ran (it runs only while it holds the GIL; at a switch interval of 0.5 ms it takes
    the GIL as soon as the free lets it go)."""
    with busy_thread(0.0005) as spins:
        began, first = time.perf_counter(), spins[0]
        time.sleep(0.1)
        per_ms = (spins[0] - first) / (time.perf_counter() - began) / 1e3
        took, ran = [], []
        for _ in range(repeats):
            batch = torch.ones(int(megabytes * 1e6), dtype=torch.uint8).share_memory_()
            first, began = spins[0], time.perf_counter()
            if release:
                shared_pages.release(batch)
            del batch
            took.append((time.perf_counter() - began) * 1e3)
            ran.append((spins[0] - first) / per_ms)
    return statistics.median(took), statistics.median(ran)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--step-ms", type=float, default=20.0)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    step = training.calibrate(args.step_ms)
    alone: list[float] = []
    beside: dict[int, list[float]] = {count: [] for count in COUNTS}
    for _ in range(args.rounds):
        alone.append(steps(step, None, args.steps))
        for count in COUNTS:
            beside[count].append(steps(step, count, args.steps))
    base = statistics.median(alone)
    print(f"step alone: {base:.2f} ms (median of {args.rounds} rounds of {args.steps} steps)")
    print("| tensors made and freed per step | step (ms) | × alone | µs of step per tensor |")
    print("|---:|---:|---:|---:|")
    for count, times in beside.items():
        ms = statistics.median(times)
        per = "" if count == 0 else f"{(ms - base) / count * 1e3:.1f}"
        print(f"| {count} | {ms:.2f} | {ms / base:.3f} | {per} |")
    print(
        "\n| a shared-memory batch freed (MB) | ms | of which another thread ran (ms) "
        "| pages given back first: ms | of which another thread ran (ms) |"
    )
    print("|---:|---:|---:|---:|---:|")
    # 64 and 256 images of 3×224×224 bytes, and 256 encoded JPEGs of workload A
    for megabytes in (9.6, 29.0, 38.5):
        cells = [f"{ms:.2f}" for release in (False, True) for ms in shared_free(megabytes, release)]
        print(f"| {megabytes} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
