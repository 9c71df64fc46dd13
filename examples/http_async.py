"""Samples fetched over HTTP by an ``async def load``: many requests in flight, few threads.

When each sample sits behind a network round trip, throughput is set by how many requests are
outstanding at once, not by CPU. ``torch.utils.data.DataLoader`` has one request in flight per
worker process (each worker runs ``__getitem__``, here ``asyncio.run(load(index))``, one sample at
a time), so it needs as many processes as it wants concurrent requests. ``torch_spdl.DataLoader``
sees that ``load`` is ``async def`` and runs it on one event loop with up to ``io_workers``
requests outstanding, while ``num_workers`` threads run ``preprocess``.

The server is a stdlib ``ThreadingHTTPServer`` on 127.0.0.1 in a separate process (so its
threads do not compete with the loaders for this process's GIL); it waits ``--latency`` ms, to
stand in for a remote object store, then answers ``GET /item/<i>`` with a 16 KB body derived from
``i``. The client is a minimal HTTP/1.1 GET on ``asyncio.open_connection``, standard library
only. Every sample is checked: each item seen exactly once per loader, with the right bytes.

On a small machine the Python server itself tops out at several hundred requests per second, so
the speed-up shown is bounded by the server, not by ``io_workers``; raise ``--latency`` to see the
gap widen (torch's side scales as ``torch-workers / latency``).

Run from the repository root after ``pip install -e ".[test]"``::

    python examples/http_async.py [--items N] [--latency MS] [--io-workers K]
                                  [--num-workers W] [--torch-workers P]

Only loopback traffic, a bounded number of requests (``--items`` per loader), and the server
process is terminated and joined on exit, also when the run fails.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import multiprocessing
import multiprocessing.connection
import re
import time
import warnings
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch
import torch.utils.data

import torch_spdl

HOST = "127.0.0.1"
BODY_BYTES = 16 * 1024
BATCH_SIZE = 16
REQUEST_TIMEOUT_S = 30.0  # per request: a stuck server fails the run instead of hanging it


def item_body(index: int) -> bytes:
    """The body served for ``/item/<index>``: a digest of the index, repeated to 16 KB.

    Deterministic and different for every index, so the client (and the final check) can verify
    each response without the server having to send anything else; cheap to compute on both sides.
    """
    digest = hashlib.sha256(f"item {index}".encode()).digest()
    return (digest * (BODY_BYTES // len(digest) + 1))[:BODY_BYTES]


# -- the server (runs in its own process) --------------------------------------------------------
class ItemHandler(BaseHTTPRequestHandler):
    """``GET /item/<i>``: sleep ``latency_s``, then 200 with ``item_body(i)``; 404 otherwise."""

    protocol_version = "HTTP/1.1"  # we still send ``Connection: close`` and close after each reply
    latency_s = 0.0  # set on a subclass by :func:`serve`
    path_pattern = re.compile(r"/item/(\d+)")

    def do_GET(self) -> None:  # noqa: N802 - the name http.server dispatches to
        match = self.path_pattern.fullmatch(self.path)
        if match is None:
            self.send_error(404)
            return
        time.sleep(self.latency_s)  # the stand-in for a remote store's round trip
        body = item_body(int(match.group(1)))
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)
        self.close_connection = True

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's signature
        """Silence the per-request access log (hundreds of lines on stderr otherwise)."""


class Server(ThreadingHTTPServer):
    """ThreadingHTTPServer with a listen backlog for 64+ simultaneous connects.

    socketserver's default backlog is 5: a burst of connects beyond it can have its SYNs dropped,
    and the kernel's retry a second later would dominate every timing here.
    """

    request_queue_size = 1024
    daemon_threads = True  # a handler thread never keeps the process alive after shutdown


def serve(conn: multiprocessing.connection.Connection, latency_ms: float) -> None:
    """The server process: bind an ephemeral loopback port, send it back, serve until killed.

    Port 0 lets the kernel pick a free port, so concurrent runs (parallel tests) never collide;
    the pipe is how the parent learns which one.
    """
    handler = type("Handler", (ItemHandler,), {"latency_s": latency_ms / 1000})
    with Server((HOST, 0), handler) as server:
        conn.send(server.server_address[1])
        conn.close()
        server.serve_forever()


@contextlib.contextmanager
def http_server(latency_ms: float) -> Iterator[int]:
    """Run :func:`serve` in a child process for the ``with`` block; yield its port.

    The child is terminated and joined in ``finally``, so neither an error in the loaders nor
    Ctrl-C leaves a server behind. ``fork`` (where the platform has it) starts the child in
    milliseconds; ``spawn`` would re-import torch first. It is safe here because the server is
    started before any loader thread exists and uses only the standard library.
    """
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    receiver, sender = ctx.Pipe(duplex=False)
    process = ctx.Process(target=serve, args=(sender, latency_ms), name="http-server", daemon=True)
    process.start()
    sender.close()  # the child holds its own copy; closing ours makes recv() see its death
    try:
        if not receiver.poll(30):
            raise RuntimeError("the HTTP server did not report its port within 30 s")
        port = receiver.recv()  # EOFError if the child died before binding
        yield port
    finally:
        receiver.close()
        process.terminate()
        process.join(5)
        if process.is_alive():  # SIGTERM ignored or stuck: make sure it goes
            process.kill()
            process.join()


# -- the client ----------------------------------------------------------------------------------
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


# -- the dataset ---------------------------------------------------------------------------------
class HttpItems(torch_spdl.StagedDataset):
    """``num_items`` samples behind ``http://host:port/item/<i>``.

    ``load`` is ``async def``: ``torch_spdl.DataLoader`` awaits many of them concurrently on one
    event loop, while the inherited ``__getitem__`` runs one with ``asyncio.run``, which is what
    ``torch.utils.data.DataLoader``'s worker processes call. The dataset holds only the address,
    so it is cheap to hand to worker processes.
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
        if body != item_body(index):
            raise ValueError(f"item {index}: wrong body ({len(body)} bytes)")
        return index, body

    def preprocess(self, raw: tuple[int, bytes]) -> tuple[int, torch.Tensor]:
        """Bytes → uint8 tensor. ``bytearray`` because ``torch.frombuffer`` warns on read-only
        buffers; the copy is also what lets the tensor outlive the response object."""
        index, body = raw
        return index, torch.frombuffer(bytearray(body), dtype=torch.uint8)


