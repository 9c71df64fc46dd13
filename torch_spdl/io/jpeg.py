"""A JPEG's marker structure, read without decoding a pixel: its size, and whether a decoder
will take it.

A batch of JPEGs decoded in one call on the GPU fails as a whole when one of them cannot be
decoded, and by then the batch is collated: the one bad file can no longer be left out alone.
So :class:`~torch_spdl.io.RandomResizedCrop` with ``decode_on`` checks each file in ``preprocess``
(:func:`check_jpeg`), where a failure is its sample's, named by dataset index and within
``max_failures``. The check walks the markers as libjpeg reads them and refuses what libjpeg
refuses before it decodes a block:

- a marker no decoder knows (in a scan with restarts, only one from 0xC0 up: libjpeg's
  resynchronisation skips the others), a segment that runs past the end, no end-of-image marker
  after the last scan (the file cut short);
- a frame that is not 8-bit, empty, hierarchical, or whose components are malformed or sampled
  in fractions libjpeg cannot upsample, or a second frame;
- a Huffman or quantisation table whose index or size is impossible;
- a scan of 0 or more than 4 components, of a component the frame lacks, of more than 10 blocks
  per MCU, or whose quantisation or Huffman tables are missing (a sequential scan has libjpeg's
  standard Huffman tables 0 and 1, as motion JPEG needs) or cannot decode (code lengths that
  make no prefix code, DC symbols that are not sizes), or a progressive scan's impossible band
  or bits; a restart interval of the wrong length.

On 600 randomly damaged JPEGs (``test_the_jpeg_check_agrees_with_the_decoder_on_damaged_files``)
it refuses no file libjpeg-turbo decodes, and passes next to none of those it cannot.
What it cannot see is a wrong code inside the entropy-coded data: libjpeg-turbo decodes past
those (grey or garbled blocks, a warning), and an image the GPU decoder refuses for that or any
other reason is decoded on the CPU instead (:mod:`torch_spdl.io.device_decode`).

The walk costs tens of microseconds per image: Python over a dozen segments, and one vectorised
search for the markers that end each scan.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

_SOI, _EOI, _SOS, _DHT, _DQT, _DRI, _DAC = 0xD8, 0xD9, 0xDA, 0xC4, 0xDB, 0xDD, 0xCC
_FRAMES = frozenset({0xC0, 0xC1, 0xC2, 0xC3, 0xC9, 0xCA, 0xCB})  # sequential, progressive, lossless
_PROGRESSIVE = frozenset({0xC2, 0xCA})
_ARITHMETIC = frozenset({0xC9, 0xCA, 0xCB})  # coded without Huffman tables
_UNREAD = frozenset({0xC5, 0xC6, 0xC7, 0xC8, 0xCD, 0xCE, 0xCF})  # hierarchical, reserved: unread
_STANDALONE = frozenset({*range(0xD0, 0xD8), 0x01})  # restarts and TEM: no length follows
_KNOWN = frozenset({*range(0xC0, 0xDE), *range(0xE0, 0xF0), 0xFE, 0x01})
_TRUNCATED = "is truncated: no end marker after its scan"

Segment = tuple[int, int, int]  # marker, offset of its payload, payload length
MAX_BLOCKS_IN_MCU = 10  # libjpeg's limit on an interleaved scan's blocks per MCU
Encoded = torch.Tensor | np.ndarray  # a 1-D uint8 tensor, or a NumPy array of the bytes


def as_array(encoded: Encoded) -> np.ndarray:
    """The bytes as a NumPy array: ``encoded`` itself, or the tensor's view.

    Headers are read through NumPy, not torch: every torch call (``Tensor.numpy()`` and slicing
    among them) lets the GIL go and takes it back, and where other threads wait for the GIL each
    is a hand-off. So a caller reading several headers of one image makes the array once.
    """
    return encoded if isinstance(encoded, np.ndarray) else encoded.numpy()


@dataclass(frozen=True)
class Component:
    """A frame component: its sampling factors and its quantisation table."""

    h: int
    v: int
    table: int


def jpeg_dimensions(encoded: Encoded) -> tuple[int, int] | None:
    """``(height, width)`` from a JPEG's start-of-frame segment, or ``None`` if not found.

    Walks the marker segments before the scan data; nothing is decoded.
    """
    header = _frame_header(as_array(encoded))
    if header is None:
        return None
    _, body, _ = header
    return _size(body) if len(body) >= 5 else None


def plain_rgb_size(encoded: Encoded) -> tuple[int, int] | None:
    """``(height, width)`` of a JPEG that every libjpeg-based decoder turns into the same RGB
    pixels: three components (YCbCr), no ICC profile (a decoder may apply it, or not) and no
    Adobe marker (its colour transform is each decoder's to read); None for any other file."""
    header = _frame_header(as_array(encoded))
    if header is None:
        return None
    marker, body, colour_marked = header
    plain = marker in _FRAMES and not colour_marked and len(body) == 6 + 3 * 3 and body[5] == 3
    return _size(body) if plain else None


_APP2, _APP14 = 0xE2, 0xEE
_ICC, _ADOBE = b"ICC_PROFILE\x00", b"Adobe"


def _frame_header(data: np.ndarray) -> tuple[int, memoryview, bool] | None:
    """The first frame header's marker and body, and whether an ICC profile or an Adobe marker
    came before it; None where the image's data or end comes first, or the structure breaks."""
    buf, colour_marked = data.data, False
    try:
        for marker, start, length in _segments(data):
            body = buf[start : start + length]
            if marker in _FRAMES or marker in _UNREAD:
                return marker, body, colour_marked
            if marker in (_SOS, _EOI):
                return None
            colour_marked |= (marker == _APP2 and body[: len(_ICC)] == _ICC) or (
                marker == _APP14 and body[: len(_ADOBE)] == _ADOBE
            )
    except ValueError:
        return None
    return None


def check_jpeg(encoded: Encoded) -> None:
    """Raise ``ValueError`` naming what is wrong if libjpeg would refuse the JPEG ``encoded``
    before decoding its data (see the module); return quietly otherwise."""
    data = as_array(encoded)
    try:
        _check(data)
    except ValueError as error:
        raise ValueError(f"the JPEG ({len(data)} bytes) {error}") from None


@dataclass
class _Defined:
    """What the file has defined so far, as libjpeg holds it when a scan starts."""

    frame: dict[int, Component] | None = None  # by component id
    progressive: bool = False
    arithmetic: bool = False
    quantisation: set[int] = field(default_factory=set)
    # (0 DC / 1 AC, index) -> why the table cannot decode (libjpeg checks it when a scan uses
    # it), or "" where it can
    huffman: dict[tuple[int, int], str] = field(default_factory=dict)


def _check(data: np.ndarray) -> None:
    buf = data.data
    defined, scans = _Defined(), 0
    for marker, start, length in _segments(data):
        body = buf[start : start + length]
        if marker in _FRAMES:
            if defined.frame is not None:
                raise ValueError("has a second frame header")
            defined.frame = _frame(body)
            defined.progressive = marker in _PROGRESSIVE
            defined.arithmetic = marker in _ARITHMETIC
        elif marker in _UNREAD:
            raise ValueError(f"has a frame type (marker 0xFF{marker:02X}) no decoder here reads")
        elif marker == _DHT:
            defined.huffman.update(_huffman_tables(body))
        elif marker == _DQT:
            defined.quantisation |= _quantisation_tables(body)
        elif marker == _DRI and length != 2:
            raise ValueError(f"has a restart interval segment of {length} bytes, not 2")
        elif marker == _SOS:
            _scan(body, defined)
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
    ends: dict[bool, np.ndarray] = {}  # markers that can end a scan, with restarts or without
    restarts = False  # a restart interval is set: libjpeg skips invalid markers in a scan
    while True:
        found = _next_marker(data, pos)
        if found is None:
            raise ValueError(_TRUNCATED if ends else "is truncated in its header")
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
            raise ValueError(_TRUNCATED if ends else "is truncated in its header")
        length = buf[pos] << 8 | buf[pos + 1]
        if length < 2 or pos + length > size:
            raise ValueError(
                f"has a segment (marker 0xFF{marker:02X} at byte {pos - 2}) of {length} bytes "
                f"that runs past its end"
            )
        yield marker, pos + 2, length - 2
        if marker == _DRI and length == 4:
            restarts = (buf[pos + 2] << 8 | buf[pos + 3]) > 0
        pos += length
        if marker == _SOS:
            if restarts not in ends:
                ends[restarts] = _scan_ends(data, pos, restarts)
            following = int(np.searchsorted(ends[restarts], pos))
            if following == len(ends[restarts]):
                raise ValueError(_TRUNCATED)
            pos = int(ends[restarts][following])


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


def _scan_ends(data: np.ndarray, start: int, restarts: bool) -> np.ndarray:
    """Positions (of the 0xFF) of every marker from ``start`` on that ends entropy-coded data:
    0xFF followed by anything but a stuffed zero, a fill byte or a restart marker. With a restart
    interval, libjpeg's resynchronisation skips invalid markers (below 0xC0) too."""
    tail = data[start:]
    ff = np.flatnonzero(tail[:-1] == 0xFF)
    following = tail[ff + 1]
    lowest = 0xC0 if restarts else 0x01
    ends = (following >= lowest) & (following != 0xFF) & ((following < 0xD0) | (following > 0xD7))
    return ff[ends] + start


def _size(frame: memoryview) -> tuple[int, int]:
    """``(height, width)`` from a frame header's body."""
    return frame[1] << 8 | frame[2], frame[3] << 8 | frame[4]


def _frame(body: memoryview) -> dict[int, Component]:
    """Check a frame header; its components, by id."""
    if len(body) < 6 or len(body) != 6 + 3 * body[5]:
        raise ValueError(f"has a frame header of {len(body)} bytes, wrong for its components")
    precision, (height, width) = body[0], _size(body)
    if precision != 8:
        raise ValueError(f"has {precision}-bit samples; the decoders here read 8-bit JPEGs")
    if not height or not width or not body[5]:
        raise ValueError(f"has an empty frame: {height}×{width} pixels, {body[5]} components")
    components = {}
    for offset in range(6, len(body), 3):
        ident, sampling, table = body[offset], body[offset + 1], body[offset + 2]
        if not (1 <= sampling >> 4 <= 4 and 1 <= sampling & 15 <= 4) or table > 3:
            raise ValueError(f"has a malformed frame component (id {ident})")
        components[ident] = Component(sampling >> 4, sampling & 15, table)
    widest = max(c.h for c in components.values())
    tallest = max(c.v for c in components.values())
    if any(widest % c.h or tallest % c.v for c in components.values()):
        raise ValueError(
            "has sampling factors that do not divide the largest (libjpeg's upsampling needs that)"
        )
    return components


def _huffman_tables(body: memoryview) -> dict[tuple[int, int], str]:
    """Check a DHT segment: each table's class, index and size; the tables it defines, each
    with what is wrong with it for decoding, or "": code lengths that make no prefix code (the
    all-ones code of each length is reserved), or a DC table whose symbols are not sizes (0 to
    15). libjpeg checks those when a scan uses the table, so an unused one does no harm."""
    pos, tables = 0, {}
    while pos < len(body):
        if pos + 17 > len(body) or body[pos] >> 4 > 1 or body[pos] & 15 > 3:
            raise ValueError("has a malformed Huffman table")
        counts = body[pos + 1 : pos + 17]
        symbols = sum(counts)
        if symbols > 256 or pos + 17 + symbols > len(body):
            raise ValueError(f"has a Huffman table of {symbols} codes that does not fit")
        kind, wrong, code = body[pos] >> 4, "", 0
        for bits, count in enumerate(counts, start=1):
            code += count
            if code >= 1 << bits:
                wrong = "has more codes than its lengths allow"
            code <<= 1
        if kind == 0 and max(body[pos + 17 : pos + 17 + symbols], default=0) > 15:
            wrong = "has symbols that are not sizes (0 to 15)"
        tables[kind, body[pos] & 15] = wrong
        pos += 17 + symbols
    if pos != len(body):
        raise ValueError("has a Huffman table that runs past its segment")
    return tables


def _quantisation_tables(body: memoryview) -> set[int]:
    """Check a DQT segment: each table's index and size; the tables it defines."""
    pos, tables = 0, set()
    while pos < len(body):
        if body[pos] & 15 > 3:
            raise ValueError(f"has a quantisation table with index {body[pos] & 15} (at most 3)")
        tables.add(body[pos] & 15)
        pos += 1 + 64 * (2 if body[pos] >> 4 else 1)
    if pos != len(body):
        raise ValueError("has a quantisation table that runs past its segment")
    return tables


def _scan(body: memoryview, defined: _Defined) -> None:
    """Check a scan header against what is defined when it starts: 1 to 4 of the frame's
    components, their quantisation tables, the Huffman tables the scan decodes with, and a
    progressive scan's band and bit positions."""
    if defined.frame is None:
        raise ValueError("has a scan before its frame header")
    count = body[0] if len(body) else 0
    if not 1 <= count <= 4 or len(body) != 4 + 2 * count:
        raise ValueError(f"has a malformed scan header ({count} components, {len(body)} bytes)")
    first, last, bits = body[1 + 2 * count], body[2 + 2 * count], body[3 + 2 * count]
    high, low = bits >> 4, bits & 15
    if defined.progressive and (
        (first == 0 and last != 0)
        or (first > 0 and (first > last or last > 63 or count != 1))
        or (high != 0 and low != high - 1)
        or low > 13
    ):
        raise ValueError(f"has a progressive scan of band {first}-{last}, bits {high}/{low}")
    blocks = 0
    for offset in range(1, 1 + 2 * count, 2):
        ident, dc, ac = body[offset], body[offset + 1] >> 4, body[offset + 1] & 15
        component = defined.frame.get(ident)
        if component is None:
            raise ValueError(f"has a scan of component {ident}, which its frame lacks")
        if component.table not in defined.quantisation:
            raise ValueError(f"has no quantisation table {component.table} for its scan")
        blocks += component.h * component.v
        if defined.arithmetic:
            continue  # its tables are conditioning values, which libjpeg defaults
        for kind, index in _huffman_used(defined.progressive, first, high, dc, ac):
            _check_huffman(defined, kind, index)
    if count > 1 and blocks > MAX_BLOCKS_IN_MCU:
        raise ValueError(f"has a scan of {blocks} blocks per MCU (at most {MAX_BLOCKS_IN_MCU})")


def _check_huffman(defined: _Defined, kind: int, index: int) -> None:
    """That the Huffman table a scan uses is there and decodes; a sequential scan falls back to
    the standard tables 0 and 1 (motion JPEG has none of its own)."""
    name = f"{('DC', 'AC')[kind]} Huffman table {index}"
    wrong = defined.huffman.get((kind, index))
    if wrong:
        raise ValueError(f"decodes a scan with {name}, which {wrong}")
    if wrong is None and (index > 1 or defined.progressive):
        raise ValueError(f"has no {name} for its scan")


def _huffman_used(
    progressive: bool, first: int, high: int, dc: int, ac: int
) -> list[tuple[int, int]]:
    """The Huffman tables a scan decodes with: a sequential scan both; a progressive one its
    band's (a DC refinement scan none)."""
    if not progressive:
        return [(0, dc), (1, ac)]
    if first == 0:
        return [(0, dc)] if high == 0 else []
    return [(1, ac)]


__all__ = ["check_jpeg", "jpeg_dimensions"]
