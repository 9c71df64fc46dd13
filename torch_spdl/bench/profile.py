"""Why workload A's numbers are what they are: CPU per step, thread scaling, CPU per thread.

Three views, each measured in the same process as the loaders:

- :func:`stage_costs`: milliseconds of CPU per sample for each step of both paths, in one
  thread with no loader. Thread CPU time rather than wall time, so other programs on the
  machine barely move it. ``2 / cost`` is a path's 2-core limit; the steps say which dominates.
- :func:`thread_scaling`: the per-sample function alone in a plain pool of 1 and of 2 threads.
  Its speed-up at 2 threads is what the GIL lets that code reach before any loader is involved.
- :func:`loader_cpu`: a loader's CPU per sample split by thread (torch_spdl names its threads
  after their stage) or by process (torch's workers), so overhead outside the transform shows.
- :func:`intra_op_effect`: one loader with torch's default intra-op threads and with one.
"""

from __future__ import annotations

import io
import os
import statistics
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from PIL import Image
from torchvision import datasets

from torch_spdl.io import RandomResizedCrop, decode_image
from torch_spdl.io.region import region_decoder

from ..auto import Tally, ThreadClock
from .images import RATIO, SCALE, SIZE, classic_transform, fast_transform
from .measure import Variant, intra_op_threads, measure
from .memory import cpu_seconds, tree


def stage_costs(root: Path, images: int = 128) -> dict[str, float]:
    """CPU milliseconds per sample of each step, one thread (one intra-op thread too)."""
    folder = datasets.ImageFolder(str(root))
    paths = [path for path, _ in folder.samples[:images]]
    raw = [bytearray(Path(p).read_bytes()) for p in paths]
    pil_transform = classic_transform()

    def pil_decode(data: bytearray) -> Image.Image:
        return Image.open(io.BytesIO(data)).convert("RGB")

    steps = {
        "read file": lambda i: Path(paths[i]).read_bytes(),
        "PIL decode": lambda i: pil_decode(raw[i]),
        "PIL decode + classic transform": lambda i: pil_transform(pil_decode(raw[i])),
        "torchvision decode (decode_image)": lambda i: decode_image(raw[i]),
        "fast path (decode + crop + flip)": lambda i: fast_transform(raw[i]),
    }
    if region_decoder() is not None:  # the fast path above decodes only the crop
        whole = RandomResizedCrop(SIZE, scale=SCALE, ratio=RATIO, region=False)
        steps["fast path, whole image decoded"] = lambda i: whole(raw[i])
    costs = {}
    with intra_op_threads(1):  # one thread means one: no OpenMP helpers for torch's kernels
        for name, step in steps.items():
            step(0)  # first-call set-up is not per-sample cost
            start = time.thread_time()
            for i in range(len(raw)):
                step(i)
            costs[name] = (time.thread_time() - start) / len(raw) * 1000
    return costs


def pool_rate(work: Callable[[int], Any], items: int, threads: int) -> float:
    """Items per second of ``work`` over ``range(items)`` on a pool of ``threads`` threads."""
    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        for _ in pool.map(work, range(items)):
            pass
    return items / (time.perf_counter() - start)


def thread_scaling(root: Path, items: int = 256, rounds: int = 3) -> dict[str, float]:
    """Samples/s of each path's per-sample work on 1 and 2 plain threads, and the speed-up.

    Rounds interleave the four runs; medians. The classic path is ``ImageFolder[i]`` (read, PIL
    decode, transform); the fast path reads the file and calls :func:`fast_transform`.
    """
    folder = datasets.ImageFolder(str(root), transform=classic_transform())
    paths = [path for path, _ in folder.samples]
    count = min(items, len(paths))
    works = {
        "classic": folder.__getitem__,
        "fast path": lambda i: fast_transform(bytearray(Path(paths[i]).read_bytes())),
    }
    rates: dict[tuple[str, int], list[float]] = {}
    held: dict[str, list[float]] = {}
    with intra_op_threads(1):
        for _ in range(rounds):
            for name, work in works.items():
                for threads in (1, 2):
                    rates.setdefault((name, threads), []).append(pool_rate(work, count, threads))
                held.setdefault(name, []).append(gil_held(work, count))
    found = {}
    for name in works:
        one, two = (statistics.median(rates[name, t]) for t in (1, 2))
        found[f"{name}, 1 thread (samples/s)"] = one
        found[f"{name}, 2 threads (samples/s)"] = two
        found[f"{name}, speed-up at 2 threads"] = two / one
        found[f"{name}, GIL held (% of its time)"] = 100 * statistics.median(held[name])
    return found


