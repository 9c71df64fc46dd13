"""device= / device_transform=: structure kept, values equal to the CPU path, errors at once.

The CUDA tests are marked ``cuda`` and skip cleanly where no GPU is present.
"""

from __future__ import annotations

import collections
import collections.abc
import copy
import dataclasses
import pickle
from typing import NamedTuple

import pytest
import torch
from torch.utils.data import Dataset

from torch_spdl import DataLoader, StagedDataset
from torch_spdl.transfer import SideStreams, map_tensors, rank_device, resolve_device
from torch_spdl.transforms import IMAGENET_MEAN, IMAGENET_STD, imagenet_normalize

pytestmark = pytest.mark.usefixtures("no_leak")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class Pair(NamedTuple):
    image: torch.Tensor
    label: int


@dataclasses.dataclass(frozen=True)
class Record:
    image: torch.Tensor
    name: str
    extra: list


def test_map_tensors_keeps_every_container_type_and_leaf():
    data = {
        "pair": Pair(torch.ones(2), 3),
        "record": Record(torch.zeros(1), "x", [torch.ones(1), None]),
        "ordered": collections.OrderedDict(a=torch.ones(1)),
        "default": collections.defaultdict(list, b=[torch.ones(1)]),
        "tuple": (torch.ones(1), "s", b"b", 1.5),
    }
    out = map_tensors(data, lambda t: t + 1)
    assert type(out["pair"]) is Pair and out["pair"].label == 3
    assert torch.equal(out["pair"].image, torch.full((2,), 2.0))
    assert type(out["record"]) is Record and out["record"].name == "x"
    assert torch.equal(out["record"].extra[0], torch.full((1,), 2.0))
    assert out["record"].extra[1] is None
    assert type(out["ordered"]) is collections.OrderedDict
    assert type(out["default"]) is collections.defaultdict
    assert out["default"].default_factory is list
    assert out["tuple"][1:] == ("s", b"b", 1.5)
    assert torch.equal(data["pair"].image, torch.ones(2))  # the input is not modified


class Frames(collections.abc.Sequence):
    """A user's read-only sequence, made from a list."""

    def __init__(self, items):
        self.items = list(items)

    def __getitem__(self, index):
        return self.items[index]

    def __len__(self):
        return len(self.items)


def test_map_tensors_walks_every_sequence_as_torchs_pin_memory_does():
    """A deque (mutable) is copied and filled, another sequence made from the list; one that
    cannot be made from a list becomes the list, as in torch's ``pin_memory``."""
    queue = collections.deque([torch.ones(1), "s"], maxlen=5)
    out = map_tensors(queue, lambda t: t + 1)
    assert type(out) is collections.deque and out.maxlen == 5 and out[1] == "s"
    assert torch.equal(out[0], torch.full((1,), 2.0)) and torch.equal(queue[0], torch.ones(1))
    frames = map_tensors(Frames([torch.ones(1)]), lambda t: t + 1)
    assert type(frames) is Frames and torch.equal(frames[0], torch.full((1,), 2.0))
    unmakeable = type("Unmakeable", (Frames,), {"__init__": lambda self, a, b: None})
    bare = object.__new__(unmakeable)
    bare.items = [torch.ones(1)]
    assert isinstance(map_tensors(bare, lambda t: t + 1), list)
    assert map_tensors(range(3), lambda t: t + 1) == range(3)


class Images(Dataset):
    def __len__(self):
        return 10

    def __getitem__(self, index):
        image = torch.full((3, 4, 4), index * 20, dtype=torch.uint8)
        return {"image": image, "label": index, "meta": Pair(torch.tensor([index]), index)}


class StagedImages(StagedDataset):
    def __len__(self):
        return 10

    def load(self, index):
        return index

    def preprocess(self, raw):
        return Images()[raw]


