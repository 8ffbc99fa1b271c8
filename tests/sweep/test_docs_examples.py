"""docs/extending.md's code, run as written: the method's three blocks in order (its objective, its
card, the registration and a one-trial sweep on digits), and each of the dataset, model and score
blocks on its own -- so an example that lacks an import, or calls what the package no longer has,
fails here."""

import builtins
import re
import sys
from pathlib import Path

import pandas as pd
import pytest

from dpsm_ray.cards import unregister, unregister_method

pytestmark = pytest.mark.ray
PAGE = Path(__file__).resolve().parents[2] / "docs" / "extending.md"


def blocks() -> dict[str, list[str]]:
    """The page's Python blocks under each heading (## or ###)."""
    found, heading = {}, None
    for part in re.split(r"^(#{2,3} .*)$", PAGE.read_text(), flags=re.M):
        if re.match(r"#{2,3} ", part):
            heading = part.lstrip("# ").strip()
        else:
            found.setdefault(heading, []).extend(re.findall(r"```python\n(.*?)```", part, flags=re.S))
    return {heading: code for heading, code in found.items() if code}


def run(code: str, namespace: dict) -> dict:
    exec(compile(code, str(PAGE), "exec"), namespace)
    return namespace


def test_the_pages_blocks_are_where_this_test_looks():
    assert list(blocks()) == ["1. The objective", "2. The card", "3a. A method outside the package", "A dataset", "A model", "A score"]


def test_the_dataset_model_and_score_examples_each_run_alone():
    from dpsm_ray.cards import build_model, load_splits, score_matrix

    import torch

    page = blocks()
    try:
        run(page["A dataset"][0], {"__name__": "docs_dataset"})
        splits = load_splits("blobs", seed=0)
        assert len(splits.train) == 600 and splits.class_names == ("north", "east", "south", "west")
        run(page["A model"][0], {"__name__": "docs_model"})
        assert build_model("linear", 4, input_shape=(6,))(torch.zeros(2, 6)).shape == (2, 4)
        run(page["A score"][0], {"__name__": "docs_score"})
        probs = torch.tensor([[0.7, 0.2, 0.1]])
        assert torch.allclose(score_matrix(probs, "top_gap"), torch.tensor([[0.0, 0.5, 0.6]]))
    finally:
        for kind, name in (("dataset", "blobs"), ("model", "linear"), ("score", "top_gap")):
            unregister(kind, name)


def test_the_method_example_registers_its_card_and_runs_its_one_trial_sweep(ray_session, tmp_path, monkeypatch):
    page = blocks()
    monkeypatch.chdir(tmp_path)
    # print replaced, as Ray Train's and Serve's redirection leave it in a process that ran them (the sweep logs with print)
    original = builtins.print
    monkeypatch.setattr(builtins, "print", lambda *args, **kwargs: original(*args, **kwargs))
    # a module not in sys.modules: Ray's workers get the example's class by value, as from a script's __main__
    namespace = {"__name__": "docs_extending_example"}
    assert "docs_extending_example" not in sys.modules
    try:
        for heading in ("1. The objective", "2. The card", "3a. A method outside the package"):
            (code,) = page[heading]
            run(code, namespace)
    finally:
        unregister_method("confident_ce")
    assert namespace["CARD"].options[0].name == "confidence_power"
    trials = pd.read_parquet(tmp_path / "results" / "confident" / "trials.parquet")
    assert sorted(zip(trials.stage, trials.method)) == [("final", "confident_ce"), ("search", "confident_ce")]
    assert (trials.status == "ok").all() and trials.config_json.str.contains('"confidence_power": 2.0').all()
