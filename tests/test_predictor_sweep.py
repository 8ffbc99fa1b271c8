"""A sweep's predictors end to end: one tiny digits sweep (as ``sweeps/digits.py`` runs it: CE and
DPSM, one Optuna trial each, one final seed, 2 epochs, trials in their own processes) shared by
the module; the round trip against evals.parquet, resuming, ``dpsm-ray export``, the README's
commands, and ``dpsm-ray serve`` for real on 127.0.0.1.
"""

import contextlib
import json
import os
import queue
import re
import runpy
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy
import pandas as pd
import pytest
import torch

from dpsm_ray import reaper
from dpsm_ray.cli import main
from dpsm_ray.conformal import resplit
from dpsm_ray.cards import load_splits
from dpsm_ray.predict.export import CHOICE_RULE
from dpsm_ray.storage.layout import INDEX_FILE, PREDICTORS
from dpsm_ray.files import read_checked_json, sha256_file
from dpsm_ray.predict.predictor import Predictor
from dpsm_ray.sweep import run_sweep
from dpsm_ray.sweep.cli import build_parser, spec_from_args
from dpsm_ray.config import TrainConfig

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parents[1]
SERVE_START_S = 240  # Ray and Serve take ~35 s to start on 2 busy cores


@pytest.fixture(scope="module")
def sweep(ray_session, tmp_path_factory):
    """``results/digits`` of ``python sweeps/digits.py --trials 1 --final-seeds 1 --epochs 2 ...``."""
    defaults = runpy.run_path(str(ROOT / "sweeps" / "digits.py"))["DEFAULTS"]
    home = tmp_path_factory.mktemp("home")
    results = home / "results" / "digits"
    argv = ["--results-dir", str(results), "--trials", "1", "--final-seeds", "1", "--epochs", "2", "--base-epochs", "2", "--methods", "ce,dpsm",
            "--workers", "0"]
    spec = spec_from_args("digits", build_parser("digits", "", defaults).parse_args(argv), defaults)
    lines = []
    run_sweep(spec, results, log=lines.append)
    return spec, results, lines


def raw_pool(config: TrainConfig):
    """The raw inputs, labels and ids of the pooled calibration + test splits, in evaluation order."""
    data = load_splits(config.dataset, seed=config.data_seed())
    x = torch.cat([data.cal.source.inputs[data.cal.ids], data.test.source.inputs[data.test.ids]])
    return data, x, torch.cat([data.cal.labels, data.test.labels]), torch.cat([data.cal.ids, data.test.ids])


def test_every_final_model_is_a_predictor_that_reproduces_its_evals_rows(sweep):
    """Done-when: each predictor, recalibrated on the calibration part of a re-split recorded in
    evals.parquet, gives that row's coverage and set size (and q) on its test part."""
    _, results, _ = sweep
    index = read_checked_json(results / PREDICTORS / INDEX_FILE)
    evals, classes = pd.read_parquet(results / "evals.parquet"), pd.read_parquet(results / "classes.parquet")
    # the CE base model, evaluated as it is beside the fine-tuned models, is a predictor too
    assert sorted(e["name"] for e in index["predictors"]) == ["base-seed0", "ce-seed0", "dpsm-seed0"]
    assert sorted(entry["run_id"] for entry in index["predictors"]) == sorted(evals.run_id.unique())
    worst = 0.0
    for entry in index["predictors"]:
        predictor = Predictor.load(results / entry["directory"])
        config = TrainConfig.from_dict(predictor.info["training_config"])
        data, x, y, ids = raw_pool(config)
        rows = evals[evals.run_id == entry["run_id"]]
        assert len(rows) == len(config.eval_scores) * rows.calibration.nunique() * config.eval_splits  # scores x calibrations x re-splits
        cal, test = resplit(len(x), config.eval_splits, len(data.cal) / len(x), config.seed)
        for row in rows.itertuples():
            part = predictor.recalibrate(x[cal[row.split]], y[cal[row.split]], example_ids=ids[cal[row.split]])
            measured = part.evaluate(x[test[row.split]], y[test[row.split]], calibration=row.calibration,
                                     example_ids=ids[test[row.split]])[row.score]
            worst = max(worst, abs(measured["coverage"] - row.coverage), abs(measured["set_size"] - row.set_size))
            if row.calibration == "marginal":
                worst = max(worst, abs(part.thresholds[row.score] - row.q))
            else:  # each class's threshold is classes.parquet's
                class_q = classes[(classes.run_id == entry["run_id"]) & (classes.score == row.score) & (classes.calibration == "class")
                                  & (classes.split == row.split)].sort_values("label").q.to_numpy()
                assert numpy.allclose(part.class_thresholds(row.score).numpy(), class_q, rtol=0, atol=1e-6)
        # the info's test figures are the predictor's own on the test split, calibrated on the calibration split
        n_cal = len(data.cal)
        assert predictor.evaluate(x[n_cal:], y[n_cal:], example_ids=ids[n_cal:]) == predictor.info["test"]["scores"]
        assert predictor.info["calibration"]["points"] == n_cal and predictor.info["model"]["architecture"] == "mlp"
    print(f"round trip: largest difference from evals.parquet over {len(evals)} rows: {worst:.3g}")
    assert worst <= 1e-6


