"""A worker's replies in shared-memory segments it uses again (torch_spdl.segments): a segment is
written again only once the main process is done with what it holds."""

from __future__ import annotations

import gc
import pickle

import pytest
import torch

from torch_spdl import messages, segments

pytestmark = [
    pytest.mark.skipif(not segments.available(), reason="no memfd_create here"),
    pytest.mark.usefixtures("sends_shared_memory"),
]

BIG = 2 * messages.INLINE_BYTES


@pytest.fixture(autouse=True)
def own_segments(monkeypatch: pytest.MonkeyPatch) -> segments.Segments:
    """This test's worker segments, closed after it (the process's own are left alone)."""
    mine = segments.Segments()
    monkeypatch.setattr(segments, "segments", lambda: mine)
    yield mine
    mine.close()


def reply(value: object) -> object:
    """``value`` as the main process receives it from a worker."""
    return pickle.loads(messages.dumps(value, reply=True))


def batch(fill: int, nbytes: int = BIG) -> torch.Tensor:
    return torch.full((nbytes,), fill, dtype=torch.uint8)


def memories(own: segments.Segments) -> list[object]:
    return [segment.memory for segment in own._tracked]


def test_a_segment_is_written_again_once_the_received_tensor_is_freed(own_segments):
    first = reply(batch(1))
    assert segments.received_in_segment(first) and bool((first == 1).all())
    used = memories(own_segments)
    second = reply(batch(2))  # the first is still held: a second segment
    assert len(memories(own_segments)) == 2 and bool((first == 1).all())
    del first
    gc.collect()
    third = reply(batch(3))
    assert memories(own_segments)[:1] == used  # the first's segment, written again
    assert bool((second == 2).all()) and bool((third == 3).all())


def test_a_view_the_main_process_keeps_holds_its_segment(own_segments):
    """A training loop that keeps one image of a batch keeps the batch's segment: no later batch
    is written there, however many come, and the worker tracks no more than TRACKED."""
    kept = reply(batch(7))[: messages.INLINE_BYTES]
    gc.collect()
    for fill in range(2 * segments.TRACKED):
        assert bool((reply(batch(fill)) == fill).all())
    assert bool((kept == 7).all())
    assert len(own_segments._tracked) <= segments.TRACKED


def test_held_segments_beyond_the_tracked_are_sent_and_forgotten(own_segments):
    held = [reply(batch(fill)) for fill in range(segments.TRACKED + 3)]
    assert len(own_segments._tracked) == segments.TRACKED
    assert [int(tensor[0]) for tensor in held] == list(range(segments.TRACKED + 3))
    assert all(segments.received_in_segment(tensor) for tensor in held)


def test_a_segment_given_back_early_is_not_given_back_again_by_its_old_tensor(own_segments):
    """Given back once pinned, the segment takes the worker's next batch while the old tensor
    still exists here; that tensor's end must not give back the segment holding the new one."""
    old = reply(batch(1))
    assert messages.release_own(old) and segments.given_back(old)
    new = reply(batch(2))
    assert len(own_segments._tracked) == 1  # the same segment, written again
    del old
    gc.collect()
    newer = reply(batch(3))
    assert len(own_segments._tracked) == 2 and bool((new == 2).all())
    assert bool((newer == 3).all())


def test_free_segments_beyond_the_idle_are_closed(own_segments):
    held = [reply(batch(fill)) for fill in range(segments.IDLE + 3)]
    del held
    gc.collect()
    last = reply(batch(9))
    assert sum(segment.free for segment in own_segments._tracked) == segments.IDLE
    assert len(own_segments._tracked) == segments.IDLE + 1 and bool((last == 9).all())


