"""Why workload A's numbers are what they are: CPU per step, thread scaling, CPU per thread.

Three views, each measured in the same process as the loaders:

- :func:`stage_costs`: milliseconds of CPU per sample for each step of both paths, in one
  thread with no loader. Thread CPU time rather than wall time, so other programs on the
  machine barely move it. ``N / cost`` is a path's limit on N cores; the steps say which dominates.
- :func:`thread_scaling`: the per-sample function alone in a plain pool of 1 and of 2 threads.
  Its speed-up at 2 threads, and the 2 threads' wait for the GIL, are what the GIL lets that
  code reach before any loader is involved.
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
from pathlib import Path
from typing import Any, NamedTuple

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


class Pooled(NamedTuple):
    """A plain thread pool's run of one function over its items."""

    rate: float  # items per second
    gil_wait: float  # the threads' share of their time neither on a CPU nor queued for one


def pooled(work: Callable[[int], Any], items: int, threads: int) -> Pooled:
    """``work`` over ``range(items)`` on ``threads`` threads, each with its share: items per
    second, and their wait for the GIL as ``"auto"``'s trial reads a stage's threads (their
    time neither on a CPU nor queued for one: :class:`~torch_spdl.auto.ThreadClock`).

    Two threads of work that holds the GIL all its time wait about half of theirs; work that
    releases it, about none. Unlike a thread that wants the GIL all the time beside the work,
    nothing here hands the GIL over more often than the work itself does: such a thread makes
    each of the work's many short releases a 5 ms wait to take it back, and reads the hand-offs
    as held (the classic path's 256 images took 28.5 s beside one instead of 0.63 s).
    """
    tally, lock, together = Tally(), threading.Lock(), threading.Barrier(threads)

    def run(share: range) -> None:  # timed whole: a call shorter than a GIL slice waits between
        together.wait()  # a thread started first would otherwise run its share alone a while
        begin = ThreadClock.read()
        for i in share:
            work(i)
        end = ThreadClock.read()
        with lock:  # the GIL may be off
            tally.add(begin, end)

    pool = [threading.Thread(target=run, args=(range(k, items, threads),)) for k in range(threads)]
    start = time.perf_counter()
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    return Pooled(items / (time.perf_counter() - start), tally.waiting)


def thread_scaling(root: Path, items: int = 256, rounds: int = 3) -> dict[str, float]:
    """Samples/s of each path's per-sample work on 1 and 2 plain threads, the speed-up, and the
    2 threads' wait for the GIL (:func:`pooled`).

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
    runs: dict[tuple[str, int], list[Pooled]] = {}
    with intra_op_threads(1):
        for _ in range(rounds):
            for name, work in works.items():
                for threads in (1, 2):
                    runs.setdefault((name, threads), []).append(pooled(work, count, threads))
    found = {}
    for name in works:
        one, two = (statistics.median(run.rate for run in runs[name, t]) for t in (1, 2))
        found[f"{name}, 1 thread (samples/s)"] = one
        found[f"{name}, 2 threads (samples/s)"] = two
        found[f"{name}, speed-up at 2 threads"] = two / one
        wait = statistics.median(run.gil_wait for run in runs[name, 2])
        found[f"{name}, 2 threads' wait for the GIL (% of their time)"] = 100 * wait
    return found


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
