"""Atomic writes, checked JSON, a full disk named, and what a killed writer leaves."""

import errno
import json
import os

import pytest

from dpsm_ray.files import (
    CorruptFileError, DiskFullError, atomic_write, is_disk_full, read_checked_json, remove_temporaries, temporaries, write_bytes,
    write_checked_json,
)


def test_a_write_that_fails_half_way_leaves_the_previous_version_and_no_temporary_file(tmp_path):
    target = tmp_path / "results.bin"
    write_bytes(target, b"version 1")

    def half_then_fail(handle):
        handle.write(b"vers")
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError, match="killed"):
        atomic_write(target, half_then_fail)
    assert target.read_bytes() == b"version 1"
    assert list(tmp_path.iterdir()) == [target]


def test_a_full_disk_names_the_path_and_the_free_space(tmp_path, monkeypatch):
    def no_space(descriptor):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", no_space)
    with pytest.raises(DiskFullError) as error:
        write_bytes(tmp_path / "trials.parquet", b"rows")
    assert str(error.value).startswith(f"no space left on the device of {tmp_path / 'trials.parquet'} (") and " free)" in str(error.value)
    assert error.value.errno == errno.ENOSPC and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("error, full", [
    (OSError(errno.ENOSPC, "No space left on device"), True),
    (OSError(errno.EDQUOT, "Disk quota exceeded"), True),
    (RuntimeError("(sqlite3.OperationalError) database or disk is full"), True),
    ("Failure # 1\nTraceback ...\ndpsm_ray.files.DiskFullError: no space left on the device of /r/x", True),
    (OSError(errno.EACCES, "Permission denied"), False),
    (RuntimeError("training loss is nan"), False),
    ("dpsm_ray.train.loop.DivergedError: training loss is nan", False),
])
def test_a_full_disk_is_recognised_through_wrappers_and_text(error, full):
    assert is_disk_full(error) is full


def test_a_full_disk_is_recognised_in_an_exception_s_cause():
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as inner:
            raise RuntimeError("Tune failed to save") from inner
    except RuntimeError as outer:
        assert is_disk_full(outer)


def test_checked_json_round_trips_and_names_a_changed_or_truncated_file(tmp_path):
    path = tmp_path / "record.json"
    payload = {"status": "ok", "metrics": {"val_set_size": 1.25, "q": float("inf"), "lower": float("nan")}, "index": 3}
    write_checked_json(path, payload)
    back = read_checked_json(path)
    assert back["status"] == "ok" and back["metrics"]["q"] == float("inf") and back["metrics"]["lower"] != back["metrics"]["lower"]
    text = path.read_text()
    path.write_text(text.replace("1.25", "1.35"))  # one changed digit: still valid JSON
    with pytest.raises(CorruptFileError, match=r"record.json does not match the sha256 recorded in it"):
        read_checked_json(path)
    path.write_text(text[: len(text) // 2])
    with pytest.raises(CorruptFileError, match="record.json is not a readable record"):
        read_checked_json(path)
    path.write_text(json.dumps({"some": "other json"}))
    with pytest.raises(CorruptFileError, match="not a readable record"):
        read_checked_json(path)


def test_temporaries_of_killed_writers_are_found_and_removed_outside_skipped_directories(tmp_path):
    (tmp_path / "runs" / "final" / "0000").mkdir(parents=True)
    (tmp_path / "tune" / "final").mkdir(parents=True)
    left = [tmp_path / ".epochs.parquet.4242.tmp", tmp_path / "runs" / "final" / "0000" / ".checkpoint.pt.77.tmp"]
    kept = [tmp_path / "epochs.parquet", tmp_path / "tune" / "final" / ".result.json.5.tmp", tmp_path / "notes.tmp", tmp_path / ".hidden"]
    for path in left + kept:
        path.write_text("x")
    assert sorted(temporaries(tmp_path, skip=("tune",))) == sorted(left)
    assert sorted(remove_temporaries(tmp_path, skip=("tune",))) == sorted(left)
    assert all(not p.exists() for p in left) and all(p.exists() for p in kept)


def test_the_errors_survive_the_copies_and_pickles_ray_makes_of_a_trial_s_exception(tmp_path):
    import copy
    import pickle

    full = DiskFullError(tmp_path / "x")
    for clone in (copy.copy(full), pickle.loads(pickle.dumps(full))):
        assert type(clone) is DiskFullError and str(clone) == str(full) and clone.path == full.path and clone.errno == errno.ENOSPC
    corrupt = CorruptFileError(tmp_path / "y", "is broken")
    for clone in (copy.copy(corrupt), pickle.loads(pickle.dumps(corrupt))):
        assert type(clone) is CorruptFileError and str(clone) == f"{tmp_path / 'y'} is broken" and clone.path == corrupt.path