def gil_held(work: Callable[[int], Any], items: int, repeats: int = 1) -> float:
    """The share of ``work``'s own time (one thread, ``work(i)`` for ``i < items``) that holds
    the GIL, measured the way ``worker_method="auto"`` measures GIL waits.

    A thread that always needs the GIL (a counting loop) runs beside ``work``; the time it spends
    neither on a CPU nor queued for one (:class:`~torch_spdl.auto.ThreadClock`: wall less CPU
    less run-queue time) is time the GIL was held elsewhere, by ``work`` or in a hand-off between
    the two (counted as held, so the figure errs high). Divided by ``work``'s time alone; a
    GIL-free build reads about 0.

    Other load on the machine lowers the figure: the counter, woken to take the GIL, may sit in
    the run queue while ``work`` holds it again, and queued time is not counted (three busy
    processes on 2 cores took pure Python from 1.0 to 0.3-0.6, and hashing a buffer from 0.02 to
    at most 0.2). ``repeats`` measurements give their median, which single preemptions move
    less.
    """
    return statistics.median(_gil_held_once(work, items) for _ in range(repeats))


def _gil_held_once(work: Callable[[int], Any], items: int) -> float:
    start = time.perf_counter()
    for i in range(items):
        work(i)
    alone = time.perf_counter() - start
    with _Counter() as counter:
        for i in range(items):
            work(i)
    return counter.waited.waiting_s / alone


class _Counter:
    """A thread that needs the GIL all the time, timing its own wait for it, for the length of
    a ``with`` block."""

    def __init__(self) -> None:
        self.waited = Tally()
        self._stop = threading.Event()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gil counter")

    def _run(self) -> None:
        stopped, count = self._stop.is_set, 0
        began = ThreadClock.read()
        self._started.set()
        while not stopped():
            count += 1
        self.waited.add(began, ThreadClock.read())

    def __enter__(self) -> _Counter:
        self._thread.start()
        self._started.wait()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _group(thread: threading.Thread | None) -> str:
    """torch_spdl's threads are named ``torch_spdl.DataLoader-<id>:<stage>:<n>``."""
    if thread is None:
        return "other threads (OpenMP helpers)"
    parts = thread.name.split(":")
    if thread.name.startswith("torch_spdl.DataLoader") and len(parts) > 1:
        return f"stage {parts[1]}"
    return "main thread" if thread is threading.main_thread() else thread.name


def loader_cpu(make: Callable[[], Iterable[Any]], batches: int, size: int) -> dict[str, float]:
    """CPU milliseconds per sample of a loader, by thread of this process and by child process.

    Read after the last batch and before the loader is torn down, while every thread and
    worker process is still there to be read.
    """
    me = os.getpid()
    before = {
        int(t): cpu_seconds(f"/proc/{me}/task/{t}/stat") for t in os.listdir(f"/proc/{me}/task")
    }
    # processes already there (a fork server an earlier loader started) count from here on only
    children_before = {pid: cpu_seconds(f"/proc/{pid}/stat") for pid in tree(me) if pid != me}
    loader = make()
    iterator = iter(loader)
    for done, _ in enumerate(iterator, start=1):
        if done == batches:
            break
    by_tid = {t.native_id: t for t in threading.enumerate()}
    spent: defaultdict[str, float] = defaultdict(float)  # CPU seconds by group
    for name in os.listdir(f"/proc/{me}/task"):
        tid = int(name)
        used = cpu_seconds(f"/proc/{me}/task/{tid}/stat") - before.get(tid, 0)
        spent[_group(by_tid.get(tid))] += used
    for pid in tree(me):
        if pid != me:
            used = cpu_seconds(f"/proc/{pid}/stat") - children_before.get(pid, 0)
            spent["worker processes"] += used
    del iterator, loader
    samples = batches * size
    ranked = sorted(spent.items(), key=lambda item: item[1], reverse=True)  # as most_common()
    return {group: seconds / samples * 1000 for group, seconds in ranked}


def intra_op_effect(variant: Variant, rounds: int = 3) -> dict[str, float]:
    """Samples/s of one loader with torch's default intra-op threads and with one, interleaved.

    torch's worker processes each call ``torch.set_num_threads(1)``, and torch_spdl's worker and
    collate threads set the same count for themselves
    (:func:`torch_spdl.workers.single_threaded_kernels`). Were they to keep the process's count,
    every kernel they run (``torch.stack`` in collate, a resize) could start OpenMP helpers on
    cores the other workers already use. Setting it process-wide should therefore change
    nothing; a difference here means some thread still runs parallel kernels.
    """
    settings = {"default intra-op threads": None, "torch.set_num_threads(1)": 1}
    rates: dict[str, list[float]] = {setting: [] for setting in settings}
    for _ in range(rounds):
        for setting, threads in settings.items():
            with intra_op_threads(threads):
                rates[setting].append(measure(variant).samples_per_s)
    return {f"{variant.name}, {k} (samples/s)": statistics.median(v) for k, v in rates.items()}
