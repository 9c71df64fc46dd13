"""Media made here for the tests: photo-like pixels and JPEGs in the forms a data set holds,
with the flaws libjpeg refuses."""

from __future__ import annotations

import io

import numpy as np
import torch
from PIL import Image


def photo(height: int, width: int, seed: int = 0) -> np.ndarray:
    """A smooth RGB image with some noise: realistic enough for JPEG and resampling."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width] / max(height, width)
    smooth = np.stack([255 * x, 255 * y, 128 + 100 * np.sin(8 * (x + y))], axis=-1)
    return np.clip(smooth + rng.normal(0, 12, smooth.shape), 0, 255).astype(np.uint8)


def encode(image: Image.Image, fmt: str, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


def jpeg(height: int = 375, width: int = 500, seed: int = 0, mode: str = "RGB") -> bytes:
    return encode(Image.fromarray(photo(height, width, seed)).convert(mode), "JPEG", quality=90)


def tensor_of(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _patched(data: bytes, at: bytes, new: bytes) -> bytes:
    """``data`` with the first ``at`` (a marker and what follows it) replaced by ``new``."""
    assert at in data, at
    return data.replace(at, new, 1)


def refused_jpegs() -> dict[str, tuple[bytes, str]]:
    """JPEGs libjpeg refuses before (or while) decoding, whose markers show it; what the check
    says of each."""
    good = jpeg(60, 80)
    scan = good.rindex(b"\xff\xda")
    table = good.index(b"\xff\xc4")
    frame = good.index(b"\xff\xc0")
    overfull = bytearray(good)  # two codes of length 1 (as many codes in all): one is all ones
    donor = next(i for i in range(1, 16) if overfull[table + 5 + i] >= 2)
    overfull[table + 5] += 2
    overfull[table + 5 + donor] -= 2
    twelve_bit = bytearray(good)
    twelve_bit[frame + 4] = 12
    no_table = bytearray(good)  # component 1 reads quantisation table 3, which is not there
    no_table[frame + 12] = 3
    dc_symbol = bytearray(good)  # the first table (DC 0) decodes a size of 200 bits
    assert dc_symbol[table + 4] >> 4 == 0
    dc_symbol[table + 21] = 200
    fractional = bytearray(good)  # luma 2×2, chroma 3×1: 2 does not divide 3
    fractional[frame + 11], fractional[frame + 14] = 0x22, 0x31
    progressive = encode(Image.fromarray(photo(60, 80)), "JPEG", progressive=True)
    first_scan = progressive.index(b"\xff\xda")
    band = bytearray(progressive)  # a DC scan (band 0-0) made to run to coefficient 5
    band[first_scan + 6 + 2 * band[first_scan + 4]] = 5
    return {
        "truncated": (good[:-200], "truncated: no end marker after its scan"),
        "unknown marker in its scan": (
            good[: scan + 100] + b"\xff\x3b" + good[scan + 102 :],
            "unknown marker 0xFF3B",
        ),
        "overfull Huffman table": (bytes(overfull), "more codes than its lengths allow"),
        "12-bit": (bytes(twelve_bit), "12-bit samples"),
        "quantisation index 5": (
            _patched(good, b"\xff\xdb\x00\x43\x00", b"\xff\xdb\x00\x43\x05"),
            "quantisation table with index 5",
        ),
        "scan before frame": (
            good[:frame] + good[scan:-2] + good[frame:scan] + b"\xff\xd9",
            "scan before its frame header",
        ),
        "second frame": (
            good[:scan] + good[frame : frame + 19] + good[scan:],
            "second frame header",
        ),
        "restart interval of 3 bytes": (
            good[:scan] + b"\xff\xdd\x00\x05\x00\x01\x00" + good[scan:],
            "restart interval segment of 3 bytes",
        ),
        "no quantisation table": (bytes(no_table), "no quantisation table 3"),
        "DC symbol of 200 bits": (bytes(dc_symbol), "symbols that are not sizes"),
        "fractional sampling": (bytes(fractional), "sampling factors that do not divide"),
        "progressive DC band": (bytes(band), "progressive scan of band 0-5"),
    }


def accepted_jpegs() -> dict[str, bytes]:
    """JPEGs that decode, in the forms a data set holds, and with what libjpeg skips."""
    picture = Image.fromarray(photo(45, 70))
    good = encode(picture, "JPEG")
    scan = good.rindex(b"\xff\xda")
    return {
        "baseline": good,
        "progressive": encode(picture, "JPEG", progressive=True, optimize=True),
        "grey": encode(picture.convert("L"), "JPEG"),
        "cmyk": encode(picture.convert("CMYK"), "JPEG"),
        "4:4:4": encode(picture, "JPEG", subsampling=0),
        "restart markers": encode(picture, "JPEG", restart_marker_blocks=3),
        "exif+icc": encode(
            picture, "JPEG", exif=b"Exif\x00\x00" + b"\x00" * 64, icc_profile=b"x" * 300
        ),
        "junk and fill bytes before a marker": good[:scan] + b"junk\xff\xff" + good[scan:],
        "data after the end": good + bytes(5000),
        "no Huffman tables (motion JPEG: the standard ones)": _without_huffman_tables(good),
        "an unused broken Huffman table": (
            good[:scan] + b"\xff\xc4\x00\x14\x03\x01" + bytes(15) + b"\xc8" + good[scan:]
        ),
    }


def _without_huffman_tables(data: bytes) -> bytes:
    """``data`` (a baseline JPEG) with its DHT segments left out."""
    out, pos = bytearray(data[:2]), 2
    while data[pos + 1] != 0xDA:
        length = 2 + (data[pos + 2] << 8 | data[pos + 3])
        if data[pos + 1] != 0xC4:
            out += data[pos : pos + length]
        pos += length
    return bytes(out + data[pos:])
