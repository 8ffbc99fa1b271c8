"""Collective operations over data-parallel workers, with a no-op version for one process.

The objectives take a ``Collective`` so that the quantile maths reads the same with one worker or
many: ``collective.mean`` averages DPSM's pinball gradient over workers (the data order of dpsm_ray/train/loop.py) and
``collective.gather`` builds ConfTr's and CUT's global batch.  Imports torch only.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class LocalCollective:
    """One process: every collective is the identity."""

    world_size = 1
    rank = 0

    def mean(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def gather_uneven(self, tensor: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        return tensor

    def broadcast_(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def broadcast_object(self, obj):
        return obj


class TorchDistributedCollective:
    """Workers of an initialised ``torch.distributed`` process group (gloo or nccl)."""

    def __init__(self) -> None:
        if not dist.is_initialized():
            raise RuntimeError("TorchDistributedCollective needs an initialised torch.distributed process group")
        self.world_size = dist.get_world_size()
        self.rank = dist.get_rank()

    def mean(self, tensor: torch.Tensor) -> torch.Tensor:
        """Average over workers (no gradient)."""
        return self.sum(tensor) / self.world_size

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        out = tensor.detach().clone()
        dist.all_reduce(out)
        return out

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate every worker's equally sized ``tensor`` along dim 0, in rank order.

        Differentiable: each worker's part receives the gradient of *every* worker's loss with
        respect to it (an all-reduce of the incoming gradient), so that after DDP averages the
        parameter gradients the result equals one process computing the loss on the global batch.
        """
        return _DifferentiableAllGather.apply(tensor)

    def gather_uneven(self, tensor: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Concatenate parts of known, possibly different sizes (dim 0) without padding rows in
        the result: each evaluation point counts exactly once.  No gradient."""
        longest = max(sizes)
        padded = tensor.new_zeros((longest, *tensor.shape[1:]))
        padded[: tensor.shape[0]] = tensor.detach()
        parts = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(parts, padded)
        return torch.cat([part[:size] for part, size in zip(parts, sizes)])

    def broadcast_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Overwrite ``tensor`` in place with rank 0's (no gradient)."""
        dist.broadcast(tensor, src=0)
        return tensor

    def broadcast_object(self, obj):
        holder = [obj]
        dist.broadcast_object_list(holder, src=0)
        return holder[0]


class _DifferentiableAllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> torch.Tensor:
        ctx.rank, ctx.rows = dist.get_rank(), tensor.shape[0]
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, tensor.contiguous())
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad)
        return grad[ctx.rank * ctx.rows : (ctx.rank + 1) * ctx.rows]


def current_collective() -> LocalCollective | TorchDistributedCollective:
    """The collective for this process: distributed when a process group with more than one
    worker is initialised, local otherwise."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return TorchDistributedCollective()
    return LocalCollective()