# -- running a loader ----------------------------------------------------------------------------
def run(name: str, loader: torch.utils.data.DataLoader, num_items: int) -> float:
    """Iterate ``loader`` once, verify what it yielded, print and return samples per second.

    Every item must arrive exactly once (a batch sampler that lost or repeated an index would
    show here) and its bytes must match ``item_body`` (rows mixed up inside a batch would too).
    """
    seen: Counter[int] = Counter()
    start = time.perf_counter()
    for indices, data in loader:
        assert data.dtype == torch.uint8 and tuple(data.shape[1:]) == (BODY_BYTES,), data.shape
        for index, row in zip(indices.tolist(), data, strict=True):
            assert row.numpy().tobytes() == item_body(index), f"{name}: wrong bytes for {index}"
            seen[index] += 1
    elapsed = time.perf_counter() - start
    assert seen == Counter(range(num_items)), f"{name}: items not seen exactly once"
    rate = num_items / elapsed
    print(f"{name}: {num_items} samples in {elapsed:.2f} s = {rate:.1f} samples/s")
    return rate


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=256, help="samples, fetched once per loader")
    parser.add_argument("--latency", type=float, default=20, help="server delay per request, ms")
    parser.add_argument("--io-workers", type=int, default=64, help="torch_spdl: requests in flight")
    parser.add_argument("--num-workers", type=int, default=2, help="torch_spdl: preprocess threads")
    parser.add_argument("--torch-workers", type=int, default=4, help="torch: worker processes")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.manual_seed(0)  # the shuffle order, for repeatable runs
    # torch warns when worker processes outnumber the cores; these workers mostly wait on the
    # network, so more of them than cores is the point, not a mistake.
    warnings.filterwarnings("ignore", message="This DataLoader will create", category=UserWarning)
    with http_server(args.latency) as port:
        print(f"HTTP server on {HOST}:{port}, {args.latency:g} ms latency, {BODY_BYTES} B bodies")
        dataset = HttpItems(HOST, port, args.items)
        spdl = run(
            f"torch_spdl.DataLoader (num_workers={args.num_workers}, io_workers={args.io_workers})",
            torch_spdl.DataLoader(
                dataset,
                batch_size=BATCH_SIZE,
                shuffle=True,
                num_workers=args.num_workers,
                io_workers=args.io_workers,
            ),
            args.items,
        )
        torch_ = run(
            f"torch.utils.data.DataLoader (num_workers={args.torch_workers})",
            torch.utils.data.DataLoader(
                dataset, batch_size=BATCH_SIZE, shuffle=True, num_workers=args.torch_workers
            ),
            args.items,
        )
    print(f"speed-up: torch_spdl / torch = {spdl / torch_:.1f}x")
    print(f"OK: both loaders saw each of the {args.items} items exactly once, with the right bytes")


if __name__ == "__main__":
    main()
