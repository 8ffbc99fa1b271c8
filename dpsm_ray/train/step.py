"""One training step -- forward on B1 and B2, the objective, backward, SGD -- in two forms.

``EagerStep`` runs it op by op: any device, any world size.

``GraphStep`` runs the same maths with everything a CUDA graph needs: static input buffers that
each batch is copied into, SGD with momentum written as in-place ``_foreach`` ops whose learning
rate is a device tensor (so the schedule changes it without re-capture), and DPSM's q updated in
place on the device.  On CUDA (``capture=True``) the whole step is captured once and replayed,
which removes the launch overhead that dominates small CIFAR models at batch 64-128
(bench/README.md).  With ``capture=False`` the same function runs eagerly, which is how its
arithmetic is tested against ``EagerStep`` without a GPU.

Both return the objective's detached statistics for the step.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from dpsm_ray.collective import LocalCollective
from dpsm_ray.objectives import Objective

_WARMUP_STEPS = 3  # eager replays on a side stream before capture (cuDNN / allocator set-up)

# What ``--step auto`` / ``--precision auto`` (the defaults) run, by device type: on CUDA the
# captured bf16 channels_last step, measured by bench/gpu_check.py on an H100 (2026-11-24):
# ResNet-110 + DPSM at batch 128, 5716 images/s against 1725 for eager fp32 (3.3x), the same CE
# loss and validation set size after 2 epochs (bench/README.md).  Where the step cannot be
# captured -- several workers, Nesterov momentum, an objective not marked ``graph_safe`` -- auto is
# the eager step (in bf16 on CUDA, without channels_last, which was measured with the captured step
# only).  ``--step eager --precision fp32`` is the plain path.
AUTO_STEP = {"cpu": "eager", "cuda": "graph"}
AUTO_PRECISION = {"cpu": "fp32", "cuda": "bf16"}


def graph_capturable(objective: Objective, nesterov: bool) -> bool:
    """Whether ``--step auto`` may capture a run's step: one process, plain SGD with momentum (what
    GraphStep implements) and an objective marked ``graph_safe``."""
    return isinstance(objective.collective, LocalCollective) and not nesterov and objective.graph_safe


def resolve_step(kind: str, device: torch.device, capturable: bool = True) -> str:
    if kind != "auto":
        return kind
    return AUTO_STEP.get(device.type, "eager") if capturable else "eager"


def resolve_precision(precision: str, device: torch.device) -> str:
    return AUTO_PRECISION.get(device.type, "fp32") if precision == "auto" else precision


def resolve_channels_last(step: str, channels_last: bool, device: torch.device, capturable: bool = True) -> bool:
    """``--channels-last``, or ``--step auto`` where it resolves to the captured step (measured so)."""
    return channels_last or (step == "auto" and resolve_step(step, device, capturable) == "graph")


def auto_line(step: str, precision: str, device: torch.device, capturable: bool = True) -> str | None:
    """The log line of a run that asked for ``auto`` where that is not the plain path (eager
    fp32): what it runs.  None otherwise (a CPU run of the defaults says nothing)."""
    asked = [f"--{name} auto" for name, value in (("step", step), ("precision", precision)) if value == "auto"]
    if not asked:
        return None
    runs = [resolve_step(step, device, capturable), resolve_precision(precision, device)]
    if resolve_channels_last(step, False, device, capturable):
        runs.append("channels_last")
    if runs == ["eager", "fp32"]:
        return None
    return f"{' '.join(asked)} on {device.type}: {' '.join(runs)} (--step eager --precision fp32 is the plain path)"


def autocast(device: torch.device, precision: str, *, cache_enabled: bool = True):
    """bf16 autocast of the forward pass, or nothing for fp32 (``auto``: what it stands for on ``device``)."""
    if resolve_precision(precision, device) == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, cache_enabled=cache_enabled)


def _model_input(x1: torch.Tensor, x2: torch.Tensor, channels_last: bool) -> torch.Tensor:
    x = torch.cat([x1, x2])
    return x.contiguous(memory_format=torch.channels_last) if channels_last and x.ndim == 4 else x


def forward_objective(model, objective: Objective, x1, y1, x2, y2, precision: str, channels_last: bool, cache_enabled: bool = True):
    """Logits of B1 and B2 in one forward (in fp32 for the objective), then the objective."""
    with autocast(x1.device, precision, cache_enabled=cache_enabled):
        logits = model(_model_input(x1, x2, channels_last))
    logits1, logits2 = logits.float().split([x1.shape[0], x2.shape[0]])
    return objective(logits1, y1, logits2, y2)


class EagerStep:

    def __init__(
        self,
        model: nn.Module,
        objective: Objective,
        optimizer: torch.optim.Optimizer,
        *,
        precision: str = "fp32",
        channels_last: bool = False,
    ) -> None:
        self.model, self.objective, self.optimizer = model, objective, optimizer
        self.precision, self.channels_last = precision, channels_last

    def __call__(self, x1, y1, x2, y2) -> dict[str, torch.Tensor]:
        out = forward_objective(self.model, self.objective, x1, y1, x2, y2, self.precision, self.channels_last)
        self.optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        self.optimizer.step()
        return out.stats


def _sgd_group(optimizer: torch.optim.Optimizer) -> dict:
    if not isinstance(optimizer, torch.optim.SGD) or len(optimizer.param_groups) != 1:
        raise TypeError("GraphStep implements SGD with one parameter group")
    group = optimizer.param_groups[0]
    if group["nesterov"] or group["dampening"] or group.get("maximize"):
        raise TypeError("GraphStep implements plain SGD with momentum (no nesterov, dampening or maximize)")
    return group


def momentum_buffers(optimizer: torch.optim.SGD, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """The optimiser's own momentum buffers (so its state_dict checkpoints them), created as
    zeros where SGD has not made them yet: ``0 * m + d_p`` equals SGD's first-step ``d_p``."""
    buffers = []
    for p in params:
        state = optimizer.state[p]
        if state.get("momentum_buffer") is None:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        buffers.append(state["momentum_buffer"])
    return buffers


