"""Named sets of training settings: ``--preset official`` trains each method as its official code
does (docs/method.md, "Defaults and the official code").

Each preset has ``shared`` settings (the schedule) and per-method ones.  ``dpsm-ray train`` applies
both under the options given on its command line; a sweep applies the per-method ones only, under
what it searches -- every method of a sweep shares its schedule, so that they are compared on equal
terms.
"""

from __future__ import annotations

# YuanjieSh/DPSM_code at 6bb92ed (train/train_cifar.py and its README's commands): fine-tuning from
# the CE base model's weights with a new optimizer, lr restarted at 0.1 and divided by 10 at epoch
# 25 of 40, batch 128, momentum 0.9, weight decay 1e-4
DPSM_CODE_SHARED = {
    "init": "base", "epochs": 40, "batch_size": 128, "lr": 0.1, "milestones": (25,), "lr_decay": 0.1, "lr_schedule": "step",
    "momentum": 0.9, "weight_decay": 1e-4, "nesterov": False,
}
PRESETS = {
    "official": {
        "shared": DPSM_CODE_SHARED,
        "methods": {
            # CE on the whole batch, each batch split in place into the quantile's and the size
            # loss's halves (train_cifar.py:300, 358-361), T = 1 and lambda 0.05 (the ResNet-110
            # command), q's fixed step 0.01 (--lr_qr)
            "dpsm": {"sigmoid_temperature": 1.0, "conformal_weight": 0.05, "quantile_lr": 0.01, "ce_batch": "full", "dpsm_split": "batch"},
            # the same code's ConfTr and CUT paths (CE on the whole batch, train_cifar.py:196-199,
            # 265-268); its README has no command for them: T and lambda as DPSM's
            "conftr": {"sigmoid_temperature": 1.0, "conformal_weight": 0.05, "conftr_split": "batch"},
            "cut": {"conformal_weight": 0.05, "ce_batch": "full"},
            "ce": {},
            "base": {},
            # ConfTr's own code (google-deepmind/conformal_training, experiments/run_fashion_mnist.py
            # and run.py): from scratch, batch 100, 150 epochs, lr 0.01 divided by 10 at epochs 60, 90
            # and 120, Nesterov momentum 0.9, weight decay 5e-4 * sum of squares (1e-3 as torch's
            # coefficient), T 0.1, size weight 0.01 inside the logarithm, kappa 0, no CE, smooth sort
            # dispersion 0.1
            "conftr_published": {
                "init": "scratch",
                "batch_size": 100,
                "epochs": 150,
                "lr": 0.01,
                "milestones": (60, 90, 120),
                "lr_decay": 0.1,
                "lr_schedule": "step",
                "momentum": 0.9,
                "nesterov": True,
                "weight_decay": 1e-3,
                "sigmoid_temperature": 0.1,
                "conformal_weight": 0.01,
                "size_target": 0.0,
                "ce_weight": 0.0,
                "sort_temperature": 0.1,
            },
        },
    },
}
PRESET_NAMES = tuple(PRESETS)


def preset_values(name: str, method: str, *, schedule: bool = True) -> dict:
    """The settings preset ``name`` gives ``method``: its shared schedule, then the method's own,
    which win (ConfTr as published has a schedule of its own).  ``schedule=False`` (a sweep) gives
    the method's objective settings only."""
    if name not in PRESETS:
        raise ValueError(f"preset must be one of {', '.join(PRESET_NAMES)}; got {name!r}")
    preset = PRESETS[name]
    values = {**preset["shared"], **preset["methods"].get(method, {})}
    return values if schedule else {k: v for k, v in values.items() if k not in preset["shared"]}
