"""Workload B: I/O-bound samples, each an HTTP GET of 16 KB with 20 ms of server latency.

The work per sample is nearly all waiting, so throughput is set by how many requests are in
flight. ``torch`` gets one per worker process (4, then 64 processes); ``torch_spdl`` awaits
:class:`~torch_spdl.bench.http.HttpItems`' ``async def load`` on one event loop with
``io_workers`` requests in flight and 2 threads for ``preprocess``; its ``load_many`` variant
(:class:`~torch_spdl.bench.http.HttpBatchItems`) asks for a whole batch in one request, with as
many requests in flight, answered after the same latency. The server runs in its own
process (see :mod:`torch_spdl.bench.server`) and is left out of the memory measurement.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.data

import torch_spdl

from .http import BODY_BYTES, HOST, HttpBatchItems, HttpItems, http_server
from .measure import TORCH, Variant
from .server import item_body

BATCH = 16
LATENCY_MS = 20.0
SPDL_THREADS = 2  # num_workers for preprocess (bytes → tensor): the CPU part is tiny
SPDL = "torch_spdl async load"
SPDL_MANY = "torch_spdl load_many"  # one request per batch of 16


@dataclass(frozen=True)
class Options:
    batches: int
    torch_workers: tuple[int, ...]
    io_workers: tuple[int, ...]


def check_batch(batch: Any) -> None:
    """Right shape and dtype, and the first row holds the bytes of the index it claims."""
    indices, data = batch
    assert tuple(data.shape) == (BATCH, BODY_BYTES) and data.dtype == torch.uint8, data.shape
    assert data[0].numpy().tobytes() == item_body(int(indices[0])), "wrong bytes"


@contextlib.contextmanager
def prepare(options: Options) -> Iterator[list[Variant]]:
    """Start the server for the ``with`` block and yield the variants that read from it."""
    with http_server(LATENCY_MS) as server:
        dataset = HttpItems(HOST, server.port, options.batches * BATCH)
        common: dict[str, Any] = dict(batch_size=BATCH, shuffle=True)

        def variant(loader: str, workers: int, make: Any, note: str) -> Variant:
            return Variant(
                "B",
                loader,
                workers,
                make,
                options.batches,
                lambda batch: len(batch[0]),
                check=check_batch,
                exclude_pids=(server.pid,),
                note=note,
            )

        variants = [
            variant(
                TORCH,
                w,
                lambda w=w: torch.utils.data.DataLoader(dataset, num_workers=w, **common),
                f"{w} worker processes",
            )
            for w in options.torch_workers
        ]
        batched = HttpBatchItems(HOST, server.port, options.batches * BATCH)
        for name, items, per_request in ((SPDL, dataset, ""), (SPDL_MANY, batched, f" of {BATCH}")):
            variants += [
                variant(
                    name,
                    io,
                    lambda io=io, items=items: torch_spdl.DataLoader(
                        items, num_workers=SPDL_THREADS, io_workers=io, **common
                    ),
                    f"num_workers={SPDL_THREADS}, io_workers={io} requests{per_request}",
                )
                for io in options.io_workers
            ]
        yield variants
