"""A sweep's CE base models train as Ray tasks holding a trial's resources, not in the driver: on a
cluster the driver's node has no GPU, and the final stage's seeds train side by side."""

import json
import os
from pathlib import Path

import pytest

from dpsm_ray.config import TrainConfig
from dpsm_ray.sweep.driver import SweepSpec, with_base_models
from dpsm_ray.train.base_model import cache_entry
from dpsm_ray.train.lines import EpochLine

pytestmark = pytest.mark.ray


def test_missing_base_models_train_as_ray_tasks_and_cached_ones_are_reused(ray_session, tmp_path):
    base = TrainConfig(dataset="digits", init="base", base_epochs=2, epochs=1, val_splits=2, eval_splits=2)
    spec = SweepSpec(name="tiny", base=base, methods=("ce",))
    lines = []
    bases = with_base_models(spec, [0, 1], tmp_path, lines.append)
    assert lines[0] == "base models: training 2 (seeds 0, 1) as Ray tasks holding a trial's resources (cpu 1) each, as many at once as fit"
    ended = [line for line in lines if line.startswith("base model: trained in")]
    assert len(ended) == 2 and {"seed 0 (", "seed 1 ("} <= {line.split(", ", 1)[1][:8] for line in ended}
    assert all(f"process {os.getpid()} " not in line for line in ended)  # not in this (the driver's) process
    for seed in (0, 1):
        entry = cache_entry(spec.base.replace(seed=seed), tmp_path / "base_models")
        assert bases[seed].init_checkpoint == str(entry / "model.pt") and Path(bases[seed].init_checkpoint).is_file()
        assert bases[seed].seed == seed and bases[seed].cache_dir == str(tmp_path / "base_models")
        # trained as a trial trains: one torch thread for its one CPU
        assert json.loads((entry / "config.json").read_text())["runtime"]["torch_threads"] == 1

    # cached: found, no task
    again = []
    assert with_base_models(spec, [1, 0], tmp_path, again.append) == {1: bases[1], 0: bases[0]}
    assert len(again) == 2 and all("cache hit" in line for line in again)

    # one missing among cached ones: its own lines, epochs with their numbers, as if it trained here
    one = []
    with_base_models(spec, [0, 2], tmp_path, one.append)
    assert "cache hit" in one[0] and one[1] == "base model: seed 2 trains as a Ray task holding a trial's resources (cpu 1)"
    epochs = [line for line in one if isinstance(line, EpochLine)]
    assert [line.epoch for line in epochs] == [1, 2] and epochs[-1].method == "ce" and epochs[-1].epochs == 2
    assert any("cache miss" in line for line in one) and one[-1].startswith("base model: trained in")
    assert sum("cache hit" in line for line in one) == 1


def test_a_base_model_that_fails_in_its_task_fails_as_it_would_in_the_driver(ray_session, tmp_path):
    from dpsm_ray.train.loop import DivergedError

    base = TrainConfig(dataset="digits", init="base", base_epochs=1, base_lr=1e6, epochs=1, val_splits=2, eval_splits=2)
    with pytest.raises(DivergedError):
        with_base_models(SweepSpec(name="tiny", base=base, methods=("ce",)), [0], tmp_path, lambda line: None)
    assert not any((tmp_path / "base_models").glob("*/model.pt"))
