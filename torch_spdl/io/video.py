"""Video → uint8 ``T×C×H×W`` RGB clip with PyAV, for a dataset's ``preprocess`` hook.

PyAV releases the GIL while FFmpeg demuxes, decodes and converts, so clips decode in parallel on
the loader's worker threads. Each call therefore uses one decoder thread by default: FFmpeg's own
threads (``threads=0`` or ``> 1``) multiply with the loader's workers and, in a pool that already
keeps every core busy, mostly add contention (torchcodec defaults to one FFmpeg thread for the same
reason).

Only the selected frames are converted to RGB, and colour conversion and resizing happen in one
swscale pass straight from the decoder's YUV planes, at the output size.
"""

from __future__ import annotations

import io
import math
import os
from collections.abc import Iterator
from typing import BinaryIO, Literal

import av
import av.error
import torch

from .resize import Size, output_size

VideoSource = str | os.PathLike | bytes | bytearray | memoryview | BinaryIO
Sampling = Literal["even", "consecutive"]


def decode_video(
    source: VideoSource,
    *,
    num_frames: int,
    size: Size | None = None,
    start: float = 0.0,
    sampling: Sampling = "even",
    threads: int = 1,
) -> torch.Tensor:
    """Decode ``num_frames`` frames of the first video stream into a uint8 ``T×3×H×W`` tensor.

    ``sampling="even"`` spreads the frames over the video from ``start`` (seconds from the
    stream's beginning) to its end, at frame indices ``torch.linspace(0, n - 1, num_frames)``
    truncated (PyTorchVideo's ``UniformTemporalSubsample``), so a video shorter than
    ``num_frames`` repeats frames. ``sampling="consecutive"`` takes the first ``num_frames``
    frames at or after ``start`` and raises if there are fewer.

    ``size`` (an int for the shorter edge, or ``(height, width)``) is applied by swscale's
    bilinear filter during the RGB conversion, which widens for downscaling; it is close to, not
    equal to, :func:`~torch_spdl.io.resize` of the full-size frame. ``source`` is a path, the
    file's bytes, or a binary file object; ``start > 0``, and even sampling of a container that
    does not record its frame count (WebM, MKV), need a seekable source. Unreadable data and a
    file without a video stream raise ``ValueError``; a missing path ``FileNotFoundError``.
    """
    _check_arguments(num_frames, start, sampling, threads)
    try:
        with _open(source) as container:
            stream = _video_stream(container, source)
            if threads != 1:
                stream.thread_type = "AUTO"
            stream.codec_context.thread_count = threads
            start_pts = _start_pts(stream, start)
            if sampling == "even":
                indices = _even_indices(_count_frames(container, stream, start_pts), num_frames)
            else:
                indices = list(range(num_frames))
                if start_pts is not None:
                    _seek(container, stream, start_pts)
            clip = _Clip(indices, size)
            clip.take(_frames_from(container, stream, start_pts))
            return _finish(clip, sampling, source, start)
    except av.error.FFmpegError as err:
        if isinstance(err, OSError):
            raise
        raise ValueError(f"cannot decode {_describe(source)}: {err}") from err


def _check_arguments(num_frames: int, start: float, sampling: str, threads: int) -> None:
    if not isinstance(num_frames, int) or num_frames <= 0:
        raise ValueError(f"num_frames must be a positive int, got {num_frames!r}")
    if not start >= 0:
        raise ValueError(f"start must be >= 0 seconds, got {start!r}")
    if sampling not in ("even", "consecutive"):
        raise ValueError(f"sampling must be 'even' or 'consecutive', got {sampling!r}")
    if not isinstance(threads, int) or threads < 0:
        raise ValueError(f"threads must be an int >= 0 (0: FFmpeg chooses), got {threads!r}")


def _open(source: VideoSource) -> av.container.InputContainer:
    if isinstance(source, (bytes, bytearray, memoryview)):
        if len(source) == 0:
            raise ValueError("cannot decode a video from empty data")
        source = io.BytesIO(source)
    elif isinstance(source, os.PathLike):
        source = os.fspath(source)
    return av.open(source, mode="r")


def _describe(source: VideoSource) -> str:
    """How error messages name the source: its path, its size, or its file name."""
    if isinstance(source, (str, os.PathLike)):
        return f"video {os.fspath(source)!r}"
    if isinstance(source, (bytes, bytearray, memoryview)):
        return f"video data ({len(source)} bytes)"
    return f"video file {getattr(source, 'name', type(source).__name__)!r}"


def _video_stream(container: av.container.InputContainer, source: VideoSource) -> av.VideoStream:
    if not container.streams.video:
        kinds = ", ".join(stream.type for stream in container.streams) or "none"
        raise ValueError(f"no video stream in {_describe(source)} (its streams: {kinds})")
    return container.streams.video[0]


def _start_pts(stream: av.VideoStream, start: float) -> int | None:
    """``start`` in the stream's timestamps (``None``: from the first frame, no seek)."""
    if start == 0:
        return None
    first = stream.start_time or 0
    time_base = stream.time_base
    assert time_base is not None  # libavformat gives every stream one (1/90000 by default)
    return first + math.ceil(start / float(time_base) - 1e-6)