def test_the_index_and_the_report_name_each_method_s_choice(sweep):
    _, results, lines = sweep
    index = read_checked_json(results / PREDICTORS / INDEX_FILE)
    assert index["rule"] == CHOICE_RULE and index["chosen"] == {"base": "base-seed0", "ce": "ce-seed0", "dpsm": "dpsm-seed0"}
    trials = pd.read_parquet(results / "trials.parquet")
    for entry in index["predictors"]:  # the validation figures the choice reads are the final trials' own
        row = trials[(trials.stage == "final") & (trials.run_id == entry["run_id"])].iloc[0]
        if entry["method"] == "base":  # trained no epoch: no validation figures
            assert entry["val_set_size"] is None and pd.isna(row.val_set_size)
        else:
            assert entry["val_set_size"] == row.val_set_size and entry["val_coverage"] == row.val_coverage
    report = (results / "report.md").read_text()
    assert "## Predictors" in report and "`predictors/dpsm-seed0`" in report and "`predictors/ce-seed0`" in report
    assert any("] predictors chosen per method: " in line and "dpsm-seed0" in line and str(results / PREDICTORS) in line for line in lines)


def test_the_sweep_writes_its_predictors_in_ray_tasks_not_in_the_driver(sweep):
    """On a cluster the driver's node has no GPU: each predictor's forward passes run where a trial's would."""
    _, results, lines = sweep
    said = [line.split("] ", 1)[1] for line in lines if "] predictors: " in line]
    assert said[:2] == [f"predictors: writing 3 final models as conformal predictors under {results / PREDICTORS}",
                        "predictors: 3 Ray tasks holding a trial's resources (cpu 1) each, as many at once as fit"]
    written = [line for line in said if " written (process " in line]
    assert written and written[-1].endswith(", 3 of 3") and all(f"(process {os.getpid()} " not in line for line in written)


def test_a_resumed_sweep_keeps_its_predictors_and_rebuilds_a_missing_one(sweep, tmp_path):
    spec, original, _ = sweep
    results = tmp_path / "digits"
    shutil.copytree(original, results, ignore=shutil.ignore_patterns(".lock"))
    files = sorted(p for p in (results / PREDICTORS).rglob("*") if p.is_file() and p.name != INDEX_FILE)
    before = {p: (p.stat().st_mtime_ns, sha256_file(p)) for p in files}
    lines = []
    run_sweep(spec, results, resume=True, log=lines.append)
    assert {p: (p.stat().st_mtime_ns, sha256_file(p)) for p in files} == before
    assert not [line for line in lines if "] exported " in line]  # nothing exported again
    info = read_checked_json(results / PREDICTORS / "ce-seed0" / "predictor.json")
    shutil.rmtree(results / PREDICTORS / "ce-seed0")
    run_sweep(spec, results, resume=True, log=lines.append)
    assert [line.split("] ", 1)[1] for line in lines if "] exported " in line] == [f"exported 1 final model as conformal predictors under {results / PREDICTORS}: ce-seed0"]
    again = read_checked_json(results / PREDICTORS / "ce-seed0" / "predictor.json")
    assert {k: again[k] for k in ("run_id", "scores", "test", "input")} == {k: info[k] for k in ("run_id", "scores", "test", "input")}


