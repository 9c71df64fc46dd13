"""A tensor's memory layout as the order of its dimensions, for sending its bytes as they lie and
rebuilding it, layout included, on the other side (a channels-last image stays channels-last)."""

from __future__ import annotations

import torch


def memory_order(tensor: torch.Tensor) -> list[int] | None:
    """The order of ``tensor``'s dimensions in memory, outermost first, where its elements fill
    its memory without gaps in some order (contiguous, channels-last, any permutation of a
    contiguous tensor); None for views with gaps or overlaps."""
    order = sorted(range(tensor.dim()), key=tensor.stride, reverse=True)
    return order if tensor.permute(order).is_contiguous() else None


def fills_its_memory(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is all of its storage: not a view into a larger one."""
    return bool(tensor.storage_offset() == 0 and tensor.untyped_storage().nbytes() == tensor.nbytes)


def in_memory_order(tensor: torch.Tensor, order: list[int]) -> torch.Tensor:
    """``tensor`` permuted into its memory ``order``: a contiguous view of the same bytes."""
    return tensor.detach().permute(order)


def rebuilt(
    data: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...], order: list[int] | None
) -> torch.Tensor:
    """The tensor of ``shape`` whose bytes, in memory ``order`` (None: contiguous), are ``data``
    (one dimension, uint8): a view of them, with the sender's strides."""
    if order is None:
        return data.view(dtype).reshape(shape)
    in_memory = [shape[d] for d in order]
    back = sorted(range(len(order)), key=order.__getitem__)  # the inverse permutation
    return data.view(dtype).reshape(in_memory).permute(back)
