"""A JPEG's marker structure, read without decoding a pixel: its size, and whether a decoder
will take it.

A batch of JPEGs decoded in one call on the GPU fails as a whole when one of them cannot be
decoded, and by then the batch is collated: the one bad file can no longer be left out alone.
So :class:`~torch_spdl.io.RandomResizedCrop` with ``decode_on`` checks each file in ``preprocess``
(:func:`check_jpeg`), where a failure is its sample's, named by dataset index and within
``max_failures``. The check walks the markers as libjpeg reads them and refuses what libjpeg
refuses before it decodes a block:

- a marker no decoder knows, a segment that runs past the end, no end-of-image marker after the
  last scan (the file cut short);
- a frame that is not 8-bit, empty, hierarchical, or whose components are malformed, or a second
  frame;
- a Huffman table whose index, size or code lengths are impossible; a quantisation table whose
  index or size is wrong; a scan of 0 or more than 4 components, or of a component the frame
  lacks; a restart interval of the wrong length.

What it cannot see is a wrong code inside the entropy-coded data: libjpeg-turbo decodes past
those (grey or garbled blocks, a warning), and an image the GPU decoder refuses for that or any
other reason is decoded on the CPU instead (:mod:`torch_spdl.io.device_decode`).

The walk costs tens of microseconds per image: Python over a dozen segments, and one vectorised
search for the markers that end each scan.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

_SOI, _EOI, _SOS, _DHT, _DQT, _DRI, _DAC = 0xD8, 0xD9, 0xDA, 0xC4, 0xDB, 0xDD, 0xCC
_FRAMES = frozenset({0xC0, 0xC1, 0xC2, 0xC3, 0xC9, 0xCA, 0xCB})  # sequential, progressive, lossless
_UNREAD = frozenset({0xC5, 0xC6, 0xC7, 0xC8, 0xCD, 0xCE, 0xCF})  # hierarchical, reserved: unread
_STANDALONE = frozenset({*range(0xD0, 0xD8), 0x01})  # restarts and TEM: no length follows
_KNOWN = frozenset({*range(0xC0, 0xDE), *range(0xE0, 0xF0), 0xFE, 0x01})
_TRUNCATED = "is truncated: no end marker after its scan"

Segment = tuple[int, int, int]  # marker, offset of its payload, payload length


def jpeg_dimensions(encoded: torch.Tensor) -> tuple[int, int] | None:
    """``(height, width)`` from a JPEG's start-of-frame segment, or ``None`` if not found.

    Walks the marker segments before the scan data; nothing is decoded.
    """
    data = encoded.numpy()
    buf = data.data  # a memoryview: indexing it gives ints, fast
    try:
        for marker, start, length in _segments(data):
            if marker in _FRAMES or marker in _UNREAD:
                if length < 5:
                    return None
                return buf[start + 1] << 8 | buf[start + 2], buf[start + 3] << 8 | buf[start + 4]
            if marker in (_SOS, _EOI):
                return None
    except ValueError:
        return None
    return None


def check_jpeg(encoded: torch.Tensor) -> None:
    """Raise ``ValueError`` naming what is wrong if libjpeg would refuse the JPEG ``encoded``
    before decoding its data (see the module); return quietly otherwise."""
    data = encoded.numpy()
    try:
        _check(data)
    except ValueError as error:
        raise ValueError(f"the JPEG ({len(data)} bytes) {error}") from None


def _check(data: np.ndarray) -> None:
    buf = data.data
    components: set[int] | None = None  # the frame's component ids, once its header is read
    scans = 0
    for marker, start, length in _segments(data):
        body = buf[start : start + length]
        if marker in _FRAMES:
            if components is not None:
                raise ValueError("has a second frame header")
            components = _frame(body)
        elif marker in _UNREAD:
            raise ValueError(f"has a frame type (marker 0xFF{marker:02X}) no decoder here reads")
        elif marker == _DHT:
            _huffman_tables(body)
        elif marker == _DQT:
            _quantisation_tables(body)
        elif marker == _DRI and length != 2:
            raise ValueError(f"has a restart interval segment of {length} bytes, not 2")
        elif marker == _SOS:
            if components is None:
                raise ValueError("has a scan before its frame header")
            _scan(body, components)
            scans += 1
        elif marker == _EOI:
            if not scans:
                raise ValueError("has no scan")
            return


def _segments(data: np.ndarray) -> Iterator[Segment]:
    """The file's segments in order, as libjpeg reads them, up to and including the end of
    image; a scan's entropy-coded data is skipped up to the marker that ends it. Raises
    ``ValueError`` where the structure breaks."""
    buf, size = data.data, len(data)
    if size < 4 or buf[0] != 0xFF or buf[1] != _SOI:
        raise ValueError("does not start with a start-of-image marker")
    pos = 2
    ends: np.ndarray | None = None  # positions of the markers that can end a scan
    while True:
        found = _next_marker(data, pos)
        if found is None:
            raise ValueError(_TRUNCATED if ends is not None else "is truncated in its header")
        pos = found
        marker = buf[pos]
        if marker not in _KNOWN:
            raise ValueError(f"has an unknown marker 0xFF{marker:02X} at byte {pos - 1}")
        pos += 1
        if marker == _EOI:
            yield marker, pos, 0
            return
        if marker in _STANDALONE:
            continue
        if pos + 2 > size:
            raise ValueError(_TRUNCATED if ends is not None else "is truncated in its header")
        length = buf[pos] << 8 | buf[pos + 1]
        if length < 2 or pos + length > size:
            raise ValueError(
                f"has a segment (marker 0xFF{marker:02X} at byte {pos - 2}) of {length} bytes "
                f"that runs past its end"
            )
        yield marker, pos + 2, length - 2
        pos += length
        if marker == _SOS:
            ends = _scan_ends(data, pos) if ends is None else ends
            following = int(np.searchsorted(ends, pos))
            if following == len(ends):
                raise ValueError(_TRUNCATED)
            pos = int(ends[following])


def _next_marker(data: np.ndarray, pos: int) -> int | None:
    """The position of the next marker's code (the byte after its 0xFF), fill bytes and any
    bytes before the 0xFF skipped as libjpeg skips them (with a warning); None at the end."""
    buf, size = data.data, len(data)
    while pos + 1 < size:
        if buf[pos] != 0xFF:
            found = np.flatnonzero(data[pos:] == 0xFF)  # junk: rare, so searched, not walked
            if not len(found):
                break
            pos += int(found[0])
        elif buf[pos + 1] == 0xFF:  # a fill byte
            pos += 1
        elif buf[pos + 1] == 0x00:  # a stuffed zero outside a scan: junk too
            pos += 2
        else:
            return pos + 1
    return None


def _scan_ends(data: np.ndarray, start: int) -> np.ndarray:
    """Positions (of the 0xFF) of every marker from ``start`` on that ends entropy-coded data:
    0xFF followed by anything but a stuffed zero, a fill byte or a restart marker."""
    tail = data[start:]
    ff = np.flatnonzero(tail[:-1] == 0xFF)
    following = tail[ff + 1]
    ends = (following != 0x00) & (following != 0xFF) & ((following < 0xD0) | (following > 0xD7))
    return ff[ends] + start


def _frame(body: memoryview) -> set[int]:
    """Check a frame header; its component ids."""
    if len(body) < 6 or len(body) != 6 + 3 * body[5]:
        raise ValueError(f"has a frame header of {len(body)} bytes, wrong for its components")
    precision, height, width = body[0], body[1] << 8 | body[2], body[3] << 8 | body[4]
    if precision != 8:
        raise ValueError(f"has {precision}-bit samples; the decoders here read 8-bit JPEGs")
    if not height or not width or not body[5]:
        raise ValueError(f"has an empty frame: {height}×{width} pixels, {body[5]} components")
    ids = set()
    for offset in range(6, len(body), 3):
        ident, sampling, table = body[offset], body[offset + 1], body[offset + 2]
        if not (1 <= sampling >> 4 <= 4 and 1 <= sampling & 15 <= 4) or table > 3:
            raise ValueError(f"has a malformed frame component (id {ident})")
        ids.add(ident)
    return ids


def _huffman_tables(body: memoryview) -> None:
    """Check a DHT segment: each table's class and index, its size, and that its code lengths
    make a prefix code (the all-ones code of each length is reserved)."""
    pos = 0
    while pos < len(body):
        if pos + 17 > len(body) or body[pos] >> 4 > 1 or body[pos] & 15 > 3:
            raise ValueError("has a malformed Huffman table")
        counts = body[pos + 1 : pos + 17]
        if sum(counts) > 256:
            raise ValueError(f"has a Huffman table of {sum(counts)} codes (at most 256)")
        code = 0
        for bits, count in enumerate(counts, start=1):
            code += count
            if code >= 1 << bits:
                raise ValueError("has a Huffman table with more codes than its lengths allow")
            code <<= 1
        pos += 17 + sum(counts)
    if pos != len(body):
        raise ValueError("has a Huffman table that runs past its segment")


def _quantisation_tables(body: memoryview) -> None:
    """Check a DQT segment: each table's index and size."""
    pos = 0
    while pos < len(body):
        if body[pos] & 15 > 3:
            raise ValueError(f"has a quantisation table with index {body[pos] & 15} (at most 3)")
        pos += 1 + 64 * (2 if body[pos] >> 4 else 1)
    if pos != len(body):
        raise ValueError("has a quantisation table that runs past its segment")


def _scan(body: memoryview, components: set[int]) -> None:
    """Check a scan header: 1 to 4 components, each one of the frame's."""
    count = body[0] if len(body) else 0
    if not 1 <= count <= 4 or len(body) != 4 + 2 * count:
        raise ValueError(f"has a malformed scan header ({count} components, {len(body)} bytes)")
    for offset in range(1, 1 + 2 * count, 2):
        if body[offset] not in components:
            raise ValueError(f"has a scan of component {body[offset]}, which its frame lacks")


__all__ = ["check_jpeg", "jpeg_dimensions"]
