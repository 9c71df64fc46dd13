"""Video clips through ``torch_spdl.DataLoader``: read files in ``load``, decode in ``preprocess``.

A video dataset is the case the two hooks are made for: reading a clip is I/O (it should not
occupy a CPU worker while the disk or network answers) and decoding it is CPU work in FFmpeg,
which releases the GIL, so ``num_workers`` threads decode clips truly in parallel.
:func:`torch_spdl.io.decode_video` picks ``8`` evenly spaced frames from each clip and converts
them to RGB at ``56×56`` in one swscale pass, giving a uint8 ``T×C×H×W`` tensor per clip; the
default collate stacks those into ``N×T×C×H×W`` batches.

With no ``--root`` it writes ``--clips`` short synthetic videos (32 frames of 96×64, H.264 with
libx264 where this FFmpeg build can encode it, MPEG-4 Part 2 otherwise) to a temporary directory
and removes it at exit. Given a ``--root`` that already holds ``.mp4`` files, it uses those.

Run from the repository root after ``pip install -e ".[test]"``::

    python examples/video_clips.py [--root DIR] [--clips N] [--num-workers W] [--epochs E]

The throughput is wall-clock clips per second over all epochs, thread start-up included; on a
dozen tiny clips it measures per-batch overhead as much as decoding speed.
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import av
import numpy as np
import torch

import torch_spdl
from torch_spdl.io import decode_video

FRAMES_PER_VIDEO = 32
VIDEO_WIDTH, VIDEO_HEIGHT = 96, 64  # libx264 with yuv420p needs even dimensions
CLIP_FRAMES = 8
CLIP_SIZE = (56, 56)  # (height, width) of each decoded frame
BATCH_SIZE = 4


# -- the data ------------------------------------------------------------------------------------
def pick_codec() -> str:
    """libx264 where PyAV's FFmpeg can encode it (the common case), else the built-in mpeg4.

    ``av.codecs_available`` lists decoders too, so ask for an encoder explicitly: some FFmpeg
    builds ship the H.264 decoder without the GPL libx264 encoder.
    """
    try:
        av.codec.Codec("libx264", "w")
    except Exception:  # noqa: BLE001 - any failure here just means "not encodable"
        return "mpeg4"
    return "libx264"


def make_videos(root: Path, num_clips: int, seed: int = 0) -> str:
    """Write ``num_clips`` videos as ``root/clip_<i>.mp4``; return the codec used.

    Each clip is a smooth colour gradient that scrolls a little every frame, plus mild noise: it
    has real motion for the encoder (unlike a constant frame) yet stays small on disk.
    """
    root.mkdir(parents=True, exist_ok=True)
    codec = pick_codec()
    rng = np.random.default_rng(seed)
    ys, xs = np.mgrid[0:VIDEO_HEIGHT, 0:VIDEO_WIDTH]
    for i in range(num_clips):
        base = rng.integers(0, 256, size=3)
        with av.open(str(root / f"clip_{i:03d}.mp4"), mode="w") as container:
            stream = container.add_stream(codec, rate=25)
            stream.width, stream.height, stream.pix_fmt = VIDEO_WIDTH, VIDEO_HEIGHT, "yuv420p"
            for t in range(FRAMES_PER_VIDEO):
                red, green, blue = xs * 2 + t * 3, ys * 3 + t * 2, xs + ys
                channels = [red + base[0], green + base[1], blue + base[2]]
                pixels = np.stack(channels, axis=-1) % 256
                pixels = np.clip(pixels + rng.integers(-8, 9, size=pixels.shape), 0, 255)
                frame = av.VideoFrame.from_ndarray(pixels.astype(np.uint8), format="rgb24")
                container.mux(stream.encode(frame))
            container.mux(stream.encode(None))  # flush the frames the encoder still holds
    return codec


# -- the dataset ---------------------------------------------------------------------------------
class VideoFiles(torch_spdl.StagedDataset):
    """Video files split into an I/O stage (read the bytes) and a CPU stage (decode a clip).

    ``__getitem__`` (inherited) is ``preprocess(load(index))``, so this class would also work
    with ``torch.utils.data.DataLoader``; ``torch_spdl.DataLoader`` runs the two halves on their
    own thread pools (``io_workers`` for ``load``, ``num_workers`` for ``preprocess``).
    """

    def __init__(self, paths: list[Path]) -> None:
        self.paths = paths

    def __len__(self) -> int:
        return len(self.paths)

    def load(self, index: int) -> bytes:
        """Only the file read, so a slow disk or network store never blocks a decoding thread."""
        return self.paths[index].read_bytes()

    def preprocess(self, raw: bytes) -> torch.Tensor:
        """Decode ``CLIP_FRAMES`` evenly spaced frames at ``CLIP_SIZE``: uint8 ``T×3×H×W``."""
        return decode_video(raw, num_frames=CLIP_FRAMES, size=CLIP_SIZE)


# -- main ----------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, help="directory of .mp4 files (default: a temp dir)")
    parser.add_argument("--clips", type=int, default=12, help="videos to generate")
    parser.add_argument("--num-workers", type=int, default=2, help="decoding threads")
    parser.add_argument("--epochs", type=int, default=2)
    return parser.parse_args(argv)


@contextlib.contextmanager
def video_root(args: argparse.Namespace) -> Iterator[Path]:
    """The data directory: ``--root`` (filled if it holds no videos), or a temp dir removed on
    exit (also when the run fails, so a broken run leaves nothing behind)."""
    with contextlib.ExitStack() as stack:
        root = args.root
        if root is None:
            root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="video-clips-")))
        if root.is_dir() and any(root.glob("*.mp4")):
            print(f"using the existing videos in {root}")
        else:
            start = time.perf_counter()
            codec = make_videos(root, args.clips)
            elapsed = time.perf_counter() - start
            print(f"wrote {args.clips} {codec} videos to {root} in {elapsed:.1f} s")
        yield root


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.manual_seed(0)  # the shuffle order, for repeatable runs
    expected_tail = (CLIP_FRAMES, 3, *CLIP_SIZE)
    with video_root(args) as root:
        dataset = VideoFiles(sorted(root.glob("*.mp4")))
        print(f"dataset: {len(dataset)} videos")
        loader = torch_spdl.DataLoader(
            dataset, batch_size=BATCH_SIZE, shuffle=True, num_workers=args.num_workers
        )
        clips = 0
        start = time.perf_counter()
        for epoch in range(args.epochs):
            for step, batch in enumerate(loader):
                if step == 0:
                    print(f"epoch {epoch}: first batch {tuple(batch.shape)} {batch.dtype}")
                # Every batch is N×T×C×H×W uint8; only the last one of an epoch may be short.
                assert batch.dtype == torch.uint8, batch.dtype
                assert batch.ndim == 5 and tuple(batch.shape[1:]) == expected_tail, batch.shape
                assert 1 <= batch.shape[0] <= BATCH_SIZE, batch.shape
                clips += batch.shape[0]
        elapsed = time.perf_counter() - start
    expected = len(dataset) * args.epochs
    assert clips == expected, f"saw {clips} clips, expected {expected}"
    rate = clips / elapsed
    print(f"torch_spdl.DataLoader: {clips} clips in {elapsed:.2f} s = {rate:.1f} clips/s")
    print(f"OK: {clips} clips decoded as N×{CLIP_FRAMES}×3×{CLIP_SIZE[0]}×{CLIP_SIZE[1]} uint8")


if __name__ == "__main__":
    main()
