"""Samples behind HTTP: the loopback server's process, a minimal async client, and the dataset.

:class:`HttpItems` has an ``async def load``: ``torch_spdl.DataLoader`` runs it on one event loop
with up to ``io_workers`` requests outstanding, while ``torch.utils.data.DataLoader``'s workers
call the inherited ``__getitem__``, which runs one request to completion with ``asyncio.run``.
So torch has one request in flight per worker process, and needs as many processes as it wants
concurrent requests. The server is :mod:`torch_spdl.bench.server`, run in a process of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import select
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

import torch_spdl

from .server import BODY_BYTES, HOST, item_body

REQUEST_TIMEOUT_S = 30.0  # per request: a stuck server fails the run instead of hanging it
START_TIMEOUT_S = 30.0
SERVER_SCRIPT = Path(__file__).with_name("server.py")

__all__ = [
    "BODY_BYTES",
    "HOST",
    "HttpBatchItems",
    "HttpItems",
    "RunningServer",
    "http_get",
    "http_server",
]


@dataclass(frozen=True)
class RunningServer:
    port: int
    pid: int  # to leave it out of memory measurements


@contextlib.contextmanager
def http_server(latency_ms: float) -> Iterator[RunningServer]:
    """Run the item server (``python -I server.py``) for the ``with`` block.

    The process is terminated and waited for in ``finally``, so neither an error in the loaders
    nor Ctrl-C leaves a server behind. ``-I`` keeps the user's environment (``PYTHONPATH``, site
    packages) out of it: it needs only the standard library.
    """
    command = [sys.executable, "-I", str(SERVER_SCRIPT), "--latency", str(latency_ms)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
    stdout = process.stdout
    assert stdout is not None  # stdout=PIPE
    try:
        ready, _, _ = select.select([stdout], [], [], START_TIMEOUT_S)
        line = stdout.readline() if ready else b""
        if not line.strip().isdigit():
            raise RuntimeError(
                f"the HTTP server did not report its port within {START_TIMEOUT_S:g} s "
                f"(exit status {process.poll()}, output {line!r})"
            )
        yield RunningServer(port=int(line), pid=process.pid)
    finally:
        process.terminate()
        try:
            process.wait(5)
        except subprocess.TimeoutExpired:  # SIGTERM ignored or stuck: make sure it goes
            process.kill()
            process.wait()
        stdout.close()


async def http_get(host: str, port: int, path: str) -> bytes:
    """A minimal HTTP/1.1 GET: one request per connection, body read by ``Content-Length``.

    ``Connection: close`` keeps it simple (no connection pool, no chunked encoding to parse); a
    real client would reuse connections. Raises ``OSError`` on a non-200 answer or a short body.
    """
    reader, writer = await asyncio.open_connection(host, port)
    try:
        request = f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n\r\n"
        writer.write(request.encode("ascii"))
        await writer.drain()
        status = (await reader.readline()).decode("latin-1").split(maxsplit=2)
        if len(status) < 2 or not status[0].startswith("HTTP/1.") or status[1] != "200":
            raise OSError(f"GET {path}: unexpected status line {status!r}")
        length = None
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            if name.strip().lower() == "content-length":
                length = int(value.strip())
        if length is None:
            raise OSError(f"GET {path}: no Content-Length in the response")
        try:
            return await reader.readexactly(length)
        except asyncio.IncompleteReadError as err:
            raise OSError(f"GET {path}: body cut short at {len(err.partial)}/{length}") from err
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


class HttpItems(torch_spdl.StagedDataset):
    """``num_items`` samples behind ``http://host:port/item/<i>``.

    The dataset holds only the address, so it is cheap to hand to worker processes.
    """

    def __init__(self, host: str, port: int, num_items: int) -> None:
        self.host, self.port, self.num_items = host, port, num_items

    def __len__(self) -> int:
        return self.num_items

    async def load(self, index: int) -> tuple[int, bytes]:
        """Fetch and verify one item; the index travels along so the batch says what it holds."""
        body = await asyncio.wait_for(
            http_get(self.host, self.port, f"/item/{index}"), REQUEST_TIMEOUT_S
        )
        return verified(index, body)

    def preprocess(self, raw: tuple[int, bytes]) -> tuple[int, torch.Tensor]:
        """Bytes → uint8 tensor. ``bytearray`` because ``torch.frombuffer`` warns on read-only
        buffers; the copy is also what lets the tensor outlive the response object."""
        index, body = raw
        return index, torch.frombuffer(bytearray(body), dtype=torch.uint8)


class HttpBatchItems(HttpItems):
    """:class:`HttpItems` whose ``load_many`` fetches many items in one request
    (``/items/<i>,<j>,...``): ``torch_spdl.DataLoader`` loads each batch with one request."""

    async def load_many(self, indices: list[int]) -> list[tuple[int, bytes]]:
        path = "/items/" + ",".join(map(str, indices))
        body = await asyncio.wait_for(http_get(self.host, self.port, path), REQUEST_TIMEOUT_S)
        if len(body) != BODY_BYTES * len(indices):
            raise ValueError(f"{path}: {len(body)} bytes for {len(indices)} items")
        parts = (body[i * BODY_BYTES : (i + 1) * BODY_BYTES] for i in range(len(indices)))
        return [verified(index, part) for index, part in zip(indices, parts, strict=True)]


def verified(index: int, body: bytes) -> tuple[int, bytes]:
    """``(index, body)`` if ``body`` is item ``index``'s."""
    if body != item_body(index):
        raise ValueError(f"item {index}: wrong body ({len(body)} bytes)")
    return index, body
