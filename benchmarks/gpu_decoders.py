"""JPEG decode on the GPU: torchvision's nvJPEG op against nvImageCodec, batched, images/s.

The GPU-decode path (``RandomResizedCrop(decode_on="cuda")``) decodes each batch with
torchvision's ``decode_jpeg(list, device="cuda")``. nvImageCodec (``nvidia-nvimgcodec-cu13``,
with NVIDIA's ``nvidia-nvjpeg`` wheel beside it) decodes on the GPU too, and can use the
hardware JPEG engine of an A100 or H100. This measures both on the same files before one is
chosen: workload A's synthetic ImageFolder (or ``--data``), batches of 64 and 256, each timed
from the encoded bytes in host memory to every image a CUDA uint8 tensor, synchronized. It also
reports how far the two decoders' pixels are apart on the first batch.

Usage::

    python benchmarks/gpu_decoders.py [--data DIR] [--images 4096] [--repeats 10]

Without CUDA it says so and exits 0 (so that a scripted run goes on).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torchvision.io as tvio

from torch_spdl.bench.data import ImageSpec, synthetic_imagefolder

Decode = Callable[[list[bytes]], list[torch.Tensor]]


def torchvision_nvjpeg() -> Decode:
    """torchvision's batched nvJPEG op, CHW tensors (its deprecation warning silenced)."""

    def decode(batch: list[bytes]) -> list[torch.Tensor]:
        data = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in batch]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return tvio.decode_jpeg(data, mode=tvio.ImageReadMode.RGB, device="cuda")

    return decode


def nvimgcodec(backend: str | None) -> Decode | None:
    """nvImageCodec's batched decode on GPU 0, HWC tensors, with one backend kind or its
    default choice (None); None where the library is not installed."""
    try:  # imported as is: its errors for a missing nvJPEG are what this should show
        from nvidia import nvimgcodec as nv
    except ImportError:
        return None
    kwargs: dict[str, Any] = {"device_id": 0}
    if backend is not None:
        kwargs["backends"] = [nv.Backend(getattr(nv.BackendKind, backend))]
    decoder = nv.Decoder(**kwargs)
    params = nv.DecodeParams(apply_exif_orientation=False, color_spec=nv.ColorSpec.SRGB)

    def decode(batch: list[bytes]) -> list[torch.Tensor]:
        images = decoder.decode(batch, params=params)
        return [torch.as_tensor(image, device="cuda") for image in images]

    return decode


def timed(decode: Decode, batches: list[list[bytes]], repeats: int) -> float:
    """Median images/s over ``repeats`` batches, after one untimed batch."""
    decode(batches[0])
    torch.cuda.synchronize()
    rates = []
    for k in range(repeats):
        batch = batches[k % len(batches)]
        start = time.perf_counter()
        decode(batch)
        torch.cuda.synchronize()
        rates.append(len(batch) / (time.perf_counter() - start))
    return statistics.median(rates)


def batched(files: list[bytes], size: int) -> list[list[bytes]]:
    return [files[i : i + size] for i in range(0, len(files), size)]


def chw(image: torch.Tensor) -> torch.Tensor:
    return image if image.shape[0] == 3 else image.permute(2, 0, 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, help="an ImageFolder (default: the bench's)")
    parser.add_argument("--images", type=int, default=4096, help="synthetic images if no --data")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return 0
    root = args.data or synthetic_imagefolder(ImageSpec(args.images))
    files = [path.read_bytes() for path in sorted(Path(root).rglob("*.jpg"))[:2048]]
    nvjpeg = torchvision_nvjpeg()
    decoders: dict[str, Decode | None] = {"torchvision nvJPEG": nvjpeg}
    for backend in (None, "HW_GPU_ONLY", "GPU_ONLY", "HYBRID_CPU_GPU"):
        name = f"nvImageCodec {backend or 'default backends'}"
        try:
            decoders[name] = nvimgcodec(backend)
        except Exception as error:  # a backend this GPU or build lacks
            print(f"{name}: cannot be made: {type(error).__name__}: {error}")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {len(files)} JPEGs")
    print("| decoder | batch 64, images/s | batch 256, images/s | mean |Δ| vs torchvision |")
    print("|---|---:|---:|---:|")
    try:
        reference = [chw(image).float() for image in nvjpeg(files[:64])]
    except Exception as error:
        print(f"torchvision nvJPEG failed: {type(error).__name__}: {error}")
        reference = []
    for name, decode in decoders.items():
        if decode is None:
            print(f"| {name} | not installed | | |")
            continue
        try:
            rates = [timed(decode, batched(files, size), args.repeats) for size in (64, 256)]
            ours = [chw(image).float() for image in decode(files[:64])]
            apart = [(a - b).abs().mean().item() for a, b in zip(ours, reference, strict=False)]
            shown = f"{statistics.mean(apart):.3f}" if apart else "n/a"
            print(f"| {name} | {rates[0]:,.0f} | {rates[1]:,.0f} | {shown} |")
        except Exception as error:
            print(f"| {name} | failed: {type(error).__name__}: {error} | | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
