"""Batched augmentation for images kept as one tensor ``[N, C, H, W]`` (CIFAR's uint8, the glyphs' float).

The standard CIFAR recipe -- random crop with 4-pixel zero padding, then a horizontal flip with
probability 1/2 (He et al. 2016) -- done as tensor ops on a whole batch, so it runs wherever the
images are, CPU or GPU (as in airbench).  Each example's crop offset and flip are a pure function
of ``(seed, example id)`` (``counter_uniforms``), never of the batch it lands in, its position in
that batch or the number of workers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dpsm_ray.seeding import counter_uniforms, derive_seed


def crop_offsets(ids: torch.Tensor, seed: int, padding: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top and left offsets, uniform on ``0 .. 2 * padding``, of each example's crop window in
    its padded image (offset ``padding`` is the unshifted image)."""
    positions = 2 * padding + 1
    # counter_uniforms lies strictly inside (0, 1), so the floor is at most 2 * padding
    top = (counter_uniforms(derive_seed(seed, "crop_top"), ids) * positions).floor().long()
    left = (counter_uniforms(derive_seed(seed, "crop_left"), ids) * positions).floor().long()
    return top, left


def flip_mask(ids: torch.Tensor, seed: int) -> torch.Tensor:
    """Whether each example is mirrored left-right (probability 1/2)."""
    return counter_uniforms(derive_seed(seed, "flip"), ids) < 0.5


def crop_and_flip(images: torch.Tensor, top: torch.Tensor, left: torch.Tensor, flip: torch.Tensor, padding: int) -> torch.Tensor:
    """Zero-pad every image by ``padding``, cut the ``H x W`` window at ``(top[i], left[i])``
    and mirror it where ``flip[i]``, for the whole batch in one indexing op."""
    count, _, height, width = images.shape
    padded = F.pad(images, (padding, padding, padding, padding))
    device = images.device
    rows = top.to(device)[:, None] + torch.arange(height, device=device)  # [N, H]
    cols = left.to(device)[:, None] + torch.arange(width, device=device)  # [N, W]
    # reading the window's columns backwards is the crop followed by a mirror
    cols = torch.where(flip.to(device)[:, None], cols.flip(1), cols)
    batch = torch.arange(count, device=device)[:, None, None]
    # advanced indices on dims 0, 2, 3 around a slice put the channel last: [N, H, W, C]
    window = padded[batch, :, rows[:, :, None], cols[:, None, :]]
    return window.permute(0, 3, 1, 2).contiguous()


def random_crop_flip(images: torch.Tensor, ids: torch.Tensor, seed: int, padding: int = 4) -> torch.Tensor:
    """The CIFAR augmentation of a batch whose examples have ids ``ids`` (see module docstring)."""
    top, left = crop_offsets(ids, seed, padding)
    return crop_and_flip(images, top, left, flip_mask(ids, seed), padding)


def random_crop(images: torch.Tensor, ids: torch.Tensor, seed: int, padding: int) -> torch.Tensor:
    """A random shift of up to ``padding`` pixels each way (a crop of the zero-padded image),
    without flips: for images whose mirror is another class (the glyphs)."""
    top, left = crop_offsets(ids, seed, padding)
    return crop_and_flip(images, top, left, torch.zeros(ids.shape, dtype=torch.bool, device=ids.device), padding)
