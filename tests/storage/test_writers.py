"""Parquet files carry their sha256 in a manifest, and a changed byte is named (issue 21, item 9)."""

import math
import subprocess
import sys

import pytest

from dpsm_ray.files import CorruptFileError
from dpsm_ray.storage import writers as store
from dpsm_ray.storage.schema import EVALS
from dpsm_ray.storage.layout import MANIFEST
from dpsm_ray.storage.layout import read_manifest, verify_manifest
from dpsm_ray.storage.writers import write_parquet

ROW = {"sweep": "s", "stage": "final", "trial_id": "t", "run_id": "r", "dataset": "digits", "model": "mlp", "method": "dpsm", "seed": 0,
       "score": "hps", "split": 0, "alpha": 0.1, "n_cal": 200, "n_test": 297, "q": 0.9, "coverage": 0.9, "set_size": 1.1,
       "covgap": 3.0, "sscv": 0.05, "wsc": 0.85, "accuracy": 0.95}


def flip_a_byte(path, at: float = 0.5) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * at)] ^= 0x01
    path.write_bytes(bytes(data))


def test_every_parquet_file_s_checksum_is_recorded_and_checked(tmp_path):
    import hashlib

    write_parquet(tmp_path / "evals.parquet", [ROW], EVALS)
    entry = read_manifest(tmp_path)["evals.parquet"]
    assert entry == {"sha256": hashlib.sha256((tmp_path / "evals.parquet").read_bytes()).hexdigest(), "replaces": None}
    assert verify_manifest(tmp_path) == []
    flip_a_byte(tmp_path / "evals.parquet")
    with pytest.raises(CorruptFileError, match=r"evals.parquet does not match the sha256 recorded in .*manifest.json"):
        verify_manifest(tmp_path)


def test_a_write_killed_between_the_manifest_and_the_file_leaves_a_version_the_manifest_accepts(tmp_path, monkeypatch):
    write_parquet(tmp_path / "evals.parquet", [ROW], EVALS)
    first = (tmp_path / "evals.parquet").read_bytes()

    def killed(path, data):
        if path.name == "evals.parquet":
            raise KeyboardInterrupt  # the manifest is already written: the rename never happens
        return write_bytes(path, data)

    write_bytes = store.write_bytes
    monkeypatch.setattr(store, "write_bytes", killed)
    with pytest.raises(KeyboardInterrupt):
        write_parquet(tmp_path / "evals.parquet", [{**ROW, "set_size": 2.2}], EVALS)
    assert (tmp_path / "evals.parquet").read_bytes() == first
    assert verify_manifest(tmp_path) == []  # the previous version is still a version the service wrote


def test_files_written_before_checksums_existed_are_reported_not_refused(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"x": [1]}), tmp_path / "old.parquet")
    assert verify_manifest(tmp_path) == ["old.parquet"]


def test_the_report_refuses_a_changed_results_file_naming_it(tmp_path):
    """Issue 21: a one-byte flip in evals.parquet changed the report's headline silently."""
    write_parquet(tmp_path / "evals.parquet", [ROW, {**ROW, "method": "ce", "set_size": 1.3}], EVALS)
    flip_a_byte(tmp_path / "evals.parquet", at=0.3)
    run = subprocess.run([sys.executable, "-m", "dpsm_ray.cli", "report", str(tmp_path)], capture_output=True, text=True)
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    assert run.stderr.strip().count("\n") == 0 and f"{tmp_path / 'evals.parquet'} does not match the sha256" in run.stderr


def test_the_report_names_a_results_file_it_cannot_read(tmp_path):
    (tmp_path / "evals.parquet").write_bytes(b"PAR1 not really parquet")  # no manifest: an old or hand-made directory
    run = subprocess.run([sys.executable, "-m", "dpsm_ray.cli", "report", str(tmp_path)], capture_output=True, text=True)
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    assert f"{tmp_path / 'evals.parquet'} is not a readable Parquet file" in run.stderr
    assert not (tmp_path / MANIFEST).exists()


# --- Results: the one reader of a results directory, and the coverage floor -----------------------------------------------------

def test_the_coverage_floor_is_one_rule_for_sweeps_and_studies():
    from dpsm_ray.storage.layout import CoverageFloor

    floor = CoverageFloor(0.1, 0.02)
    assert math.isclose(floor.value, 0.88) and f"{floor:g}" == "0.88"
    assert floor.feasible(0.88) and floor.feasible(0.95) and floor.feasible(0.879) is False
    assert floor.feasible(None) is None and floor.feasible(float("nan")) is None  # a failed trial has no coverage
    assert CoverageFloor.of({"base": {"alpha": 0.05}, "coverage_slack": 0.01}) == CoverageFloor(0.05, 0.01)
    assert CoverageFloor.of({"common": {"alpha": 0.1}}).value == 0.9  # a study's arms take no slack


def test_results_reads_every_file_of_a_sweep_once_and_names_a_corrupt_one(tmp_path):
    from fabricated import fabricate

    from dpsm_ray.files import CorruptFileError
    from dpsm_ray.storage.layout import CoverageFloor, Results

    reader = Results(fabricate(tmp_path / "r"))
    assert reader.sweep["name"] == "hand" and reader.floor == CoverageFloor(0.1, 0.02) and reader.unrecorded() == []
    assert set(reader.trials.stage) == {"search", "final"} and set(reader.final("trials").stage) == {"final"}
    assert reader.evals is reader.frame("evals") and len(reader.final("evals")) == len(reader.evals)
    assert Results(tmp_path / "empty").evals.empty and Results(tmp_path / "empty").settings is None
    reader.path("epochs").write_bytes(b"not parquet")
    with pytest.raises(CorruptFileError, match="epochs.parquet does not match the sha256"):
        Results(reader.directory).unrecorded()
    with pytest.raises(CorruptFileError, match="epochs.parquet is not a readable Parquet file"):
        Results(reader.directory).epochs