@torch.no_grad()
def sgd_momentum_update(params, grads, buffers, lr: torch.Tensor, momentum: float, weight_decay: float) -> None:
    """torch.optim.SGD's update, in place and free of host synchronisation:
    d_p = g + wd * p;  m = momentum * m + d_p;  p -= lr * m."""
    d_p = torch._foreach_add(grads, params, alpha=weight_decay) if weight_decay else grads
    torch._foreach_mul_(buffers, momentum)
    torch._foreach_add_(buffers, d_p)
    torch._foreach_sub_(params, torch._foreach_mul(buffers, lr))


class GraphStep:
    """The whole step with static shapes, replayed from one CUDA graph when ``capture``.

    Single process only (its collectives would sit inside the graph).  Built from the first
    batch, after any checkpoint has been loaded: the graph holds the addresses of the parameters,
    the momentum buffers and the objective's state (DPSM's q), so they are only ever updated in
    place afterwards.
    """

    def __init__(
        self,
        model: nn.Module,
        objective: Objective,
        optimizer: torch.optim.Optimizer,
        example,
        *,
        precision: str = "fp32",
        channels_last: bool = False,
        capture: bool = True,
    ) -> None:
        if not isinstance(objective.collective, LocalCollective):
            raise ValueError("step: graph runs one worker; use the eager step with several workers")
        group = _sgd_group(optimizer)
        self.model, self.objective, self.optimizer = model, objective, optimizer
        self.precision, self.channels_last = precision, channels_last
        self.params = [p for p in group["params"] if p.requires_grad]
        self.buffers = momentum_buffers(optimizer, self.params)
        self.momentum, self.weight_decay = group["momentum"], group["weight_decay"]
        device = self.params[0].device
        self.lr = torch.tensor(float(group["lr"]), device=device)
        self.static = [t.detach().clone() for t in example]
        self.stats: dict[str, torch.Tensor] = {}
        self.graph = None
        if capture:
            if device.type != "cuda":
                raise ValueError(f"step: graph capture needs a CUDA device; the model is on {device}")
            self._capture()

    def _body(self) -> None:
        x1, y1, x2, y2 = self.static
        for p in self.params:
            p.grad = None  # backward writes fresh gradients (in the graph's pool when capturing)
        out = forward_objective(self.model, self.objective, x1, y1, x2, y2, self.precision, self.channels_last, cache_enabled=False)
        out.loss.backward()
        sgd_momentum_update(self.params, [p.grad for p in self.params], self.buffers, self.lr, self.momentum, self.weight_decay)
        self.stats = out.stats

    def _state_tensors(self) -> list[torch.Tensor]:
        """Everything a step changes in place: parameters, buffers (BatchNorm statistics),
        momentum and the objective's state (DPSM's q, CUT's step counter)."""
        return [*self.params, *self.model.buffers(), *self.buffers, *self.objective.state_tensors()]

    def _capture(self) -> None:
        # Warm-up steps run for real, so the state they change is put back afterwards: the
        # captured run then starts exactly where the eager one would.
        self.objective.prepare(self.params[0].device)
        saved = [t.detach().clone() for t in self._state_tensors()]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(_WARMUP_STEPS):
                self._body()
        torch.cuda.current_stream().wait_stream(side)
        with torch.no_grad():
            for tensor, value in zip(self._state_tensors(), saved):
                tensor.copy_(value)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._body()

    def __call__(self, x1, y1, x2, y2) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            for static, value in zip(self.static, (x1, y1, x2, y2)):
                static.copy_(value, non_blocking=True)
            self.lr.fill_(float(self.optimizer.param_groups[0]["lr"]))
        if self.graph is None:
            self._body()
        else:
            self.graph.replay()
        # copies: the graph overwrites its outputs on the next replay
        return {name: value.clone() for name, value in self.stats.items()}