def test_a_smaller_or_much_larger_tensor_takes_a_segment_that_fits(own_segments):
    reply(batch(1))  # freed at once: its segment is free
    gc.collect()
    small = reply(batch(2, BIG // 2 + 4096))  # fits, with under half left over: reused
    assert len(own_segments._tracked) == 1 and bool((small == 2).all())
    del small
    gc.collect()
    large = reply(batch(3, 3 * BIG))  # does not fit: the free one is closed for a new one
    assert len(own_segments._tracked) == 1 and own_segments._tracked[0].capacity >= 3 * BIG
    assert bool((large == 3).all())


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.arange(BIG // 4, dtype=torch.float32).view(4, -1),
        lambda: torch.arange(BIG, dtype=torch.int64).remainder(251).view(8, -1),
        lambda: (torch.arange(BIG) % 3 == 0).view(-1, 64),
        lambda: torch.randint(0, 255, (12, 3, 224, 224), dtype=torch.uint8).contiguous(
            memory_format=torch.channels_last
        ),
        lambda: torch.randn(3, BIG // 4 // 3 + 1).t(),  # dense, transposed
    ],
    ids=["float32", "int64", "bool", "channels-last", "transposed"],
)
def test_values_dtype_shape_and_layout_arrive_as_sent(make):
    sent = make()
    received = reply(sent)
    assert segments.received_in_segment(received)
    assert received.dtype == sent.dtype and received.shape == sent.shape
    assert received.stride() == sent.stride() and torch.equal(received, sent)
    received.add_(1 if sent.dtype != torch.bool else True)  # writable, and its own memory
    assert not torch.equal(received, sent) or sent.dtype == torch.bool


def test_a_reply_that_fails_to_pickle_leaves_its_segments_free(own_segments):
    """The worker sends an error instead (processes._send): the segment its tensor was copied to
    must not stay the main process's for good."""
    with pytest.raises((pickle.PicklingError, TypeError, AttributeError)):
        messages.dumps((batch(1), lambda: None), reply=True)
    assert [segment.free for segment in own_segments._tracked] == [True]
    received = reply(batch(2))
    assert len(own_segments._tracked) == 1 and bool((received == 2).all())


def test_a_forked_child_that_frees_its_copy_of_a_batch_gives_nothing_back(own_segments):
    """A process forked while this one holds a batch shares its segment's mapping: the child's
    copy of the tensor going must not let the worker write over the batch this process reads."""
    import multiprocessing

    held = reply(batch(5))
    # the child's copy, given back (as its end would: the child holds it through the test's
    # frame, which it never leaves)
    process = multiprocessing.get_context("fork").Process(target=segments.give_back, args=(held,))
    process.start()
    process.join()
    assert process.exitcode == 0
    assert [segment.free for segment in own_segments._tracked] == [False]
    assert bool((held == 5).all())


BIG_BATCHES = """
import os

import torch
import torch_spdl


class Images(torch.utils.data.Dataset):
    def __len__(self):
        return 32 * 8

    def __getitem__(self, index):
        return torch.full((3, 224, 224), index % 251, dtype=torch.uint8)


if __name__ == "__main__":
    # the limit holds: /dev/shm cannot take 32 MB (asked of the file system, not of torch,
    # whose older releases write into a full /dev/shm and die of SIGBUS)
    fd = os.open("/dev/shm/torch_spdl-test", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        os.posix_fallocate(fd, 0, 32 << 20)
    except OSError:
        pass
    else:
        raise SystemExit("/dev/shm is not limited here")
    finally:
        os.close(fd)
        os.unlink("/dev/shm/torch_spdl-test")
    loader = torch_spdl.DataLoader(
        Images(), batch_size=32, num_workers=2, worker_method="process", prefetch_factor=4
    )
    batches = list(loader)  # 8 batches of 4.8 MB, up to 8 in flight
    assert [int(batch[0, 0, 0, 0]) for batch in batches] == [32 * i % 251 for i in range(8)]
    print("ok")
"""


def test_worker_processes_batches_need_no_room_in_dev_shm(tmp_path):
    """A container's ``/dev/shm`` is often 64 MB (Docker's default), and torch's workers fail
    once their batches in flight fill it. The segments are memory files (``memfd_create``),
    which its size does not limit: batches come through a ``/dev/shm`` of 16 MB."""
    import shutil
    import subprocess
    import sys

    script = tmp_path / "big_batches.py"
    script.write_text(BIG_BATCHES)
    if shutil.which("unshare") is None:
        pytest.skip("no unshare here")
    command = f"mount -t tmpfs -o size=16m tmpfs /dev/shm && exec {sys.executable} {script}"
    done = subprocess.run(
        ["unshare", "-m", "sh", "-c", command], capture_output=True, text=True, timeout=300
    )
    if (
        done.returncode != 0
        and "ok" not in done.stdout
        and ("unshare" in done.stderr or "mount" in done.stderr)
    ):
        pytest.skip(f"cannot mount a small /dev/shm here: {done.stderr.strip()[-200:]}")
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]
