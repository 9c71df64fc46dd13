"""Where the GPU decode path loses to the model alone: the GPU's time, or the main process's.

On the H100 host (2026-11-27) ResNet-50 fed by the GPU decode path trained at 60-67 % of its
speed alone. Two things compete with the model there: the decode and crops run on the GPU the
model runs on, and the transfer stage that issues them is a thread in the training process,
which takes the GIL from the loop that launches the model's kernels. Making and freeing the
batch's ~500 tensors costs such a loop about 2 % of a 64 ms step (``benchmarks/gil_budget.py``
on 2 cores), so this script measures the rest, on batches of 256 encoded JPEGs made once by a
CPU loader:

- ``model alone``: the training step's wall time, and the GPU time of its kernels (CUDA events
  around the step on its stream): how busy the model keeps the GPU;
- ``decode alone``: one batch's nvJPEG decode and its crops on a side stream, their GPU time
  (events) and the issuing thread's CPU time;
- ``decode in the loop's thread``: each step first issues the next batch's decode on a side
  stream, then the model: no second thread, so what remains is GPU sharing (and the decode's CPU
  time, added to the loop's);
- ``decode in a second thread``: the transfer stage's arrangement, the loader's threads left
  out: GPU sharing and the GIL.

Without CUDA it runs the same on the CPU with ResNet-18 and small batches: a dry run of the
script, not a measurement. Usage::

    python benchmarks/gpu_budget.py [--images 2048] [--batch-size 256] [--steps 20]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import threading
import time
from collections.abc import Callable

import torch
from gpu_decode_steps import encoded_batches, synchronize
from train_e2e import Trainer

from torch_spdl.io import EncodedBatch


def kernel_ms(fn: Callable[[], object], calls: int) -> float:
    """The GPU's kernel time per call of ``fn`` (copies left out: they use the copy engines, not
    the SMs the model needs), from torch's profiler; 0 without CUDA. Events around the calls
    would count the GPU's idle gaps too, while a launch-bound step or nvJPEG's CPU phase keeps
    it waiting."""
    if not torch.cuda.is_available():
        return 0.0
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profile:
        for _ in range(calls):
            fn()
        synchronize()
    total_us = 0.0
    for event in profile.events():  # the kernels themselves, not the ops that launched them
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        if "memcpy" in event.name.lower() or "memset" in event.name.lower():
            continue
        total_us += event.time_range.elapsed_us()
    return total_us / calls / 1e3


def synthetic_batch(trainer: Trainer) -> tuple[torch.Tensor, torch.Tensor]:
    images = torch.randint(0, 256, (trainer.batch_size, 3, 224, 224), dtype=torch.uint8)
    labels = torch.randint(0, 1000, (trainer.batch_size,))
    return images.to(trainer.device), labels.to(trainer.device)


def run_steps(trainer: Trainer, steps: int, before_step: Callable[[int], None]) -> float:
    """Images/s of ``steps`` training steps (after 3 untimed), ``before_step(k)`` before each."""
    batch = synthetic_batch(trainer)
    for k in range(3):
        before_step(k)
        trainer.step(*batch)
    trainer.sync()
    began = time.perf_counter()
    for k in range(3, 3 + steps):
        before_step(k)
        trainer.step(*batch)
    trainer.sync()
    return steps * trainer.batch_size / (time.perf_counter() - began)


def model_alone(trainer: Trainer, steps: int) -> tuple[float, float]:
    """Images/s, and the GPU's kernel ms of one step."""
    alone = run_steps(trainer, steps, lambda k: None)
    batch = synthetic_batch(trainer)
    return alone, kernel_ms(lambda: trainer.step(*batch), 3)


def decode_alone(batches: list[EncodedBatch], device: torch.device) -> tuple[float, float]:
    """The GPU's kernel ms and the issuing thread's CPU ms of one batch's decode and crops,
    warm (nvJPEG's decoder is made on the first call)."""
    side = torch.cuda.Stream(device) if device.type == "cuda" else None
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        for batch in batches[:2]:
            batch.decode(device)
        synchronize()
        cpu = []
        for batch in batches:
            began = time.thread_time()
            batch.decode(device)
            cpu.append((time.thread_time() - began) * 1e3)
        gpu = kernel_ms(lambda: batches[0].decode(device), 3)
    return gpu, statistics.median(cpu)


def in_loop_thread(trainer: Trainer, batches: list[EncodedBatch], steps: int) -> float:
    """Each step issues the next batch's decode on a side stream first, in this thread."""
    device = trainer.device
    side = torch.cuda.Stream(device) if device.type == "cuda" else None
    kept: list[torch.Tensor] = []

    def before(k: int) -> None:
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            kept.append(batches[k % len(batches)].decode(device))
        del kept[:-2]  # a decoded batch lives while the step that would use it runs

    return run_steps(trainer, steps, before)


def in_second_thread(trainer: Trainer, batches: list[EncodedBatch], steps: int) -> float:
    """A second thread decodes one batch per step on its stream, as the transfer stage does."""
    device = trainer.device
    wanted, done = threading.Semaphore(2), threading.Semaphore(0)
    stopped = threading.Event()

    def transfer() -> None:
        side = torch.cuda.Stream(device) if device.type == "cuda" else None
        k = 0
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            while True:
                wanted.acquire()
                if stopped.is_set():
                    return
                batches[k % len(batches)].decode(device)
                k += 1
                done.release()

    thread = threading.Thread(target=transfer, name="transfer")
    thread.start()
    try:

        def before(k: int) -> None:
            done.acquire()  # this step's batch is decoded (issued); ask for the next
            wanted.release()

        return run_steps(trainer, steps, before)
    finally:
        stopped.set()
        wanted.release()
        thread.join()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda:
        args.batch_size, args.steps = min(args.batch_size, 16), min(args.steps, 3)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    batches = encoded_batches(args.images, args.batch_size, device)
    trainer = Trainer(device, args.batch_size)
    alone, step_gpu_ms = model_alone(trainer, args.steps)
    step_ms = args.batch_size / alone * 1e3
    decode_gpu_ms, decode_cpu_ms = decode_alone(batches, device)
    same = in_loop_thread(trainer, batches, args.steps)
    second = in_second_thread(trainer, batches, args.steps)
    name = torch.cuda.get_device_name() if cuda else "the CPU (a dry run, no CUDA GPU)"
    print(
        f"{name}, torch {torch.__version__}, {trainer.name}, batches of {args.batch_size}",
        "",
        f"model alone: {alone:,.0f} img/s, {step_ms:.1f} ms a step, its kernels "
        f"{step_gpu_ms:.1f} ms of GPU time ({step_gpu_ms / step_ms:.0%} of the step)",
        f"decode + crops alone: {decode_gpu_ms:.1f} ms of GPU time a batch, "
        f"{decode_cpu_ms:.1f} ms of CPU in the issuing thread",
        "the model's speed if the GPU's kernel time were all that counted: "
        f"{step_ms / max(step_ms, step_gpu_ms + decode_gpu_ms):.0%} of alone",
        "",
        "| the model with the decode | img/s | × model alone |",
        "|---|---:|---:|",
        f"| in the loop's thread, side stream | {same:,.0f} | {same / alone:.2f} |",
        f"| in a second thread, side stream | {second:,.0f} | {second / alone:.2f} |",
        sep="\n",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
