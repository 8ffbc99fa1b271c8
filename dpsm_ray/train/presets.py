"""Named sets of training settings: ``--preset official`` trains each method as its official code
does (docs/method.md, "Defaults and the official code").

Each preset has shared settings (the schedule, here) and per-method ones (on each method's card,
``MethodCard.presets``).  ``dpsm-ray train`` applies both under the options given on its command
line; a sweep applies the per-method ones only, under what it searches -- every method of a sweep
shares its schedule, so that they are compared on equal terms.
"""

from __future__ import annotations

from dpsm_ray.cards.methods import preset_settings

# YuanjieSh/DPSM_code at 6bb92ed (train/train_cifar.py and its README's commands): fine-tuning from
# the CE base model's weights with a new optimizer, lr restarted at 0.1 and divided by 10 at epoch
# 25 of 40, batch 128, momentum 0.9, weight decay 1e-4
DPSM_CODE_SHARED = {
    "init": "base", "epochs": 40, "batch_size": 128, "lr": 0.1, "milestones": (25,), "lr_decay": 0.1, "lr_schedule": "step",
    "momentum": 0.9, "weight_decay": 1e-4, "nesterov": False,
}
_PRESETS = {"official": DPSM_CODE_SHARED}  # each preset's shared schedule; a method's own settings are on its card
PRESET_NAMES = tuple(_PRESETS)


def preset_values(name: str, method: str, *, schedule: bool = True) -> dict:
    """The settings preset ``name`` gives ``method``: its shared schedule, then the method's own,
    which win (ConfTr as published has a schedule of its own).  ``schedule=False`` (a sweep) gives
    the method's objective settings only."""
    if name not in _PRESETS:
        raise ValueError(f"preset must be one of {', '.join(PRESET_NAMES)}; got {name!r}")
    shared = _PRESETS[name]
    values = {**shared, **preset_settings(name, method)}
    return values if schedule else {k: v for k, v in values.items() if k not in shared}