def test_export_copies_the_chosen_predictor_out_with_its_provenance(sweep, tmp_path, capsys):
    _, results, _ = sweep
    assert main(["export", str(results), "--method", "dpsm", "--out", str(tmp_path / "dpsm")]) == 0
    info = read_checked_json(tmp_path / "dpsm" / "predictor.json")
    source = read_checked_json(results / PREDICTORS / "dpsm-seed0" / "predictor.json")
    assert info["provenance"]["chosen_by"] == CHOICE_RULE and info["provenance"]["exported_from"] == str(results / PREDICTORS / "dpsm-seed0")
    assert info["provenance"]["trial_index"] == source["provenance"]["trial_index"] and info["scores"] == source["scores"]
    assert info["weights"]["sha256"] == source["weights"]["sha256"]
    assert main(["export", str(results), "--method", "ce", "--seed", "0", "--out", str(tmp_path / "ce")]) == 0
    assert read_checked_json(tmp_path / "ce" / "predictor.json")["provenance"]["chosen_by"] == "--seed 0"
    for argv, message in [
        (["--method", "cut"], "--method cut: the sweep in .* has no final model of it \\(it has: base, ce, dpsm\\)"),
        (["--method", "dpsm", "--seed", "7"], "--seed 7: the sweep's final dpsm models have the seeds 0"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            main(["export", str(results), *argv, "--out", str(tmp_path / "x")])
        assert exit_info.value.code == 2
        assert re.search(message, capsys.readouterr().err)


def test_export_builds_the_predictors_of_a_sweep_finished_without_them(sweep, tmp_path, capsys):
    _, original, _ = sweep
    results = tmp_path / "older"
    shutil.copytree(original, results, ignore=shutil.ignore_patterns(".lock", PREDICTORS))
    assert main(["export", str(results), "--method", "dpsm", "--out", str(tmp_path / "dpsm")]) == 0
    assert "has no predictors yet: exporting its final models" in capsys.readouterr().out
    rebuilt = read_checked_json(tmp_path / "dpsm" / "predictor.json")
    assert rebuilt["scores"] == read_checked_json(original / PREDICTORS / "dpsm-seed0" / "predictor.json")["scores"]
    for name in ("base-seed0", "ce-seed0", "dpsm-seed0"):  # built here, one after another, as the sweep's Ray tasks built them
        here, there = (read_checked_json(r / PREDICTORS / name / "predictor.json") for r in (results, original))
        assert {k: here[k] for k in ("run_id", "scores", "test")} == {k: there[k] for k in ("run_id", "scores", "test")}


# ----------------------------------------------------------------------------- serving


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def session_members(session: int) -> list[int]:
    """Processes of the session ``session`` (the served command started one of its own)."""
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[3]) == session and reaper.alive(int(entry.name)):
                    members.append(int(entry.name))
            except (OSError, ValueError, IndexError):
                continue
    return members


class Served:
    """A ``dpsm-ray serve`` command running in a session of its own, its output read by a thread."""

    def __init__(self, command: str, cwd: Path, port: int) -> None:
        self.token: str | None = None  # sent as a bearer token when set
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # the dpsm-ray of this environment
        self.port = port
        self.process = subprocess.Popen(["bash", "-c", f"exec {command}"], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True, start_new_session=True)
        self.output: list[str] = []
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.output.append(line)
            self.lines.put(line)

    def wait_until_serving(self) -> None:
        deadline = time.monotonic() + SERVE_START_S
        while time.monotonic() < deadline:
            try:
                if self.lines.get(timeout=1).startswith("serving "):
                    return
            except queue.Empty:
                assert self.process.poll() is None, "".join(self.output)[-3000:]
        raise AssertionError(f"not serving after {SERVE_START_S}s:\n{''.join(self.output)[-3000:]}")

    def request(self, path: str, body: bytes | None = None, token: str | None = None) -> tuple[int, dict]:
        headers = {"Content-Type": "application/json"}
        if token or self.token:
            headers["Authorization"] = f"Bearer {token or self.token}"
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=body, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read())

    def post(self, payload) -> tuple[int, dict]:
        return self.request("/predict", json.dumps(payload).encode())

    def stop(self) -> None:
        """SIGTERM, then: exit status 0, nothing of its session or its Ray left, the port closed.
        Whatever of this fails, the command and its session are killed."""
        try:
            raylets = reaper.children_named(self.process.pid, "raylet")
            assert raylets, "the served command started no Ray of its own"
            self.process.send_signal(signal.SIGTERM)
            assert self.process.wait(timeout=120) == 0, "".join(self.output)[-3000:]
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and (session_members(self.process.pid) or reaper.belonging_to(raylets[0])):
                time.sleep(0.5)
            assert session_members(self.process.pid) == [] and reaper.belonging_to(raylets[0]) == []
        finally:
            for pid in session_members(self.process.pid):  # the command itself, if it still runs, and what it started there
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            self.process.wait()
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", self.port), timeout=2).close()


