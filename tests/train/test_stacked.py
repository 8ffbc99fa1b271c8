"""Stacked trials (dpsm_ray/train/stacked.py) train exactly as the same trials trained one by one
with torch.optim.SGD: the CPU twin of the GPU measurement in bench/stacked.py."""

import pytest
import torch
import torch.nn.functional as F

from dpsm_ray.models.small import MLP, LeNet
from dpsm_ray.train.stacked import StackedTrials

SETTINGS = {"lrs": (0.1, 0.05, 0.01), "momenta": (0.9, 0.0, 0.5), "weight_decays": (1e-4, 0.0, 1e-3)}


def build(kind: str, seed: int):
    torch.manual_seed(seed)
    return LeNet((1, 16, 16), 7) if kind == "lenet" else MLP((1, 16, 16), 7, width=32, batch_norm=True)


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
    optimizers = [torch.optim.SGD(m.parameters(), lr=lr, momentum=mo, weight_decay=wd)
                  for m, lr, mo, wd in zip(separate, *SETTINGS.values())]
    stacked = StackedTrials(stacked_models, **SETTINGS)
    generator = torch.Generator().manual_seed(0)
    for _ in range(5):
        x, y = torch.randn(3, 12, 1, 16, 16, generator=generator), torch.randint(0, 7, (3, 12), generator=generator)
        expected = []
        for i, (model, optimizer) in enumerate(zip(separate, optimizers)):
            optimizer.zero_grad()
            loss = losses[i](model(x[i]), y[i])
            loss.backward()
            optimizer.step()
            expected.append(loss.item())
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
