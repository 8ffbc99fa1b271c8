"""The CE base-model protocol: trained once per (dataset, model, seed, recipe), then reused."""

import re

import torch

from dpsm_ray.train import TrainConfig, resolve_base_model, run_training
from dpsm_ray.train.base_model import base_config, cache_entry

SMALL = dict(dataset="digits", epochs=2, eval_splits=2, val_splits=2, init="base", base_epochs=2)


def test_a_base_model_is_trained_on_a_miss_and_reused_on_a_hit(tmp_path):
    lines = []
    config = TrainConfig(**SMALL, method="dpsm", cache_dir=str(tmp_path))
    resolved = resolve_base_model(config, log=lines.append)
    assert "cache miss" in lines[0] and "[ce] epoch   2/2" in lines[-2] and "base model: trained in" in lines[-1]  # announced, then trained
    weights = torch.load(resolved.init_checkpoint, weights_only=True)
    # another method, another alpha: the same base model, found in the cache
    again = resolve_base_model(config.replace(method="conftr", alpha=0.2), log=lines.append)
    assert "cache hit" in lines[-1] and again.init_checkpoint == resolved.init_checkpoint
    assert sorted(p.name for p in tmp_path.iterdir()) == [cache_entry(config, tmp_path).name]  # no .partial left
    # a different seed or recipe is a different base model
    assert cache_entry(config.replace(seed=1), tmp_path) != cache_entry(config, tmp_path)
    assert cache_entry(config.replace(base_epochs=3), tmp_path) != cache_entry(config, tmp_path)
    assert set(weights) == set(run_training(config.replace(epochs=1), log=lines.append).model_state)


def test_fine_tuning_starts_from_the_base_weights(tmp_path):
    config = TrainConfig(**SMALL, method="ce", cache_dir=str(tmp_path), lr=1e-9, momentum=0.0, weight_decay=0.0)
    result = run_training(config, log=lambda line: None)
    base = torch.load(resolve_base_model(config, log=lambda line: None).init_checkpoint, weights_only=True)
    assert all(torch.allclose(result.model_state[k], base[k], atol=1e-6) for k in base)  # lr ~ 0: unchanged


def test_the_base_recipe_is_cross_entropy_with_fine_tuning_knobs_reset():
    fine = TrainConfig(**SMALL, method="dpsm", alpha=0.05, conformal_weight=2.0, quantile_lr=0.3)
    base = base_config(fine)
    assert (base.method, base.init, base.epochs, base.model) == ("ce", "scratch", 2, "mlp")
    assert base.alpha == 0.1 and base.conformal_weight == TrainConfig().conformal_weight
    assert base_config(fine.replace(dataset="cifar100", base_epochs=None)).milestones == (81, 122)
    # the fine-tuning run's open choices are not the base recipe's: one base model for all of them
    chosen = fine.replace(lr_schedule="exp", q_init="random", conftr_split="batch", cut_score="aps")
    assert base_config(chosen) == base_config(fine) and base_config(chosen).lr_schedule == "step"


def test_the_diagnostics_sample_leaves_the_base_weights_and_their_cache_entry_as_they_are(tmp_path):
    config = TrainConfig(**SMALL, method="dpsm", cache_dir=str(tmp_path))
    assert cache_entry(config.replace(diagnostic_examples=0), tmp_path) == cache_entry(config, tmp_path)
    # the reason it may: a CE run's weights do not depend on which examples its diagnostics score
    base = base_config(config)
    states = [run_training(base.replace(diagnostic_examples=n), log=lambda line: None).model_state for n in (0, 50)]
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])


def test_a_backbone_retrained_at_the_same_path_is_another_base_model(tmp_path):
    from dpsm_ray.cards import build_model

    path = tmp_path / "backbone.pt"
    config = TrainConfig(dataset="glyphs:classes=8,train=24", model="lenet", method="dpsm", init="base", base_epochs=2,
                         pretrained_path=str(path))
    torch.manual_seed(0)
    torch.save(build_model("lenet", 8, input_shape=(1, 16, 16)).state_dict(), path)
    first = cache_entry(config, tmp_path)
    assert first == cache_entry(config, tmp_path) and re.search(r"-w[0-9a-f]{12}$", first.name)  # the weights' sha256
    torch.manual_seed(1)
    torch.save(build_model("lenet", 8, input_shape=(1, 16, 16)).state_dict(), path)  # the same name, other weights
    assert cache_entry(config, tmp_path) != first
    assert not re.search(r"-w[0-9a-f]{12}$", cache_entry(config.replace(pretrained_path=None), tmp_path).name)
