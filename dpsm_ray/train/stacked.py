"""Several trials of one architecture trained as one stacked model: horizontal fusion.

A packed GPU runs each trial's small kernels on its own stream, time-sliced; stacking instead puts
the N trials' parameters side by side (``torch.func.stack_module_state``: each ``[N, ...]``) and runs
one vmapped forward and backward for all of them, so every kernel is N times larger and there are N
times fewer.  Each trial keeps what makes it a trial: its own initial weights, batches, loss (its
objective and its hyperparameters) and SGD state (learning rate, momentum, weight decay).  The
losses are summed for one backward; as no parameter is shared, each trial's gradient is its own
loss's, and ``StackedTrials`` trains exactly as N separate models with ``torch.optim.SGD`` would
(``tests/train/test_stacked.py``; ``bench/stacked.py`` measures whether it is faster).

Not wired into sweeps: a measurement on the GPU decides whether it earns an option.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.func import functional_call, stack_module_state, vmap


def _normalise_in_fp32(module: nn.Module, args: tuple) -> tuple | None:
    """BatchNorm's input in fp32 under autocast: without it the stacked ResNet-110 step of
    bench/stacked.py failed under bf16 autocast on an H100 ("Expected running_mean to have type
    BFloat16 but got Float", torch 2.11: vmap's batch-norm rule meets bf16 input beside the fp32
    running statistics); cuDNN normalises in fp32 inside anyway."""
    (x,) = args
    autocast = torch.is_autocast_enabled(x.device.type)
    return (x.float(),) if autocast and x.dtype in (torch.bfloat16, torch.float16) else None


class StackedTrials:
    """``models`` (one architecture, N instances) as one model with stacked parameters and buffers,
    trained with SGD (``torch.optim.SGD``'s update: weight decay added to the gradient, momentum
    without dampening, not Nesterov) at each trial's own ``lrs[i]``, ``momenta[i]`` and
    ``weight_decays[i]``.  BatchNorm's running statistics are per trial (stacked buffers)."""

    def __init__(self, models: Sequence[nn.Module], lrs: Sequence[float], momenta: Sequence[float], weight_decays: Sequence[float]) -> None:
        if not models:
            raise ValueError("stacked trials: need at least one model")
        if not len(models) == len(lrs) == len(momenta) == len(weight_decays):
            raise ValueError(
                f"stacked trials: {len(models)} models need as many lrs, momenta and weight decays; got {len(lrs)}, {len(momenta)},"
                f" {len(weight_decays)}"
            )
        shapes = [[(name, tuple(p.shape)) for name, p in model.state_dict().items()] for model in models]
        if any(shape != shapes[0] for shape in shapes[1:]):
            raise ValueError("stacked trials: every model must be the same architecture (the same parameter names and shapes)")
        self.size = len(models)
        self.params, self.buffers = stack_module_state(list(models))
        self.params = {name: p.detach().requires_grad_() for name, p in self.params.items()}
        self.template = copy.deepcopy(models[0]).to("meta")  # the architecture, holding no memory
        for module in self.template.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                module.register_forward_pre_hook(_normalise_in_fp32)
        device = next(iter(self.params.values())).device
        self.lrs, self.momenta, self.weight_decays = (
            torch.tensor(v, dtype=torch.float32, device=device) for v in (lrs, momenta, weight_decays)
        )
        self.momentum_buffers: dict[str, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[N, B, ...]`` (trial i's batch at ``x[i]``) -> logits ``[N, B, K]``."""

        def one(params, buffers, inputs):
            return functional_call(self.template, (params, buffers), (inputs,))

        return vmap(one, randomness="different")(self.params, self.buffers, x)

    def step(
        self, x: torch.Tensor, y: torch.Tensor, losses: Sequence[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]
    ) -> torch.Tensor:
        """One training step of every trial: ``losses[i](logits_i, labels_i)`` on trial i's batch
        ``x[i]``, ``y[i]``; returns the N losses ``[N]`` (detached)."""
        if len(losses) != self.size:
            raise ValueError(f"stacked trials: {self.size} trials need {self.size} losses; got {len(losses)}")
        logits = self.forward(x)
        values = torch.stack([loss(logits[i], y[i]) for i, loss in enumerate(losses)])
        names = list(self.params)
        grads = torch.autograd.grad(values.sum(), [self.params[name] for name in names])
        with torch.no_grad():
            first = self.momentum_buffers is None
            if first:
                self.momentum_buffers = {}
            for name, grad in zip(names, grads):
                p = self.params[name]
                shape = (self.size,) + (1,) * (p.dim() - 1)
                d_p = grad + self.weight_decays.view(shape) * p
                if first:
                    buffer = d_p.clone()
                else:
                    buffer = self.momentum_buffers[name].mul_(self.momenta.view(shape)).add_(d_p)
                self.momentum_buffers[name] = buffer
                p.sub_(self.lrs.view(shape) * buffer)
        return values.detach()

    def unstack(self, models: Sequence[nn.Module]) -> None:
        """Copy each trial's parameters and buffers into ``models[i]`` (e.g. to evaluate or save it)."""
        stacked = {**self.params, **self.buffers}
        with torch.no_grad():
            for i, model in enumerate(models):
                model.load_state_dict({name: value[i] for name, value in stacked.items()})
