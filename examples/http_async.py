"""Samples fetched over HTTP by an ``async def load``: many requests in flight, few threads.

When each sample sits behind a network round trip, throughput is set by how many requests are
outstanding at once, not by CPU. ``torch.utils.data.DataLoader`` has one request in flight per
worker process (each worker runs ``__getitem__``, here ``asyncio.run(load(index))``, one sample at
a time), so it needs as many processes as it wants concurrent requests. ``torch_spdl.DataLoader``
sees that ``load`` is ``async def`` and runs it on one event loop with up to ``io_workers``
requests outstanding, while ``num_workers`` threads run ``preprocess``.

The server (:mod:`torch_spdl.bench.server`, shared with ``python -m torch_spdl.bench``) is one
asyncio event loop on 127.0.0.1 in a separate process, so its work does not compete with the
loaders for this process's GIL; it waits ``--latency`` ms, to stand in for a remote object store,
then answers ``GET /item/<i>`` with a 16 KB body derived from ``i``. The client
(:mod:`torch_spdl.bench.http`) is a minimal HTTP/1.1 GET on ``asyncio.open_connection``, standard
library only. Every sample is checked: each item seen exactly once per loader, with the right
bytes.

On a small machine the server and the client share the same cores, so the speed-up shown is
bounded by their CPU time, not by ``io_workers``; raise ``--latency`` to see the gap widen
(torch's side scales as ``torch-workers / latency``).

Run from the repository root after ``pip install -e ".[test]"``::

    python examples/http_async.py [--items N] [--latency MS] [--io-workers K]
                                  [--num-workers W] [--torch-workers P]

Only loopback traffic, a bounded number of requests (``--items`` per loader), and the server
process is terminated and waited for on exit, also when the run fails.
"""

from __future__ import annotations

import argparse
import time
import warnings
from collections import Counter

import torch
import torch.utils.data

import torch_spdl
from torch_spdl.bench.http import BODY_BYTES, HOST, HttpItems, http_server
from torch_spdl.bench.server import item_body

BATCH_SIZE = 16


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
    with http_server(args.latency) as server:
        print(
            f"HTTP server on {HOST}:{server.port}, {args.latency:g} ms latency, "
            f"{BODY_BYTES} B bodies"
        )
        dataset = HttpItems(HOST, server.port, args.items)
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
