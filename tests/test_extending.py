"""docs/extending.md's file counts, held against the package: in a copy of it, a method, a score and a
dataset are added inside the package the way the page says -- each touching exactly the files it
counts -- and one ``dpsm-ray train`` of the new method on the new dataset, evaluated with the new
score, runs in the copy.  A change that makes an addition need another file fails here until the
page says so."""

import filecmp
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORDS = {"Two": 2, "Three": 3, "Four": 4, "Five": 5}

OBJECTIVE = '''"""Half CE: cross-entropy on both halves of the batch, scaled by an option of its own (a stand-in for a new method)."""

import torch

from dpsm_ray.objectives.base import Objective, ObjectiveOutput, cross_entropy


class HalfCE(Objective):
    def __init__(self, *, ce_share: float = 0.5, **kwargs) -> None:
        super().__init__(**kwargs)
        self.ce_share = ce_share

    def __call__(self, logits1, labels1, logits2, labels2) -> ObjectiveOutput:
        ce = self.ce_share * cross_entropy(torch.cat([logits1, logits2]), torch.cat([labels1, labels2]))
        return self.output(ce, torch.zeros((), device=ce.device))
'''
METHOD_CARD = '''_BUILT_IN_CARDS = (
    MethodCard("half_ce", "Half CE", "dpsm_ray.objectives.half_ce:HalfCE", options=(
        MethodOption("ce_share", 0.5, "Half CE's share of the cross-entropy, in (0, 1]", "must be in (0, 1]", lambda v: 0 < v <= 1),
    )),'''
SCORE = '''

def top_gap_matrix(probs: torch.Tensor) -> torch.Tensor:
    """The top probability's lead over p_y."""
    return probs.amax(dim=1, keepdim=True) - probs
'''
SCORE_CARD = '''def _top_gap(probs, u=None):
    from dpsm_ray.conformal.scores import top_gap_matrix

    return top_gap_matrix(probs)


for _card in (
    ScoreCard("top_gap", "the top probability's lead", _top_gap),
    ScoreCard('''
LOADER = '''"""Four Gaussian blobs in six dimensions (a stand-in for a new dataset)."""

import torch

from dpsm_ray.facts import BLOBS_SIZES
from dpsm_ray.data.tabular import from_tensors


def load_blobs(seed: int):
    generator = torch.Generator().manual_seed(seed)
    labels = torch.arange(sum(BLOBS_SIZES.values())) % 4
    inputs = 3 * torch.randn(4, 6, generator=generator)[labels] + torch.randn(len(labels), 6, generator=generator)
    return from_tensors("blobs", inputs, labels, BLOBS_SIZES, seed)
'''
DATASET_CARD = '''def _load_blobs(spec, *, seed, **_):
    from dpsm_ray.data.blobs import load_blobs

    return load_blobs(seed)


for _card in (
    DatasetCard("blobs", "four Gaussian blobs", lambda spec: dict(facts.BLOBS_SIZES), _load_blobs, "mlp"),
    DatasetCard('''
TEST = '''def test_{name}():
    from dpsm_ray.cards import {reader}

    assert "{name}" in {reader}()
'''


def insert_before(path: Path, anchor: str, text: str) -> None:
    source = path.read_text()
    assert source.count(anchor) == 1, (path, anchor)
    path.write_text(source.replace(anchor, text, 1))


def changed_files(original: Path, copy: Path) -> set[str]:
    """Files of ``copy`` new or different from ``original`` (relative paths), caches left out."""
    changed = set()
    for directory, subdirectories, names in os.walk(copy):
        subdirectories[:] = [d for d in subdirectories if d != "__pycache__"]
        for name in names:
            mine = Path(directory) / name
            theirs = original / mine.relative_to(copy)
            if not theirs.exists() or not filecmp.cmp(mine, theirs, shallow=False):
                changed.add(str(mine.relative_to(copy)))
    return changed


def documented_count(pattern: str) -> int:
    match = re.search(rf"\*\*(\w+) files\*\*{pattern}", (ROOT / "docs" / "extending.md").read_text())
    assert match, pattern
    return WORDS[match.group(1)]


def test_a_method_a_score_and_a_dataset_take_the_files_docs_extending_md_counts(tmp_path):
    copy = tmp_path / "repo"
    shutil.copytree(ROOT / "dpsm_ray", copy / "dpsm_ray", ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "tests" / "objectives").mkdir(parents=True)
    (copy / "tests" / "conformal").mkdir(parents=True)
    (copy / "tests" / "data").mkdir(parents=True)
    package = copy / "dpsm_ray"
    steps = {}

    before = changed_files(ROOT, copy)
    (package / "objectives" / "half_ce.py").write_text(OBJECTIVE)
    insert_before(package / "cards" / "methods.py", "_BUILT_IN_CARDS = (", METHOD_CARD)
    (copy / "tests" / "objectives" / "test_half_ce.py").write_text(TEST.format(name="half_ce", reader="method_names"))
    steps["method"] = changed_files(ROOT, copy) - before

    before |= steps["method"]
    with (package / "conformal" / "scores.py").open("a") as scores:
        scores.write(SCORE)
    insert_before(package / "cards" / "scores.py", "for _card in (\n    ScoreCard(", SCORE_CARD)
    (copy / "tests" / "conformal" / "test_top_gap.py").write_text(TEST.format(name="top_gap", reader="score_names"))
    steps["score"] = changed_files(ROOT, copy) - before

    before |= steps["score"]
    (package / "data" / "blobs.py").write_text(LOADER)
    with (package / "facts.py").open("a") as facts:
        facts.write('\nBLOBS_SIZES = {"train": 600, "val": 200, "cal": 200, "test": 200}\n')
    insert_before(package / "cards" / "datasets.py", "for _card in (\n    DatasetCard(", DATASET_CARD)
    (copy / "tests" / "data" / "test_blobs.py").write_text(TEST.format(name="blobs", reader="dataset_names"))
    steps["dataset"] = changed_files(ROOT, copy) - before

    assert len(steps["method"]) == documented_count(r": the objective"), steps["method"]
    assert len(steps["score"]) == documented_count(r" for a model or a score"), steps["score"]
    assert len(steps["dataset"]) == documented_count(r" for a dataset"), steps["dataset"]

    # the three work together, in the copy alone: its own tests, and a run of the new method on the new data with the new score
    env = {**os.environ, "PYTHONPATH": str(copy)}
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "--noconftest", str(copy / "tests")],
                           cwd=copy, env=env, capture_output=True, text=True, timeout=300)
    assert tests.returncode == 0 and "3 passed" in tests.stdout, tests.stdout + tests.stderr
    run = subprocess.run([sys.executable, "-m", "dpsm_ray.cli", "train", "--dataset", "blobs", "--method", "half_ce", "--ce-share", "0.25", "--epochs", "2",
                          "--eval-scores", "hps", "top_gap", "--eval-splits", "2", "--out", str(tmp_path / "run")], cwd=copy, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert json.loads((tmp_path / "run" / "config.json").read_text())["ce_share"] == 0.25  # its own option, from the command line
    assert "half_ce on blobs" in run.stdout and re.search(r"^top_gap ", run.stdout, re.M), run.stdout
