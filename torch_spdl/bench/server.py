"""A loopback HTTP server that answers ``GET /item/<i>`` after a fixed delay: a stand-in for a
remote object store. Standard library only, and run as a script by path, never imported by it.

Why a script of its own: it runs in a separate process so that its work does not compete with
the loaders for the benchmark's GIL, and it must not be a fork of the benchmark (or import torch)
because the benchmark measures memory as PSS: a forked server would share the benchmark's pages
and take half of them off the measured process's bill. Started as ``python -I server.py``, it
shares nothing with the loaders but the Python runtime's own files.

It is one asyncio event loop: a request costs a coroutine and a timer while it waits, not a
thread, so the server stays cheap at hundreds of requests in flight (on a 2-core machine its CPU
time is taken from the loaders being measured). The body of ``/item/<i>`` is
:func:`item_body` (``i``), so clients can verify every response.

Usage: ``python -I server.py --latency MS``; it prints the port it listens on (127.0.0.1, chosen by
the kernel) on one line and serves until terminated.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import re
import signal

HOST = "127.0.0.1"
BODY_BYTES = 16 * 1024
BACKLOG = 1024  # a burst of 64+ connects beyond the backlog has SYNs dropped and retried 1 s later
ITEM = re.compile(rb"GET /item/(\d+) HTTP/1\.[01]")
ITEMS = re.compile(rb"GET /items/(\d+(?:,\d+)*) HTTP/1\.[01]")


def item_body(index: int) -> bytes:
    """The body served for ``/item/<index>``: a digest of the index, repeated to 16 KB.

    Deterministic and different for every index, so a client can verify each response without
    the server sending anything else; cheap to compute on both sides.
    """
    digest = hashlib.sha256(f"item {index}".encode()).digest()
    return (digest * (BODY_BYTES // len(digest) + 1))[:BODY_BYTES]


def response(status: str, body: bytes) -> bytes:
    head = (
        f"HTTP/1.1 {status}\r\nContent-Type: application/octet-stream\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


def answer(request: bytes) -> bytes:
    """``/item/<i>``: item i's body; ``/items/<i>,<j>,...``: their bodies one after another (a
    batch request, answered after the same delay as one item)."""
    if (one := ITEM.match(request)) is not None:
        return response("200 OK", item_body(int(one.group(1))))
    if (many := ITEMS.match(request)) is not None:
        indices = [int(index) for index in many.group(1).split(b",")]
        return response("200 OK", b"".join(item_body(index) for index in indices))
    return response("404 Not Found", b"")


async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float) -> None:
    """One connection, one request: wait ``delay`` seconds, answer, close."""
    try:
        request = await reader.readuntil(b"\r\n\r\n")
        await asyncio.sleep(delay)  # the stand-in for a remote store's round trip
        writer.write(answer(request))
        await writer.drain()
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
        pass  # the client went away: nothing to answer
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def serve(latency_ms: float) -> None:
    """Listen on an ephemeral loopback port, print it, serve until SIGTERM or SIGINT."""
    delay = latency_ms / 1000
    server = await asyncio.start_server(
        lambda r, w: handle(r, w, delay), HOST, 0, backlog=BACKLOG, reuse_address=True
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    async with server:
        print(server.sockets[0].getsockname()[1], flush=True)
        await stop.wait()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="loopback HTTP item server")
    parser.add_argument("--latency", type=float, default=20.0, help="delay per request, ms")
    args = parser.parse_args(argv)
    asyncio.run(serve(args.latency))


if __name__ == "__main__":
    main()
