"""How messages between the main process and a worker process are pickled (torch_spdl.messages):
what travels by value, what in shared memory. Loaders that send them: tests/test_processes.py."""

from __future__ import annotations

import gc
import multiprocessing
import os
import pickle
import sys
from typing import Any

import numpy as np
import pytest
import torch

from torch_spdl import messages, segments, shared_buffers


def many_small(count: int) -> list[torch.Tensor]:
    """``count`` tensors of 4 KiB, each small enough to travel by value."""
    return [torch.full((1024,), float(k)) for k in range(count)]


@pytest.mark.usefixtures("sends_shared_memory")
def test_a_large_message_crosses_in_shared_memory_as_a_whole():
    """Many small tensors by value add up to a message over ``LARGE_MESSAGE``: the pipe carries
    a handle to it (read in pipe-sized chunks, each a GIL hand-off for the reader beside a busy
    training loop, it took seconds), and it unpickles to what was sent."""
    sent = many_small(2 * messages.LARGE_MESSAGE // 4096)
    message = messages.dumps(sent)
    assert len(message) < 4096
    received = pickle.loads(message)
    assert len(received) == len(sent)
    assert all(torch.equal(a, b) and not a.is_shared() for a, b in zip(received, sent, strict=True))


def test_a_small_message_stays_in_the_pipe():
    sent = many_small(4)
    message = messages.dumps(sent)
    assert len(message) > 4 * 4096  # the tensors' bytes are in it
    assert all(torch.equal(a, b) for a, b in zip(pickle.loads(message), sent, strict=True))


@pytest.mark.usefixtures("sends_shared_memory")
@pytest.mark.parametrize("tensors", [4, 2 * messages.LARGE_MESSAGE // 4096], ids=["small", "large"])
def test_a_message_a_reference_cycle_holds_is_collected_quietly(tensors: int):
    """From Python 3.13 a ``BytesIO`` whose buffer a collected cycle still exports fails to
    close, and Python prints its BufferError ("Exception ignored in: <_io.BytesIO ...>"), as
    CI's free-threaded leg did at a process loader's shutdown: a message is no such view."""
    message = messages.dumps(many_small(tensors))
    unraised: list[BaseException | None] = []
    hook, sys.unraisablehook = sys.unraisablehook, lambda raised: unraised.append(raised.exc_value)
    try:
        cycle: list[Any] = [message]
        cycle.append(cycle)
        del cycle, message
        gc.collect()
    finally:
        sys.unraisablehook = hook
    assert unraised == []


def test_a_packed_job_sets_aside_what_multiprocessing_reduces_and_reads_back_whole():
    """A job pickled once for every worker (``pack``): tensors are set aside, to be sent to each
    worker as before (in shared memory), and the rest, large here, waits in shared memory."""
    small, big = torch.arange(4), torch.zeros(messages.LARGE_MESSAGE)
    job = {"samples": [(f"/data/{k}.jpg", k % 10) for k in range(100_000)], "small": small}
    job.update(big=big, again=big)
    packed = messages.pack(job)
    assert isinstance(packed, messages.Packed)
    assert [id(x) for x in packed.side] == [id(small), id(big)]
    assert isinstance(packed.data, torch.Tensor) and packed.data.is_shared()
    assert len(packed.data) < big.nbytes  # the tensor's bytes are not in it
    back = packed.unpack()
    assert back["samples"] == job["samples"]
    assert back["small"] is small and back["big"] is back["again"] is big


needs_memfd = pytest.mark.skipif(
    not shared_buffers.available(), reason="buffers are shared through memfd_create (Linux)"
)


def holding_arrays() -> dict:
    """A job as an in-memory dataset is one (CIFAR-10 holds its images in one NumPy array):
    large arrays, one read-only, one Fortran-ordered, a small one, and one seen twice."""
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (64, 32, 32, 3), dtype=np.uint8)
    frozen = np.arange(1 << 15, dtype=np.int64)
    frozen.flags.writeable = False
    fortran = np.asfortranarray(rng.random((256, 64)))
    small = np.arange(16, dtype=np.int32)
    return {"images": images, "frozen": frozen, "fortran": fortran, "small": small, "again": images}


def assert_same_arrays(back: dict, job: dict) -> None:
    for key in ("images", "frozen", "fortran", "small"):
        assert back[key].dtype == job[key].dtype and np.array_equal(back[key], job[key]), key
        assert back[key].flags.f_contiguous == job[key].flags.f_contiguous, key
        assert back[key].flags.writeable == job[key].flags.writeable, key
    assert back["again"] is back["images"]


@needs_memfd
def test_a_packed_jobs_large_arrays_are_shared_not_pickled():
    """Each worker of a pool unpickled its own copy of a dataset's arrays (torch's forked
    workers share the parent's pages): their data now goes to one shared file, outside the
    pickle, and reads back equal, with its order and read-only flag."""
    job = holding_arrays()
    packed = messages.pack(job)
    assert isinstance(packed.data, bytes) and len(packed.data) < 10_000
    assert packed.buffers is not None
    shared = [job[key].nbytes for key in ("images", "frozen", "fortran")]
    assert [length for _, length in packed.buffers.spans] == shared
    back = packed.unpack()
    assert_same_arrays(back, job)
    with pytest.raises(ValueError, match="read-only"):
        back["frozen"][0] = 1


@needs_memfd
def test_a_write_to_a_shared_array_is_the_writers_own():
    """Mapped copy-on-write, as a forked worker's memory is: what one reader writes, neither
    the main process's array nor another reader sees."""
    job = holding_arrays()
    packed = messages.pack(job)
    one, other = packed.unpack(), packed.unpack()
    one["images"][0] = 7
    assert bool((one["images"][0] == 7).all())
    assert np.array_equal(other["images"], job["images"])
    assert not bool((job["images"][0] == 7).all())


@pytest.mark.parametrize("why", ["no memfd_create", "no memory for the file"])
def test_where_no_buffer_can_be_shared_the_arrays_travel_in_the_pickle(
    why: str, monkeypatch: pytest.MonkeyPatch
):
    if why == "no memfd_create":
        monkeypatch.setattr(shared_buffers, "available", lambda: False)
    else:

        def refuse(*args: object) -> int:
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(os, "memfd_create", refuse, raising=False)
    job = holding_arrays()
    packed = messages.pack(job)
    assert packed.buffers is None
    assert_same_arrays(packed.unpack(), job)


def test_a_job_only_a_starting_process_may_pickle_is_left_to_it():
    """A ``multiprocessing`` lock pickles only while a process is being started: such a job is
    not packed, and each worker's start pickles it, as without packing."""
    job = {"lock": multiprocessing.get_context("spawn").Lock()}
    assert messages.pack(job) is job


@pytest.mark.usefixtures("sends_shared_memory")
def test_a_large_message_gives_its_segment_back_once_read(released: list[torch.Tensor]):
    """The segment a large message crossed in is released once unpickled (without the GIL,
    torch_spdl.shared_pages), and what was sent arrives whole."""
    sent = many_small(2 * messages.LARGE_MESSAGE // 4096)
    received = pickle.loads(messages.dumps(sent))
    assert all(torch.equal(a, b) for a, b in zip(received, sent, strict=True))
    assert len(released) == 1 and released[0].nbytes > messages.LARGE_MESSAGE
    if sys.platform.startswith("linux"):
        assert released[0].count_nonzero() == 0  # its pages are gone


@pytest.mark.usefixtures("sends_shared_memory")
def test_a_large_batch_crosses_in_shared_memory_of_the_replys_own(reply_segments: str):
    """A collated batch is copied into shared memory made for replies: the sender's tensor stays
    private (a worker's cache that holds it never reads memory the main process gave back), and
    the received one is marked as arrived so, equal to what was sent, in its own memory. A
    view, and a request from the main process, go as torch sends them."""
    batch = torch.arange(3 * messages.INLINE_BYTES, dtype=torch.int32).view(3, -1)
    received = pickle.loads(messages.dumps({"images": batch}, reply=True))["images"]
    assert not batch.is_shared() and torch.equal(received, batch)
    assert received.data_ptr() != batch.data_ptr()
    if reply_segments == "reused":
        assert segments.received_in_segment(received) and not received.is_shared()
    else:
        assert received.is_shared() and getattr(received, messages._OWN_SEGMENT)
    view = torch.arange(4 * messages.INLINE_BYTES, dtype=torch.uint8)[: 2 * messages.INLINE_BYTES]
    sent_view = pickle.loads(messages.dumps(view, reply=True))
    assert torch.equal(sent_view, view) and not hasattr(sent_view, messages._OWN_SEGMENT)
    assert not segments.received_in_segment(sent_view)
    request = torch.ones(2 * messages.INLINE_BYTES, dtype=torch.uint8)  # main → worker
    sent_request = pickle.loads(messages.dumps(request))
    assert request.is_shared() and not hasattr(sent_request, messages._OWN_SEGMENT)
    assert not segments.received_in_segment(sent_request)


@pytest.mark.usefixtures("sends_shared_memory")
@pytest.mark.parametrize("elements", [6, 3 * messages.INLINE_BYTES], ids=["by-value", "copied"])
def test_views_of_a_tensor_sent_whole_arrive_as_views_of_it(reply_segments: str, elements: int):
    """A batch and views of it (labels sliced from the input ids, a transpose) arrive sharing
    its memory, as torch's workers send them; a view sent before its base arrives equal."""
    batch = torch.arange(elements, dtype=torch.float32).view(2, -1)
    sent = (batch, batch[1, 1:3], batch.t())
    back, labels, transposed = pickle.loads(messages.dumps(sent, reply=True))
    assert all(torch.equal(a, b) for a, b in zip((back, labels, transposed), sent, strict=True))
    assert transposed.stride() == batch.t().stride()
    labels[0] = -1.0
    assert back[1, 1] == transposed[1, 1] == -1.0
    view_first, whole = pickle.loads(messages.dumps((batch[1, 1:3], batch), reply=True))
    assert torch.equal(view_first, batch[1, 1:3]) and torch.equal(whole, batch)


@pytest.mark.usefixtures("sends_shared_memory")
@pytest.mark.parametrize("elements", [10, 3 * messages.INLINE_BYTES], ids=["by-value", "copied"])
def test_two_tensors_over_one_buffer_arrive_whole(reply_segments: str, elements: int):
    """from_numpy of an array's start, then of the array: storages of their own at one
    address; the longer is no view of the shorter."""
    ids = np.arange(elements, dtype=np.int64)
    sent = {"prefix": torch.from_numpy(ids[:10]), "ids": torch.from_numpy(ids)}
    back = pickle.loads(messages.dumps(sent, reply=True))
    assert torch.equal(back["prefix"], sent["prefix"]) and torch.equal(back["ids"], sent["ids"])


@pytest.mark.usefixtures("sends_shared_memory")
def test_sparse_and_nested_tensors_after_a_dense_one_cross_as_torchs_reductions_send_them(
    reply_segments: str,
):
    """A sparse tensor has no storage to look up, a strided nested tensor no strides: after a
    dense tensor (which starts the message's record of what it sent whole) they go to torch's
    own reductions, as from torch's workers."""
    nested = torch.nested.nested_tensor([torch.ones(2, 3), torch.ones(4, 3)])
    sent = (torch.ones(3), torch.eye(3).to_sparse(), torch.eye(3).to_sparse_csr(), nested)
    dense, coo, csr, back = pickle.loads(messages.dumps(sent, reply=True))
    assert torch.equal(dense, sent[0])
    assert torch.equal(coo.to_dense(), torch.eye(3)) and torch.equal(csr.to_dense(), torch.eye(3))
    assert [t.tolist() for t in back.unbind()] == [t.tolist() for t in nested.unbind()]


@pytest.mark.usefixtures("sends_shared_memory")
def test_received_segments_are_given_back_once_pinned_copies_hold_the_batch(reply_segments: str):
    """After pinning (a copy here, as ``pin_memory`` makes one), the memory a batch arrived in is
    given back: to the worker that sent it, or freed; a tensor the pinned batch still holds as
    it is, and a shared tensor that did not arrive in a reply's memory, keep their data."""
    big = 2 * messages.INLINE_BYTES
    sent = {"a": torch.ones(big, dtype=torch.uint8), "b": torch.full((big,), 2, dtype=torch.uint8)}
    received = pickle.loads(messages.dumps(sent, reply=True))
    received["c"] = torch.full((big,), 3, dtype=torch.uint8).share_memory_()  # not ours
    pinned = {"a": received["a"].clone(), "b": received["b"], "c": received["c"].clone()}
    messages.release_received(received, pinned)
    assert torch.equal(pinned["a"], sent["a"]) and torch.equal(pinned["b"], sent["b"])
    assert bool((received["c"] == 3).all())
    if reply_segments == "reused":
        assert segments.given_back(received["a"]) and not segments.given_back(received["b"])
    elif sys.platform.startswith("linux"):
        assert received["a"].count_nonzero() == 0  # given back


@pytest.mark.parametrize("private", [True, False], ids=["torchs-new-shared", "fallback"])
def test_a_batch_is_copied_into_a_segment_of_its_own_in_its_own_layout(
    private: bool, monkeypatch: pytest.MonkeyPatch
):
    """A collated batch (large, not yet shared) goes into a new segment, copied once, with its
    values, dtype, shape and memory layout; the worker's own tensor stays where it was. Where
    torch lacks the private ``UntypedStorage._new_shared``, the fallback makes the same."""
    if not private:
        monkeypatch.setattr(torch.UntypedStorage, "_new_shared", None, raising=False)
    batch = torch.randn(4, 3, 64, 64).to(memory_format=torch.channels_last)
    segment = messages._own_segment(batch)
    assert segment is not None and segment.is_shared() and not batch.is_shared()
    assert segment.untyped_storage().data_ptr() != batch.untyped_storage().data_ptr()
    assert segment.stride() == batch.stride() and segment.dtype == batch.dtype
    assert torch.equal(segment, batch)
