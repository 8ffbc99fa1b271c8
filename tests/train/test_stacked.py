"""Stacked trials (dpsm_ray/train/stacked.py) train exactly as the same trials trained one by one
with torch.optim.SGD: the CPU twin of the GPU measurement in bench/stacked.py."""

import contextlib
import functools

import pytest
import torch
import torch.nn.functional as F

from dpsm_ray.cards import build_model
from dpsm_ray.models.small import MLP, LeNet
from dpsm_ray.train.stacked import StackedTrials

SETTINGS = {"lrs": (0.1, 0.05, 0.01), "momenta": (0.9, 0.0, 0.5), "weight_decays": (1e-4, 0.0, 1e-3)}


def build(kind: str, seed: int):
    torch.manual_seed(seed)
    return LeNet((1, 16, 16), 7) if kind == "lenet" else MLP((1, 16, 16), 7, width=32, batch_norm=True)


def sgd(models, settings: dict) -> list[torch.optim.SGD]:
    """torch.optim.SGD for each model, at the trial's lr, momentum and weight decay in ``settings``."""
    return [torch.optim.SGD(m.parameters(), lr=lr, momentum=mo, weight_decay=wd) for m, lr, mo, wd in zip(models, *settings.values())]


def step_each(models, optimizers, x, y, losses, precision=contextlib.nullcontext) -> list[float]:
    """One SGD step of each model alone on its batch ``x[i]``, ``y[i]``; their losses."""
    values = []
    for i, (model, optimizer) in enumerate(zip(models, optimizers)):
        optimizer.zero_grad()
        with precision():
            loss = losses[i](model(x[i]), y[i])
        loss.backward()
        optimizer.step()
        values.append(loss.item())
    return values


def smoothed(weight: float):
    return lambda logits, labels: F.cross_entropy(logits, labels, label_smoothing=weight)


@pytest.mark.parametrize("kind", ["lenet", "mlp_bn"])
def test_stacked_trials_train_as_separate_models_with_sgd(kind):
    """Three trials with their own initial weights, batches, losses, learning rates, momenta and
    weight decays; five steps stacked against five steps of each alone.  With BatchNorm, each
    trial's running statistics are its own."""
    separate = [build(kind, seed) for seed in range(3)]
    stacked_models = [build(kind, seed) for seed in range(3)]
    losses = [smoothed(w) for w in (0.0, 0.1, 0.3)]
    optimizers = sgd(separate, SETTINGS)
    stacked = StackedTrials(stacked_models, **SETTINGS)
    generator = torch.Generator().manual_seed(0)
    for _ in range(5):
        x, y = torch.randn(3, 12, 1, 16, 16, generator=generator), torch.randint(0, 7, (3, 12), generator=generator)
        expected = step_each(separate, optimizers, x, y, losses)
        assert stacked.step(x, y, losses).tolist() == pytest.approx(expected, rel=1e-5, abs=1e-6)
    stacked.unstack(stacked_models)
    for mine, theirs in zip(stacked_models, separate):
        for (name, a), b in zip(mine.state_dict().items(), theirs.state_dict().values()):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=f"{kind}: {name} differs")
    # the trials stayed apart: the three models are not one
    assert not torch.equal(stacked_models[0].state_dict()[name], stacked_models[1].state_dict()[name])


def test_stacked_forward_is_each_model_s_forward():
    models = [build("lenet", seed) for seed in range(4)]
    x = torch.randn(4, 5, 1, 16, 16)
    logits = StackedTrials(models, (0.1,) * 4, (0.0,) * 4, (0.0,) * 4).forward(x)
    torch.testing.assert_close(logits, torch.stack([model(x[i]) for i, model in enumerate(models)]))


def test_mismatched_trials_are_named():
    with pytest.raises(ValueError, match="same architecture"):
        StackedTrials([LeNet((1, 16, 16), 7), LeNet((1, 16, 16), 8)], (0.1, 0.1), (0.0, 0.0), (0.0, 0.0))
    with pytest.raises(ValueError, match="2 models need as many lrs"):
        StackedTrials([build("lenet", 0), build("lenet", 1)], (0.1,), (0.0, 0.0), (0.0, 0.0))
    stacked = StackedTrials([build("lenet", 0), build("lenet", 1)], (0.1, 0.1), (0.0, 0.0), (0.0, 0.0))
    with pytest.raises(ValueError, match="2 trials need 2 losses; got 1"):
        stacked.step(torch.randn(2, 3, 1, 16, 16), torch.zeros(2, 3, dtype=torch.long), [smoothed(0.0)])


def resnet20(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model("resnet20", 7, input_shape=(3, 16, 16))


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")])],
)
def test_stacked_trials_train_under_bf16_autocast_as_separate_models(device):
    """bf16 autocast, ResNet-20's BatchNorm2d: the stacked step trains as the separate models do, to bf16's
    precision; the running statistics stay fp32.  (The stacked step normalises in fp32 since
    bench/stacked.py's ResNet-110 at batch 128 failed on an H100 without it; this smaller case passed
    there with and without it: bench/results/h100-2026-11-26/gpu_test_stacked.log.)"""
    settings = {name: values[:2] for name, values in SETTINGS.items()}
    separate = [resnet20(seed).to(device) for seed in range(2)]
    stacked = StackedTrials([resnet20(seed).to(device) for seed in range(2)], **settings)
    optimizers = sgd(separate, settings)
    bf16 = functools.partial(torch.autocast, device, dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):
        x = torch.randn(2, 16, 3, 16, 16, generator=generator).to(device)
        y = torch.randint(0, 7, (2, 16), generator=generator).to(device)
        expected = step_each(separate, optimizers, x, y, [F.cross_entropy] * 2, bf16)
        with bf16():
            values = stacked.step(x, y, [F.cross_entropy] * 2)
        assert values.tolist() == pytest.approx(expected, rel=2e-2)
    # the running statistics stay fp32 and per trial
    assert stacked.buffers["stem.1.running_mean"].dtype == torch.float32
    torch.testing.assert_close(stacked.buffers["stem.1.running_mean"][1], separate[1].stem[1].running_mean, rtol=2e-2, atol=2e-3)
