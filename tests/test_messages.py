"""How messages between the main process and a worker process are pickled (torch_spdl.messages):
what travels by value, what in shared memory. Loaders that send them: tests/test_processes.py."""

from __future__ import annotations

import multiprocessing
import pickle

import pytest
import torch

from torch_spdl import messages


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


def test_a_job_only_a_starting_process_may_pickle_is_left_to_it():
    """A ``multiprocessing`` lock pickles only while a process is being started: such a job is
    not packed, and each worker's start pickles it, as without packing."""
    job = {"lock": multiprocessing.get_context("spawn").Lock()}
    assert messages.pack(job) is job
