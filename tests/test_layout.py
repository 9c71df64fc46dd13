"""A tensor's memory layout, sent as its bytes in memory order and rebuilt with its strides."""

import pytest
import torch

from torch_spdl import layout


@pytest.mark.parametrize(
    "tensor",
    [
        torch.arange(24.0).reshape(2, 3, 4),
        torch.arange(120).reshape(2, 3, 4, 5).to(memory_format=torch.channels_last),
        torch.arange(24, dtype=torch.int16).reshape(2, 3, 4).permute(2, 0, 1),
        torch.tensor(7.0),
    ],
    ids=["contiguous", "channels-last", "permuted", "scalar"],
)
def test_a_dense_tensor_is_rebuilt_from_its_bytes_with_its_strides(tensor: torch.Tensor):
    order = layout.memory_order(tensor)
    assert order is not None
    data = layout.in_memory_order(tensor, order).reshape(-1).view(torch.uint8).clone()
    back = layout.rebuilt(data, tensor.dtype, tuple(tensor.shape), order)
    assert back.stride() == tensor.stride() and back.dtype == tensor.dtype
    assert torch.equal(back, tensor)
    assert back.untyped_storage().data_ptr() == data.untyped_storage().data_ptr()  # a view


@pytest.mark.parametrize(
    "view",
    [torch.arange(24).reshape(4, 6)[:, ::2], torch.arange(4).expand(3, 4)],
    ids=["gaps", "overlaps"],
)
def test_a_view_with_gaps_or_overlaps_has_no_memory_order(view: torch.Tensor):
    assert layout.memory_order(view) is None


def test_a_tensor_fills_its_memory_unless_it_views_a_larger_one():
    base = torch.arange(12).view(3, 4)
    assert layout.fills_its_memory(base) and layout.fills_its_memory(base.t())
    assert not layout.fills_its_memory(base[1:]) and not layout.fills_its_memory(base[:2])
