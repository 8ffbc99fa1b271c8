"""A researcher's own weights (``--init weights:FILE``): a state dict in a ``.pt``/``.pth`` file
(read with ``torch.load(weights_only=True)``: tensors only, nothing unpickled that could run code) or
a ``.safetensors`` file, loaded into the model whole: every key and every shape must match, and one
line names the first few that do not.  A pretrained backbone (``--pretrained-path FILE``): every
tensor but the classifier head's, from such a file (``load_backbone``)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

_SHOWN = 4  # the keys a mismatch names before "and N more"


def _read_state_dict(path: str | Path, option: str = "--init weights:") -> dict[str, torch.Tensor]:
    """The state dict in ``path``; errors name the file as the user gave it (``option`` + path)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{option}{path}: no such file")
    if path.suffix.lower() == ".safetensors":
        from safetensors.torch import load_file

        try:
            return load_file(str(path), device="cpu")
        except Exception as error:  # safetensors raises its own SafetensorError
            raise ValueError(f"{option}{path}: not a readable .safetensors file ({str(error)[:160]})") from None
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # an UnpicklingError names what weights_only refused
        raise ValueError(
            f"{option}{path}: not a state dict torch.load(weights_only=True) can read ({str(error).splitlines()[0][:160]})"
        ) from None
    if isinstance(saved, dict) and isinstance(saved.get("model"), dict):  # a dpsm_ray checkpoint: its model's weights
        saved = saved["model"]
    if not (isinstance(saved, dict) and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in saved.items())):
        raise ValueError(f"{option}{path}: holds a {type(saved).__name__}, not a state dict (parameter name -> tensor)")
    return saved


def listed(names: list[str]) -> str:
    return ", ".join(names[:_SHOWN]) + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")


def load_weights(model: nn.Module, path: str | Path, model_name: str, option: str = "--init weights:") -> None:
    """Load the state dict in ``path`` into ``model`` whole; ValueError naming the first keys
    missing from the file, the file's keys the model lacks, and the shapes that differ."""
    saved, own = _read_state_dict(path, option), model.state_dict()
    missing, unexpected = sorted(set(own) - set(saved)), sorted(set(saved) - set(own))
    shapes = [
        f"{k} {list(saved[k].shape)} in the file, {list(own[k].shape)} in the model"
        for k in sorted(set(own) & set(saved))
        if saved[k].shape != own[k].shape
    ]
    problems = (
        ([f"missing from the file: {listed(missing)}"] if missing else [])
        + ([f"not in the model: {listed(unexpected)}"] if unexpected else [])
        + ([f"shapes differ: {listed(shapes)}"] if shapes else [])
    )
    if problems:
        raise ValueError(f"{option}{path} does not fit model {model_name} ({len(own)} tensors): {'; '.join(problems)}")
    model.load_state_dict(saved)


def load_backbone(model: nn.Module, name: str, path: str | Path, head: str, rename=None) -> nn.Module:
    """Copy every tensor of ``model`` except the classifier head's (the module ``head``) from the
    state dict saved at ``path`` (an ImageNet file for torchvision's models, a run's ``model.pt``
    for the small ones; ``rename`` maps an older file's keys to the model's).  The head is left as
    initialised: its shape follows the class count.  Every other tensor must be in the file with the
    model's shape, so a file for another architecture fails loudly instead of leaving a silently
    random backbone."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"pretrained weights not found at {path}: give a local state dict file of {name} (--pretrained-path)")
    saved = _read_state_dict(path, "--pretrained-path ")
    if rename is not None:
        saved = {rename(key): value for key, value in saved.items()}
    backbone = {key: value for key, value in model.state_dict().items() if not key.startswith(head + ".")}
    # BatchNorm's step counters are absent from older torchvision files and not needed to predict
    unfit = [
        key
        for key, value in backbone.items()
        if not key.endswith("num_batches_tracked") and (key not in saved or saved[key].shape != value.shape)
    ]
    if unfit:
        raise ValueError(
            f"pretrained weights at {path} do not fit {name}: {len(unfit)} of its {len(backbone)} backbone tensors are missing or of"
            f" another shape (first: {unfit[0]})"
        )
    model.load_state_dict({key: saved[key] for key in backbone if key in saved}, strict=False)
    return model
