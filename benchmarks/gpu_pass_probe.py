"""Where a pass's time goes on a GPU host, loader alone (ImageFolder of 4,096 synthetic JPEGs,
batch 256, 15 workers; figures in docs/performance.md, "On a GPU host: one H200").

  python benchmarks/gpu_pass_probe.py a   # worker processes: each pass's pool start, first
                                          # batch, pass time and close, against torch's fork
  python benchmarks/gpu_pass_probe.py b   # GPU decode: every batch that waits over 0.4 s,
                                          # with the transfer thread's stacks sampled meanwhile
"""

import collections
import sys
import threading
import time
import traceback

import torch
import torchvision
from torchvision import transforms

import torch_spdl
import torch_spdl.bench.data as d
from torch_spdl import processes
from torch_spdl.bench.images import FastImages, collate
from torch_spdl.io import RandomResizedCrop


def passes(name, loader, count, on_batch=None):
    """``count`` passes of ``loader``, each one's first batch, seconds and main-process CPU."""
    for p in range(count):
        t0, c0 = time.perf_counter(), time.process_time()
        first, n, last = None, 0, t0
        for i, b in enumerate(loader):
            now = time.perf_counter()
            if first is None:
                first = now - t0
            if on_batch:
                on_batch(p, i, last, now)
            last = now
            n += len(b[0])
        t1 = time.perf_counter()
        print(
            f"{name} pass {p}: first {first:.3f} s, pass {t1 - t0:.3f} s, "
            f"{n / (t1 - t0):.0f} img/s, main CPU {time.process_time() - c0:.2f} s",
            flush=True,
        )


def part_a(folder, workers, batch):
    """torch's forked workers against ours from the fork server, pass by pass, with the pool's
    start (all processes forked), set-up (all ready) and close timed inside."""
    timings = collections.defaultdict(list)
    orig_init = processes.ProcessPool.__init__

    def timed_init(self, *a, **k):
        t = time.perf_counter()
        orig_init(self, *a, **k)
        timings["pool_init"].append(round(time.perf_counter() - t, 3))
        t = time.perf_counter()
        self.wait_ready()
        timings["all_ready"].append(round(time.perf_counter() - t, 3))

    processes.ProcessPool.__init__ = timed_init
    orig_close = processes._Processes.close

    def timed_close(self):
        t = time.perf_counter()
        orig_close(self)
        timings["pool_close"].append(round(time.perf_counter() - t, 3))

    processes._Processes.close = timed_close
    common = dict(batch_size=batch, shuffle=True, drop_last=True, num_workers=workers)
    cuda = torch.cuda.is_available()
    passes("torch", torch.utils.data.DataLoader(folder, pin_memory=cuda, **common), 3)
    device = "cuda" if cuda else None
    loader = torch_spdl.DataLoader(folder, device=device, worker_method="process", **common)
    passes("spdl-process", loader, 4)
    print("spdl-process", dict(timings), flush=True)
    print(loader.stats(), flush=True)
    processes.ProcessPool.__init__ = orig_init
    processes._Processes.close = orig_close


def part_b(folder, workers, batch):
    """The GPU decode loader on threads; a sampler thread records the transfer thread's stack
    every 10 ms, and each slow batch lists the stacks seen while it was awaited."""
    dataset = FastImages(folder.samples, RandomResizedCrop(224, decode_on="cuda"))
    loader = torch_spdl.DataLoader(
        dataset,
        collate_fn=collate,
        io_workers=4,
        device="cuda",
        batch_size=batch,
        shuffle=True,
        drop_last=True,
        num_workers=workers,
        worker_method="thread",
    )
    samples = []  # (time, stack of the transfer thread)
    stop = threading.Event()

    def sampler():
        while not stop.is_set():
            frames = sys._current_frames()
            now = time.perf_counter()
            for t in threading.enumerate():
                if "transfer" in t.name and t.ident in frames:
                    stack = traceback.extract_stack(frames[t.ident])
                    samples.append(
                        (
                            now,
                            tuple(
                                f"{f.filename.split('/')[-1]}:{f.lineno} {f.name}"
                                for f in stack[-6:]
                            ),
                        )
                    )
            time.sleep(0.01)

    thread = threading.Thread(target=sampler)
    thread.start()
    slow = []

    def on_batch(p, i, last, now):
        if now - last > 0.4:
            slow.append((p, i, last, now))

    try:
        passes("gpu-decode", loader, 3, on_batch)
    finally:
        stop.set()
        thread.join()
    for p, i, a, b in slow:
        print(f"slow batch: pass {p} batch {i} waited {b - a:.3f} s", flush=True)
        counts = collections.Counter(s for t, s in samples if a <= t <= b)
        for stack, n in counts.most_common(3):
            print(f"  {n} samples:", " <- ".join(reversed(stack)), flush=True)
    print(loader.stats(), flush=True)


def main():
    workers, images, batch = 15, 4096, 256
    folder = d.synthetic_imagefolder(d.ImageSpec(images))
    transform = transforms.Compose(
        [
            transforms.RandomResizedCrop(224),
            transforms.RandomHorizontalFlip(),
            transforms.PILToTensor(),
        ]
    )
    folder = torchvision.datasets.ImageFolder(str(folder), transform=transform)
    which = sys.argv[1] if len(sys.argv) > 1 else "ab"
    if "a" in which:
        part_a(folder, workers, batch)
    if "b" in which and torch.cuda.is_available():
        part_b(folder, workers, batch)


if __name__ == "__main__":
    main()