@pytest.fixture(scope="module")
def exported(sweep, tmp_path_factory):
    out = tmp_path_factory.mktemp("exported") / "dpsm"
    assert main(["export", str(sweep[1]), "--method", "dpsm", "--out", str(out)]) == 0
    return out


def test_serve_answers_like_predict_sets_refuses_bad_requests_and_stops_cleanly(exported, tmp_path):
    """Served to the network (--host 0.0.0.0): every request but GET /health needs the bearer token
    it generates into --token-file."""
    predictor = Predictor.load(exported, device="cpu")
    x = load_splits("digits", seed=0).test.source.inputs[:40]
    port, token_file = free_port(), tmp_path / "token"
    served = Served(f"dpsm-ray serve {shlex.quote(str(exported))} --host 0.0.0.0 --port {port} --token-file {token_file}", tmp_path, port)
    try:
        served.wait_until_serving()
        status, health = served.request("/health")  # no token needed
        assert status == 200 and health["status"] == "ok" and health["run_id"] == predictor.info["run_id"] and health["input_shape"] == [1, 8, 8]
        token = token_file.read_text().strip()
        assert token_file.stat().st_mode & 0o077 == 0 and token not in "".join(served.output)  # never printed
        for path, body, sent in (("/predict", json.dumps({"inputs": x[:2].tolist()}).encode(), None), ("/predict", b"{}", "wrong-token-0123456789"),
                                 ("/nowhere", None, None)):
            status, answer = served.request(path, body, token=sent)
            assert status == 401 and "Authorization: Bearer TOKEN" in answer["error"], (path, status, answer)
        served.token = token

        def good_request():
            status, answer = served.post({"inputs": x.tolist()})
            assert status == 200 and answer["sets"] == predictor.predict_sets(x).lists
            assert answer["top1"] == predictor.predict_proba(x).argmax(1).tolist() and answer["set_size"] == [len(s) for s in answer["sets"]]

        good_request()
        ids = list(range(500, 540))
        status, answer = served.post({"inputs": x.reshape(40, 64).tolist(), "score": "aps", "ids": ids, "probabilities": True})
        assert status == 200 and answer["sets"] == predictor.predict_sets(x, "aps", example_ids=ids).lists
        assert answer["set_names"] == [[str(k) for k in s] for s in answer["sets"]] and len(answer["probabilities"][0]) == 10
        bad = [
            (json.dumps({"inputs": [[1.0, 2.0, 3.0]]}).encode(), 400, "inputs must have shape [n, 1, 8, 8] (or [n, 8, 8], or [n, 64] flattened); got [1, 3]"),
            (json.dumps({"inputs": [["a"] * 64]}).encode(), 400, "inputs must be numbers"),
            (json.dumps({"inputs": [[True] * 64]}).encode(), 400, "inputs must be numbers (integers or floats); got bool"),
            (json.dumps({"inputs": []}).encode(), 400, "empty batch"),
            (json.dumps({"inputs": [[0.0] * 64, [0.0] * 3]}).encode(), 400, "rectangular array of numbers"),
            (json.dumps({"inputs": x[:1].tolist(), "score": "lac"}).encode(), 400, "\"score\" must be one of hps, aps, raps"),
            (json.dumps({"pixels": []}).encode(), 400, "with an \"inputs\" field"),
            (os.urandom(10 * 2**20), 400, "the body is not JSON"),
        ]
        for body, expected_status, message in bad:
            status, answer = served.request("/predict", body)
            assert status == expected_status and message in answer["error"], (status, answer)
            good_request()  # the replica goes on answering
        status, answer = served.request("/nowhere")
        assert status == 404 and "POST /predict or GET /health" in answer["error"]
    finally:
        if served.process.poll() is None:
            served.stop()
    output = "".join(served.output)
    assert "stopping" in output and output.rstrip().endswith("stopping")  # nothing of Ray's teardown after it