def _seek(container: av.container.InputContainer, stream: av.VideoStream, pts: int | None) -> None:
    """To the keyframe at or before ``pts`` (``None``: the stream's beginning).

    Some demuxers (MPEG-TS) land on a packet after the target, or on one that is not a
    keyframe, from which nothing decodes until the next keyframe: frames would be skipped. The
    seek then aims a second earlier, then twice as far each time, until the first packet it
    reads is a keyframe at or before the target, or it aims a second before the stream."""
    first = stream.start_time or 0
    target = first if pts is None else pts
    assert stream.time_base is not None  # as in _start_pts
    second = max(1, round(1 / float(stream.time_base)))
    back = 0
    while True:
        container.seek(target - back, stream=stream)
        landed = _first_keyframe_pts(container, stream)
        if (landed is not None and landed <= target) or target - back < first - second:
            break
        back = back * 2 or second
    container.seek(target - back, stream=stream)  # again: reading the first packet moved on


def _first_keyframe_pts(
    container: av.container.InputContainer, stream: av.VideoStream
) -> int | None:
    """The next packet's timestamp if it is a keyframe's (``None``: it is not, or none is left)."""
    packet = next((p for p in container.demux(stream) if p.pts is not None), None)
    return packet.pts if packet is not None and packet.is_keyframe else None


def _count_frames(
    container: av.container.InputContainer, stream: av.VideoStream, start_pts: int | None
) -> int:
    """Frames from ``start_pts`` on: the header's count when it covers them, else packets counted.

    Counting demuxes without decoding (one packet per video frame), so it costs a read of the
    file, not a decode. Either way the demuxer is left where decoding must begin.
    """
    if start_pts is None and stream.frames > 0:
        return stream.frames
    _seek(container, stream, start_pts)
    count = sum(
        1
        for packet in container.demux(stream)
        if packet.size > 0 and (start_pts is None or packet.pts is None or packet.pts >= start_pts)
    )
    _seek(container, stream, start_pts)
    return count


def _even_indices(count: int, num_frames: int) -> list[int]:
    if count == 0:
        return [0] * num_frames  # nothing to spread over: _finish reports the empty video
    return torch.linspace(0, count - 1, num_frames).long().tolist()


def _finish(clip: _Clip, sampling: Sampling, source: VideoSource, start: float) -> torch.Tensor:
    """The clip, once every slot is filled; the stream ending early is an error only where the
    caller asked for consecutive frames."""
    if clip.last is None:
        raise ValueError(f"no video frames at or after start={start}s in {_describe(source)}")
    if clip.slots and sampling == "consecutive":
        raise ValueError(
            f"{_describe(source)}: only {clip.decoded} frames at or after start={start}s, "
            f"but {clip.length} consecutive frames were asked for"
        )
    if clip.slots:
        clip.repeat_last()
    assert clip.tensor is not None
    return clip.tensor


def _frames_from(
    container: av.container.InputContainer, stream: av.VideoStream, start_pts: int | None
) -> Iterator[av.VideoFrame]:
    for frame in container.decode(stream):
        if start_pts is None or frame.pts is None or frame.pts >= start_pts:
            yield frame


class _Clip:
    """The output tensor, allocated at the first frame's output size and filled slot by slot.

    Only frames that some slot wants are converted to RGB; a frame wanted twice (even sampling of
    a short video) is converted once and copied into both slots.
    """

    def __init__(self, indices: list[int], size: Size | None) -> None:
        self.length, self.size = len(indices), size
        self.slots: dict[int, list[int]] = {}  # frame index from start → its slots in the clip
        for slot, index in enumerate(indices):
            self.slots.setdefault(index, []).append(slot)
        self.tensor: torch.Tensor | None = None
        self.last: av.VideoFrame | None = None
        self.decoded = 0

    def take(self, frames: Iterator[av.VideoFrame]) -> None:
        """Decode until every slot is filled or the stream ends."""
        for index, frame in enumerate(frames):
            self.last, self.decoded = frame, index + 1
            if index in self.slots:
                self._put(frame, self.slots.pop(index))
            if not self.slots:
                return

    def repeat_last(self) -> None:
        """Fill the slots past the end with the last frame (a count can exceed what decodes)."""
        assert self.last is not None
        self._put(self.last, [slot for slots in self.slots.values() for slot in slots])
        self.slots.clear()

    def _put(self, frame: av.VideoFrame, slots: list[int]) -> None:
        height, width = (frame.height, frame.width)
        if self.size is not None:
            height, width = output_size(height, width, self.size)
        if self.tensor is None:
            self.tensor = torch.empty((self.length, 3, height, width), dtype=torch.uint8)
        rgb = torch.from_numpy(frame.to_ndarray(format="rgb24", width=width, height=height))
        for slot in slots:
            self.tensor[slot].copy_(rgb.permute(2, 0, 1))
