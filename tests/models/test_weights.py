"""``--init weights:FILE``: a researcher's own weights, from a .pt state dict (read without
unpickling code) or a .safetensors file, loaded whole into the model, and one line naming the keys
or shapes that do not fit."""

import pickle

import pytest
import torch
from safetensors.torch import save_file

from dpsm_ray.cards import build_model
from dpsm_ray.models.weights import load_weights
from dpsm_ray.config import ConfigError, TrainConfig


def digits_mlp(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model("mlp", 10, input_shape=(1, 8, 8))


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_weights_from_a_file_are_loaded_whole(tmp_path, suffix):
    source, target = digits_mlp(1), digits_mlp(2)
    file = tmp_path / f"mine{suffix}"
    torch.save(source.state_dict(), file) if suffix == ".pt" else save_file(source.state_dict(), str(file))
    load_weights(target, file, "mlp")
    assert all(torch.equal(a, b) for a, b in zip(source.state_dict().values(), target.state_dict().values()))


def test_weights_that_do_not_fit_are_named_in_one_line(tmp_path):
    state = digits_mlp(1).state_dict()
    first, last = next(iter(state)), list(state)[-1]
    cases = {
        "missing": ({k: v for k, v in state.items() if k != first}, f"missing from the file: {first}"),
        "extra": ({**state, "head.extra": torch.zeros(1)}, "not in the model: head.extra"),
        "shape": ({**state, last: torch.zeros(3)}, f"shapes differ: {last} [3] in the file, [10] in the model"),
    }
    for name, (saved, needle) in cases.items():
        torch.save(saved, tmp_path / f"{name}.pt")
        with pytest.raises(ValueError, match="does not fit model mlp") as error:
            load_weights(digits_mlp(2), tmp_path / f"{name}.pt", "mlp")
        assert needle in str(error.value), error.value


def test_a_pt_file_that_would_run_code_is_refused(tmp_path):
    class Payload:
        def __reduce__(self):
            return (print, ("unpickled!",))

    (tmp_path / "evil.pt").write_bytes(pickle.dumps({"w": Payload()}, protocol=2))  # torch.save's protocol
    with pytest.raises(ValueError, match=r"not a state dict torch.load\(weights_only=True\) can read"):
        load_weights(digits_mlp(2), tmp_path / "evil.pt", "mlp")


def test_the_option_is_checked_and_made_absolute(tmp_path, monkeypatch):
    torch.save(digits_mlp(1).state_dict(), tmp_path / "mine.pt")
    monkeypatch.chdir(tmp_path)
    config = TrainConfig(init="weights:mine.pt").with_absolute_paths()
    assert config.init == f"weights:{tmp_path / 'mine.pt'}"
    with pytest.raises(ConfigError, match="weights:FILE must name a .pt, .pth, .safetensors file"):
        TrainConfig(init="weights:mine.bin")
    with pytest.raises(ConfigError, match="weights:FILE: no such file absent.pt"):
        TrainConfig(init="weights:absent.pt")
    with pytest.raises(ConfigError, match="must be one of scratch, base, or weights:FILE"):
        TrainConfig(init="imagenet")


def test_a_run_starts_from_the_weights(tmp_path):
    from dpsm_ray.train import run_training

    source = digits_mlp(1)
    torch.save(source.state_dict(), tmp_path / "mine.pt")
    # one epoch at a negligible learning rate: the run ends where it started
    result = run_training(TrainConfig(init=f"weights:{tmp_path / 'mine.pt'}", method="ce", epochs=1, lr=1e-12, momentum=0.0, weight_decay=0.0), log=lambda line: None)
    assert all(torch.allclose(result.model_state[k].cpu(), v, atol=1e-6) for k, v in source.state_dict().items())