def assert_same(a, b):
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert torch.equal(a.cpu(), b.cpu()) and a.dtype == b.dtype
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("dataset", [Images, StagedImages])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_device_cpu_gives_the_cpu_batches(dataset, num_workers):
    want = list(DataLoader(dataset(), batch_size=4))
    got = list(DataLoader(dataset(), batch_size=4, num_workers=num_workers, device="cpu"))
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert_same(a, b)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_device_transform_normalizes_images_and_leaves_the_rest(num_workers):
    loader = DataLoader(
        Images(),
        batch_size=5,
        num_workers=num_workers,
        device="cpu",
        device_transform=imagenet_normalize(key="image"),
    )
    for batch, plain in zip(loader, DataLoader(Images(), batch_size=5), strict=True):
        mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
        std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
        want = (plain["image"].float() / 255 - mean) / std
        assert batch["image"].dtype == torch.float32
        assert torch.allclose(batch["image"], want)
        assert torch.equal(batch["label"], plain["label"])


def test_normalize_finds_images_in_namedtuple_batches_by_position_or_name():
    images = torch.full((2, 3, 1, 1), 255, dtype=torch.uint8)
    for key in (0, "image"):
        out = imagenet_normalize(key=key)(Pair(images, 7))
        assert type(out) is Pair and out.label == 7
        want = (1 - torch.tensor(IMAGENET_MEAN)) / torch.tensor(IMAGENET_STD)
        assert torch.allclose(out.image[0, :, 0, 0], want)


def test_device_transform_error_keeps_its_type_and_names_the_stage():
    loader = DataLoader(
        Images(), batch_size=5, num_workers=2, device="cpu", device_transform=imagenet_normalize()
    )
    with pytest.raises(KeyError, match="in stage 'transfer'"):  # a dict batch has no key 0
        list(loader)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_without_cuda_is_an_error_at_construction():
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        DataLoader(Images(), device="cuda")


@pytest.mark.parametrize("backend", ["xpu", "mps"])
def test_another_missing_backend_is_an_error_at_construction(backend: str):
    if getattr(torch, backend).is_available():
        pytest.skip(f"this machine has {backend}")
    with pytest.raises(RuntimeError, match=f"device='{backend}'.*{backend} is not available"):
        DataLoader(Images(), device=backend)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"device": "not-a-device"}, RuntimeError),
        ({"device": "cpu", "device_transform": 42}, TypeError),
        ({"device_transform": lambda batch: batch}, ValueError),
    ],
)
def test_bad_device_options_fail_at_construction(kwargs, error):
    with pytest.raises(error):
        DataLoader(Images(), **kwargs)


def test_device_options_are_public_attributes_with_torch_preserving_defaults():
    loader = DataLoader(Images())
    assert loader.device is None and loader.device_transform is None
    transform = imagenet_normalize()
    loader = DataLoader(Images(), device="cpu", device_transform=transform)
    assert loader.device == "cpu" and loader.device_transform is transform


