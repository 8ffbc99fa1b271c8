"""The paper's protocol: a cross-entropy base model is trained once per (dataset, model, seed,
recipe), then every method fine-tunes from it.

Base models live in a content-addressed cache: the directory name is the hash of every setting
that determines the base model (its ``TrainConfig`` with the fine-tuning-only knobs reset), so a
second request for the same base model finds it, and any change to the recipe trains a new one.
A cache entry is written to a temporary directory and renamed into place: it is whole or absent.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path

from dpsm_ray.files import cache_home, sha256_file
from dpsm_ray.cards import REFERENCE_METHOD, method_fields
from dpsm_ray.cards import dataset_card
from dpsm_ray.config import TrainConfig, config_specs
from dpsm_ray.storage.layout import BASE_MODELS, CHECKPOINT_FILE, EPOCHS_FILE, MODEL_FILE, RESULT_FILE
from dpsm_ray.train.ray_train import RAY_TRAIN_DIR

# CE training recipes (the official code's CIFAR recipes; the 224-pixel models use
# the standard ImageNet schedule; Fashion-MNIST's MLP ConfTr's; the small models a short
# constant-rate run).
BASE_RECIPES = {
    "resnet110": {"batch_size": 128, "epochs": 164, "lr": 0.1, "milestones": (81, 122)},
    "densenet100": {"batch_size": 64, "epochs": 300, "lr": 0.1, "milestones": (150, 225)},
    "resnet50": {"batch_size": 128, "epochs": 90, "lr": 0.1, "milestones": (30, 60)},
    "densenet121": {"batch_size": 128, "epochs": 90, "lr": 0.1, "milestones": (30, 60)},
    # ConfTr's Fashion-MNIST baseline (Stutz et al. 2022, google-deepmind/conformal_training run.py
    # and experiments/run_fashion_mnist.py): 150 epochs of batch 100 from lr 0.05, divided by 10 at
    # epochs 60, 90 and 120, Nesterov momentum 0.9, weight decay 5e-4 * sum of squares (torch's 1e-3)
    "mlp_bn": {
        "batch_size": 100,
        "epochs": 150,
        "lr": 0.05,
        "milestones": (60, 90, 120),
        "momentum": 0.9,
        "nesterov": True,
        "weight_decay": 1e-3,
    },
}
_SMALL_RECIPE = {"batch_size": 64, "epochs": 30, "lr": 0.05, "milestones": ()}
# Knobs that only matter when fine-tuning: reset so that, e.g., every alpha shares one base model.
# Every method's options (the cards' fields) are among them: a CE run reads none of them, so they
# leave its cache key as they are, but a reset base config cannot differ by one left over.
def _fine_tuning_defaults() -> dict:
    specs = config_specs()
    return {name: specs[name].default
            for name in ("alpha", *sorted(method_fields()), "val_splits", "eval_splits", "eval_scores", "eval_calibrations")}



# What only a run's per-epoch diagnostics read: their sample comes from a generator of its own, so
# the base model's weights are the same whatever it is, and studies that score their diagnostics
# differently (a league's 10000 examples, round two's whole split) share one base model per seed.
_DIAGNOSTICS_DEFAULTS = {"diagnostic_examples": TrainConfig.__dataclass_fields__["diagnostic_examples"].default}


def base_config(config: TrainConfig) -> TrainConfig:
    """The CE run whose final weights ``config`` starts from when ``config.init == "base"``."""
    model = config.resolved_model()
    recipe = dict(BASE_RECIPES.get(model, _SMALL_RECIPE))
    for name in ("batch_size", "epochs", "lr", "milestones"):
        override = getattr(config, f"base_{name}")
        if override is not None:
            recipe[name] = override
    # the optimiser as the fine-tuning runs have it, unless the recipe sets it
    recipe = {"momentum": config.momentum, "nesterov": config.nesterov, "weight_decay": config.weight_decay, **recipe}
    return config.replace(
        method=REFERENCE_METHOD,
        model=model,
        init="scratch",
        init_checkpoint=None,
        lr_decay=0.1,
        lr_schedule="step",
        base_batch_size=None,
        base_epochs=None,
        base_lr=None,
        base_milestones=None,
        **recipe,
        **_fine_tuning_defaults(),
        **_DIAGNOSTICS_DEFAULTS,
    )


def _default_cache_dir() -> Path:
    return cache_home() / BASE_MODELS  # the same layout as a results directory's cache


def cache_entry(config: TrainConfig, cache_dir: str | os.PathLike | None = None) -> Path:
    base = base_config(config)
    root = Path(cache_dir) if cache_dir is not None else _default_cache_dir()
    # data that can change under the same name (a folder, a table): its files' fingerprint too
    card = dataset_card(base.dataset)
    data = f"-{card.fingerprint(base.dataset)}" if card.fingerprint is not None else ""
    # and the pretrained weights' bytes: a backbone retrained at the same path is another base model
    weights = f"-w{sha256_file(base.pretrained_path)[:12]}" if base.pretrained_path and os.path.isfile(base.pretrained_path) else ""
    model = re.sub(r"[^\w.]", "_", base.model)  # torchvision:resnet18, pkg.nets:make -> a folder name
    return root / f"{base.dataset.partition(':')[0]}-{model}-seed{base.seed}-{base.config_hash()}{data}{weights}"


def cached_weights(config: TrainConfig, cache_dir: str | os.PathLike | None = None) -> Path:
    """Where ``config``'s base model keeps its weights in the cache: they exist once it has trained
    (a ``.partial`` entry never holds them there)."""
    return cache_entry(config, cache_dir) / MODEL_FILE


def ensure_base_model(config: TrainConfig, run, cache_dir: str | os.PathLike | None = None, log=print) -> TrainConfig:
    """``config`` pointed at its base model's weights, training the base model first on a cache
    miss.  ``run(base_config, out_dir)`` trains a config and writes its run files to ``out_dir``."""
    if config.init != "base":
        return config
    weights = cached_weights(config, cache_dir)
    entry = weights.parent
    if weights.exists():
        log(f"base model: cache hit, reusing {entry}")
    else:
        base = base_config(config)
        # Trained in a ".partial" directory holding its checkpoint, so an interrupted base
        # training resumes; renamed into place when complete.
        partial = entry.with_name(entry.name + ".partial")
        log(f"base model: cache miss, training {base.model} on {base.dataset} with CE for {base.epochs} epochs -> {entry}")
        started = time.monotonic()
        run(base, partial)
        log(f"base model: trained in {time.monotonic() - started:.0f}s")
        for name in (CHECKPOINT_FILE, EPOCHS_FILE, RESULT_FILE):  # the training run's own files; write_run's stay
            (partial / name).unlink(missing_ok=True)
        shutil.rmtree(partial / RAY_TRAIN_DIR, ignore_errors=True)
        try:
            os.rename(partial, entry)
        except OSError:  # another process completed the same entry first: theirs is as good
            shutil.rmtree(partial, ignore_errors=True)
    return config.replace(init_checkpoint=str(weights))