class Forwards:
    """How a run's network computes logits outside its steps -- the epoch's diagnostics, its
    validation, the final evaluation: fp32 logits of a ``precision`` forward, without gradients,
    in whatever mode the caller left the network.  Eagerly; or, with ``capture`` (a run whose steps
    are captured, ``GraphStep``, on CUDA), each batch shape seen a second time is captured in a
    CUDA graph for the network's mode and replayed from then on.  An eager forward of a deep network
    is bound by the host: on an H200, ResNet-110 at batch 128 took about 21 ms a forward under the
    profiler, where the whole captured training step takes 13.6 ms, and the train-mode diagnostic's
    78 such batches made an epoch's end longer than its steps (bench/README.md, ``group.py``).  A
    shape seen once (a split's last, smaller batch) runs eagerly: capturing it would cost more than
    it saves.  Replays write what an eager forward writes (BatchNorm's running statistics in train
    mode: the diagnostics' ``Untouched`` puts them back)."""

    def __init__(self, precision: str, capture: bool = False) -> None:
        self.precision, self.capture = precision, capture
        self.seen: dict[tuple, int] = {}
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self.pool = None  # one memory pool for all the graphs: they replay one at a time, their output copied out at once

    def __call__(self, net: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if not (self.capture and x.device.type == "cuda"):
            return self.eager(net, x)
        key = (id(net), net.training, tuple(x.shape), x.dtype)
        if key not in self.graphs:
            self.seen[key] = self.seen.get(key, 0) + 1
            if self.seen[key] < 2:
                return self.eager(net, x)
            self.graphs[key] = self._capture(net, x)
        graph, static_in, static_out = self.graphs[key]
        static_in.copy_(x)
        graph.replay()
        return static_out.clone()  # the next replay overwrites it

    def eager(self, net: nn.Module, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad(), autocast(x.device, self.precision):
            return net(x).float()

    def _capture(self, net: nn.Module, x: torch.Tensor):
        static_in = x.detach().clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.no_grad(), autocast(x.device, self.precision, cache_enabled=False):
            net(static_in)  # cuDNN's and the allocator's set-up, outside the graph
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool), torch.no_grad(), autocast(x.device, self.precision, cache_enabled=False):
            static_out = net(static_in).float()
        self.pool = graph.pool()
        return graph, static_in, static_out


def build_step(model, objective, optimizer, example, *, kind: str, precision: str, channels_last: bool, capturable: bool = True):
    """The step a run's ``step`` option names (``example`` is its first batch, on the device;
    ``channels_last`` as ``resolve_channels_last`` gives it, ``capturable`` as ``graph_capturable()``)."""
    kind, precision = resolve_step(kind, example[0].device, capturable), resolve_precision(precision, example[0].device)
    if kind == "graph":
        if example[0].device.type != "cuda":
            from dpsm_ray.config import ConfigError

            raise ConfigError("step", kind, f"graph needs a CUDA device; this run is on {example[0].device.type}")
        return GraphStep(model, objective, optimizer, example, precision=precision, channels_last=channels_last)
    return EagerStep(model, objective, optimizer, precision=precision, channels_last=channels_last)
