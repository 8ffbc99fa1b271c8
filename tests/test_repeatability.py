"""Repeatability: under the pinned settings -- one device, one torch thread, the same library
versions -- one configuration trained twice gives the same rows bit for bit, and each run's
config.json records those settings (docs/fidelity.md, "Repeatability")."""

import json
import platform

import numpy
import pandas as pd
import pytest
import torch

from dpsm_ray import __version__
from dpsm_ray.cli import main
from dpsm_ray.storage.layout import PARQUET
from dpsm_ray.storage.writers import cpu_model

TIMES = ("epoch_seconds", "train_seconds", "diagnostics_seconds", "validation_seconds")  # wall time: the one thing allowed to differ
ARM = ["train", "--dataset", "glyphs:classes=8,train=24", "--model", "lenet", "--method", "dpsm", "--epochs", "3", "--batch-size", "32",
       "--sigmoid-temperature", "0.1", "--conformal-weight", "0.5", "--eval-splits", "3", "--data-workers", "0"]


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_one_arm_trained_twice_under_the_pinned_settings_gives_identical_rows(tmp_path, one_thread):
    runs = [tmp_path / "first", tmp_path / "second"]
    for out in runs:
        assert main([*ARM, "--out", str(out)]) == 0
    for name in ("epochs", "evals", "classes"):
        first, second = (pd.read_parquet(out / PARQUET[name]) for out in runs)
        first, second = (frame.drop(columns=[c for c in TIMES if c in frame.columns]) for frame in (first, second))
        assert len(first) > 0
        pd.testing.assert_frame_equal(first, second, check_exact=True)
    weights = [torch.load(out / "model.pt", weights_only=True) for out in runs]
    assert weights[0].keys() == weights[1].keys() and all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    epochs = pd.read_parquet(runs[0] / PARQUET["epochs"])
    assert epochs.q.notna().all() and epochs.q.nunique() > 1  # DPSM's learned quantile moved, and moved the same way twice
    records = [json.loads((out / "config.json").read_text())["runtime"] for out in runs]
    assert records[0] == records[1] == {
        "device": "cpu", "cpu": cpu_model(), "torch_threads": 1, "python": platform.python_version(), "torch": torch.__version__,
        "numpy": numpy.__version__, "dpsm_ray": __version__,
    }
