"""The media examples (video clips, async HTTP loads) run end to end in a fresh interpreter."""

from __future__ import annotations

import re

import pytest
from subprocesses import run_example

pytestmark = pytest.mark.integration


def test_video_clips_example(tmp_path):
    root = tmp_path / "videos"
    out = run_example(
        "video_clips.py", "--root", str(root), "--clips", "6", "--num-workers", "2", "--epochs", "2"
    )
    assert re.search(rf"wrote 6 (libx264|mpeg4) videos to {re.escape(str(root))}", out), out
    assert "dataset: 6 videos" in out
    # 6 clips in batches of 4: each epoch starts with a full batch
    assert out.count("first batch (4, 8, 3, 56, 56) torch.uint8") == 2, out
    assert re.search(r"torch_spdl.DataLoader: 12 clips in [\d.]+ s = [\d.]+ clips/s", out), out
    assert "OK: 12 clips decoded as N×8×3×56×56 uint8" in out
    # a second run over the same --root reuses the files instead of writing them again
    again = run_example("video_clips.py", "--root", str(root), "--epochs", "1")
    assert f"using the existing videos in {root}" in again
    assert "OK: 6 clips decoded" in again


def test_http_async_example():
    out = run_example("http_async.py", "--items", "64", "--latency", "10", "--torch-workers", "2")
    assert re.search(r"HTTP server on 127\.0\.0\.1:\d+, 10 ms latency, 16384 B bodies", out), out
    for loader in (
        "torch_spdl.DataLoader (num_workers=2, io_workers=64)",
        "torch.utils.data.DataLoader (num_workers=2)",
    ):
        assert re.search(rf"{re.escape(loader)}: 64 samples in [\d.]+ s = [\d.]+ samples/s", out)
    assert re.search(r"speed-up: torch_spdl / torch = [\d.]+x", out), out
    assert "OK: both loaders saw each of the 64 items exactly once, with the right bytes" in out