def test_plain_cuda_means_this_ranks_gpu(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert rank_device(torch.device("cuda")) == torch.device("cuda", 3)
    assert rank_device(torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert rank_device(torch.device("cpu")) == torch.device("cpu")
    assert resolve_device(None) is None


def test_a_loader_keeps_one_transfer_stream_per_device_for_all_its_passes(monkeypatch):
    made = []

    class Stream:
        def __init__(self, device):
            made.append(device)

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    streams = SideStreams()
    first = streams.get(torch.device("cuda", 0))
    assert streams.get(torch.device("cuda", 0)) is first
    assert streams.get(torch.device("cuda", 1)) is not first
    assert streams.get(torch.device("cpu")) is None
    assert made == [torch.device("cuda", 0), torch.device("cuda", 1)]
    for copied in (copy.deepcopy(streams), pickle.loads(pickle.dumps(streams))):
        assert copied.get(torch.device("cuda", 0)) is not first  # a copy makes its own
    loader = DataLoader(Images(), batch_size=4, device="cpu")
    assert isinstance(copy.deepcopy(loader)._side_streams, SideStreams)


# -- CUDA ---------------------------------------------------------------------------------------
@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dataset", [Images, StagedImages])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_cuda_batches_equal_the_cpu_path(dataset, num_workers):
    want = list(DataLoader(dataset(), batch_size=4))
    got = list(DataLoader(dataset(), batch_size=4, num_workers=num_workers, device="cuda"))
    for a, b in zip(got, want, strict=True):
        assert a["image"].is_cuda and a["meta"].image.is_cuda
        assert_same(a, b)


class SlowOnTheTransferStream:
    """Keeps the transfer stream busy, then changes the batch: a consumer that did not wait for
    the transfer's event would read the values from before the change."""

    def __call__(self, batch):
        torch.cuda._sleep(50_000_000)  # tens of milliseconds of GPU time on the side stream
        batch["image"] = batch["image"].float() + 1000
        return batch


@pytest.mark.cuda
@needs_cuda
def test_consumer_never_sees_a_batch_before_its_copy_and_transform_finished():
    loader = DataLoader(
        Images(),
        batch_size=5,
        num_workers=2,
        device="cuda",
        device_transform=SlowOnTheTransferStream(),
    )
    for batch, plain in zip(loader, DataLoader(Images(), batch_size=5), strict=True):
        seen = (batch["image"] * 1).cpu()  # work queued on the consumer's own stream
        assert torch.equal(seen, plain["image"].float() + 1000)


class Big(Dataset):
    """A million small images: a long pass, for memory that grows batch by batch."""

    def __len__(self):
        return 1_000_000

    def __getitem__(self, index):
        return torch.full((3, 64, 64), index % 256, dtype=torch.uint8)


@pytest.mark.cuda
@needs_cuda
def test_pinned_staging_is_reused_and_memory_does_not_grow():
    loader = DataLoader(Big(), batch_size=8, num_workers=2, device="cuda")
    batch_bytes = 8 * 3 * 64 * 64
    # batches the loader may hold on the device at once: those prefetched, the one in the
    # transfer stage and the one the loop holds (how many varies from one moment to the next)
    in_flight = loader.num_workers * loader.prefetch_factor + 2
    it = iter(loader)
    try:
        for _ in range(100):
            next(it)
        torch.cuda.synchronize()
        host_blocks = torch.cuda.host_memory_stats()["num_host_alloc"]
        device_bytes = torch.cuda.memory_allocated()
        for _ in range(1000):
            next(it)
        torch.cuda.synchronize()
        # a leak would add a block per batch; the cache may add one or two where more batches
        # than during the warm-up happen to be in flight at once (21 -> 22 once on an H100 host)
        assert torch.cuda.host_memory_stats()["num_host_alloc"] <= host_blocks + 2
        # a leak would keep 1,000 batches; an H200 host had 0 bytes, then 2 batches, in flight
        assert torch.cuda.memory_allocated() <= device_bytes + in_flight * batch_bytes
    finally:
        del it


@pytest.mark.cuda
@needs_cuda
def test_passes_copy_on_one_stream_and_reserve_no_more_memory():
    """The caching allocator reuses a freed block only on its own stream: were each pass to copy
    on a new one (torch hands out 32 in turn), every pass would reserve blocks of its own (a
    segment of 20 MiB at least)."""

    class Big(Dataset):
        def __len__(self):
            return 32

        def __getitem__(self, index):
            return torch.full((3, 512, 512), index, dtype=torch.uint8)

    loader = DataLoader(Big(), batch_size=8, num_workers=2, device="cuda")
    streams = set()
    for n in range(40):
        it = iter(loader)
        streams.add(it._transfer.stream)
        assert len(list(it)) == 4
        del it
        if n == 1:
            torch.cuda.synchronize()
            reserved = torch.cuda.memory_reserved()
    torch.cuda.synchronize()
    assert len(streams) == 1
    assert torch.cuda.memory_reserved() <= reserved + 2 * 20 * 2**20