def test_the_readme_s_use_the_result_commands_run_verbatim(sweep, tmp_path):
    """The three commands of README.md's "Use the result", in a directory holding the sweep's
    ``results/digits`` and ``digits.npy`` as the README describes them."""
    _, results, _ = sweep
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Use the result"):]
    section = section[: section.index("\n## ", 1)]
    commands = [line.strip() for line in section.splitlines() if line.startswith(("    dpsm-ray ", "    python -c "))]
    assert [c.split()[1] for c in commands] == ["-c", "export", "predict", "serve"]
    shutil.copytree(results, tmp_path / "results" / "digits", ignore=shutil.ignore_patterns(".lock"))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    for command in commands[:3]:
        result = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, f"{command}:\n{result.stderr[-3000:]}"
    from sklearn.datasets import load_digits

    assert numpy.array_equal(numpy.load(tmp_path / "digits.npy"), load_digits().data[:10])
    sets = pd.read_parquet(tmp_path / "sets.parquet")
    predictor = Predictor.load(tmp_path / "predictors" / "dpsm", device="cpu")
    assert sets.set.map(list).tolist() == predictor.predict_sets(numpy.load(tmp_path / "digits.npy")).lists
    assert list(sets.columns) == ["input_id", "set", "set_names", "set_size", "top1", "top1_name"]
    # the section's Python block, as written
    block = section[section.index("```python\n") + len("```python\n") : section.index("```", section.index("```python\n") + 3)]
    result = subprocess.run([sys.executable, "-c", block], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert Predictor.load(tmp_path / "predictors" / "dpsm-mine", device="cpu").alpha == 0.05
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", 8000)) != 0, "port 8000, which the README's serve command uses, is taken on this machine"
    served = Served(commands[3], tmp_path, 8000)
    try:
        served.wait_until_serving()
        status, answer = served.post({"inputs": numpy.load(tmp_path / "digits.npy").tolist()})
        assert status == 200 and answer["sets"] == sets.set.map(list).tolist()
    finally:
        if served.process.poll() is None:
            served.stop()


def test_the_readme_s_report_and_train_commands_run_verbatim(sweep, tmp_path):
    """README.md's `dpsm-ray report results/digits` (on the sweep's results) and its `dpsm-ray train`
    line, as written, from a directory holding ``results/digits``."""
    _, results, _ = sweep
    lines = [line.strip() for line in (ROOT / "README.md").read_text().splitlines() if line.startswith(("    dpsm-ray report ", "    dpsm-ray train "))]
    assert [line.split()[1] for line in lines] == ["report", "train"]
    shutil.copytree(results, tmp_path / "results" / "digits", ignore=shutil.ignore_patterns(".lock"))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    for command in lines:
        result = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, f"{command}:\n{result.stderr[-3000:]}"
    assert (tmp_path / "runs" / "dpsm" / "predictor" / "predictor.json").is_file()
    assert "Average prediction set size" in (tmp_path / "results" / "digits" / "report.md").read_text()
