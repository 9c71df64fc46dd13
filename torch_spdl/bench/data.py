"""The image data for workload A: a synthetic ImageNet-like JPEG ImageFolder, made once and cached.

ImageNet's training JPEGs are mostly 350–640 px wide and 300–500 px high and average about
110 KB. Decoding cost is set by pixel count and by how many bits the entropy decoder has to read,
so the synthetic images match both: random sizes in those ranges, and content (smooth colour
fields, a mid-frequency texture and noise) tuned so that quality-90 JPEGs land near 110 KB, far
from what a flat or pure-noise image costs. They are written once under the user's cache
directory and reused by every later run, since making them takes longer than a quick benchmark.
"""

from __future__ import annotations

import io
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

WIDTHS = (350, 640)  # inclusive ranges, as ImageNet's common sizes
HEIGHTS = (300, 500)
QUALITY = 90
NOISE = 20  # standard deviation of the per-pixel noise, in grey levels: sets the file size
CLASSES = 10
VERSION = 1  # bump when the images change, so an old cache is not reused
COMPLETE = ".complete"  # written last: a folder without it is an interrupted generation


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/torch_spdl``, or ``~/.cache/torch_spdl`` (the XDG default)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "torch_spdl"


@dataclass(frozen=True)
class ImageSpec:
    """What to generate; every field is part of the cache key."""

    images: int = 2048
    seed: int = 0

    @property
    def name(self) -> str:
        return f"imagefolder-v{VERSION}-n{self.images}-s{self.seed}"


def make_jpeg(rng: np.random.Generator) -> bytes:
    """One ImageNet-like JPEG: a random size in range, photo-like content, about 110 KB."""
    width = int(rng.integers(WIDTHS[0], WIDTHS[1] + 1))
    height = int(rng.integers(HEIGHTS[0], HEIGHTS[1] + 1))
    coarse = rng.integers(0, 256, size=(*rng.integers(4, 12, size=2), 3), dtype=np.uint8)
    smooth = np.asarray(Image.fromarray(coarse).resize((width, height), Image.Resampling.BICUBIC))
    texture = rng.integers(0, 256, size=(height // 8, width // 8, 3), dtype=np.uint8)
    texture = np.asarray(
        Image.fromarray(texture).resize((width, height), Image.Resampling.BILINEAR)
    )
    noise = rng.normal(0, NOISE, size=smooth.shape)
    pixels = np.clip(0.6 * smooth + 0.4 * texture + noise, 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=QUALITY)
    return out.getvalue()


def _write(root: Path, spec: ImageSpec, index: int) -> None:
    # A seed per image, so the files do not depend on how the thread pool orders the work.
    rng = np.random.default_rng([spec.seed, index])
    folder = root / f"class_{index % CLASSES:02d}"
    folder.mkdir(exist_ok=True)
    (folder / f"{index:06d}.jpg").write_bytes(make_jpeg(rng))


def synthetic_imagefolder(
    spec: ImageSpec = ImageSpec(),
    *,
    cache: Path | None = None,
    progress: Callable[[str], None] | None = None,
) -> Path:
    """The ImageFolder for ``spec`` under ``cache`` (default :func:`cache_dir`), made if missing.

    It is built in a temporary sibling folder and renamed into place when complete, so an
    interrupted run leaves nothing that a later run would mistake for the data set, and two runs
    racing to build it both end up with a complete one.
    """
    parent = (cache or cache_dir()) / "bench"
    root = parent / spec.name
    if (root / COMPLETE).exists():
        return root
    parent.mkdir(parents=True, exist_ok=True)
    say = progress or (lambda message: print(message, file=sys.stderr, flush=True))
    say(f"writing {spec.images} synthetic JPEGs to {root} (once; later runs reuse them)")
    staging = Path(tempfile.mkdtemp(prefix=f".{spec.name}-", dir=parent))
    try:
        with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
            list(pool.map(lambda i: _write(staging, spec, i), range(spec.images)))
        (staging / COMPLETE).touch()
        try:
            staging.rename(root)
        except OSError:  # another run finished first: keep its copy
            if not (root / COMPLETE).exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return root
