"""The benchmarks at their small sizes, as CI runs them: each must run every arm and report."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dpsm_ray.cards import PAPER_METHODS as METHODS

ROOT = Path(__file__).resolve().parents[1]


def assert_throughput_record(record: dict, table: list[str]) -> None:
    """``bench/throughput.py --device cpu --quick``'s JSON record and the table it prints after it
    (run by bench/gpu_check.py's throughput step: test_gpu_check_dry_runs_every_step_on_cpu)."""
    assert record["benchmark"] == "throughput" and record["quick"] and record["failed"] == 0
    rows = record["results"]
    # the official-style baseline and ours for every method, then 1 and 2 packed trials
    assert [(r["pipeline"], r["method"]) for r in rows[:8]] == [(p, m) for m in METHODS for p in ("official", "ours")]
    assert [(r["pipeline"], r["packs"]) for r in rows[8:]] == [("packed", 1), ("packed", 2)]
    for row in rows:
        assert row["images_per_s"] > 0 and row["images"] == row["batch"] * record["steps"] * row.get("packs", 1)
        assert row["images_per_s"] == row["images"] / row["seconds"]
    assert len(rows[-1]["per_trial_images_per_s"]) == 2
    assert set(record["summary"]) >= {f"speedup_{m}_resnet20_b32" for m in METHODS} | {"dpsm_step_cost_vs_ce_resnet20_b32"}
    assert table[0].split()[:4] == ["pipeline", "model", "method", "batch"] and len([line for line in table if line.split()[0] in ("official", "ours", "packed")]) == 10


def test_throughput_benchmark_rejects_bad_options_by_name():
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "throughput.py"), "--quick", "--batches", "31"], capture_output=True, text=True)
    assert result.returncode == 2 and "--batches must be even" in result.stderr
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "throughput.py"), "--quick", "--methods", "ce,foo"], capture_output=True, text=True)
    assert result.returncode == 2 and "--methods: unknown foo" in result.stderr


def test_throughput_benchmark_compiles_the_model_when_asked(tmp_path):
    """--pipelines ours,compiled: the same step with the model torch.compile'd (inductor, here on the
    CPU), its ratio to ours in the summary; no packed trials with --packs 0."""
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "throughput.py"), "--device", "cpu", "--quick", "--pipelines", "ours,compiled",
                             "--methods", "ce", "--packs", "0", "--steps", "1", "--warmup", "1", "--json-out", str(tmp_path / "t.json")],
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    record = json.loads((tmp_path / "t.json").read_text())
    assert [(r["pipeline"], r.get("compile_mode")) for r in record["results"]] == [("ours", None), ("compiled", "default")]
    rates = [r["images_per_s"] for r in record["results"]]
    assert record["summary"]["compiled_over_ours_ce_resnet20_b32"] == rates[1] / rates[0]
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "throughput.py"), "--quick", "--pipelines", "ours,jit"], capture_output=True, text=True)
    assert result.returncode == 2 and "--pipelines: unknown jit; allowed: official, ours, compiled" in result.stderr


def test_predict_throughput_benchmark_runs_quick_on_cpu_and_prints_json_and_a_table(tmp_path):
    out = tmp_path / "predict.json"
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "predict_throughput.py"), "--device", "cpu", "--quick", "--json-out", str(out)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads(result.stdout.splitlines()[0])
    assert record == json.loads(out.read_text()) and record["benchmark"] == "predict_throughput" and record["quick"]
    rows = record["results"]
    assert [(r["model"], r["score"]) for r in rows] == [("mlp", "hps"), ("mlp", "aps"), ("resnet110", "hps"), ("resnet110", "aps")]
    for row in rows:
        assert row["inputs"] == row["batch"] * record["batches"] and row["inputs_per_s"] == row["inputs"] / row["seconds"] > 0
    table = result.stdout.splitlines()[1:]
    assert table[0].split()[:3] == ["model", "batch", "score"] and [line.split()[0] for line in table[1:]] == ["mlp", "mlp", "resnet110", "resnet110"]


def test_eval_batch_benchmark_runs_quick_and_prints_json_and_a_table(tmp_path):
    out = tmp_path / "eval_batch.json"
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "eval_batch.py"), "--quick", "--json-out", str(out)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads(result.stdout.splitlines()[0])
    assert record == json.loads(out.read_text()) and record["benchmark"] == "eval_batch" and record["quick"] and record["threads"] == 1
    rows = record["results"]
    assert [(r["model"], r["chunk"]) for r in rows] == [("lenet", 512), ("lenet", 256), ("mlp_bn", 512), ("mlp_bn", 256)]
    for row in rows:
        assert row["identical"] is True and row["inputs_per_s"] == row["examples"] / row["seconds"] > 0
    table = result.stdout.splitlines()[1:]
    assert table[0].split() == ["model", "chunk", "seconds", "inputs/s", "identical"] and len(table) == 5
    bad = subprocess.run([sys.executable, str(ROOT / "bench" / "eval_batch.py"), "--quick", "--models", "vit"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--models: unknown vit" in bad.stderr


def test_predict_throughput_benchmark_rejects_bad_options_by_name():
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "predict_throughput.py"), "--quick", "--models", "mlp,vit"], capture_output=True, text=True)
    assert result.returncode == 2 and "--models: unknown vit" in result.stderr


@pytest.mark.ray
def test_sweep_efficiency_benchmark_runs_quick_and_prints_json_and_a_table(ray_session, tmp_path):
    import ray

    out = tmp_path / "out"
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}  # the session's Ray, not one more of its own
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "sweep_efficiency.py"), "--quick", "--out", str(out)],
                            capture_output=True, text=True, timeout=900, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads(result.stdout.splitlines()[0])
    assert record == json.loads((out / "sweep_efficiency.json").read_text())
    arms = {arm["arm"]: arm for arm in record["arms"]}
    assert list(arms) == ["grid", "tpe", "tpe+asha", "random+asha"]
    assert arms["grid"]["trials"] == 4 and arms["grid"]["epochs"] == 4 * 3 and arms["grid"]["stopped"] == 0  # 2 x 2 points, 3 epochs each
    for arm in arms.values():
        assert arm["failed"] == 0 and arm["curve"][-1]["epochs"] == arm["epochs"] and arm["curve"][-1]["best"] == arm["best"]
        bests = [point["best"] for point in arm["curve"] if point["best"] == point["best"]]  # NaN until a feasible finished trial
        assert bests == sorted(bests, reverse=True)
    assert arms["tpe"]["epochs"] == 3 * 3 and arms["tpe+asha"]["epochs"] <= 3 * 3
    summary = record["summary"]
    assert summary["tpe_asha_vs_grid_epochs"] == round(arms["tpe+asha"]["epochs"] / arms["grid"]["epochs"], 3)
    assert (out / "sweep_efficiency.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = result.stdout.splitlines()[2:]
    assert table[0].split() == ["arm", "trials", "stopped", "failed", "epochs", "wall", "s", "best", "val", "size"]
    assert [line.split()[0] for line in table[1:5]] == list(arms)


def test_cli_startup_benchmark_runs_and_no_front_door_command_imports_torch_or_ray(tmp_path):
    out = tmp_path / "startup.json"
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "cli_startup.py"), "--repeats", "1", "--json-out", str(out)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads(result.stdout.splitlines()[0])
    assert record == json.loads(out.read_text()) and record["benchmark"] == "cli_startup"
    commands = [r["command"] for r in record["results"]]
    assert {"dpsm-ray --help", "dpsm-ray --version", "dpsm-ray train --alpha 2", "sweeps/digits.py --methods ce,foo"} <= set(commands)
    # --help, --version and argument errors answer before torch, Ray, Optuna or pandas are imported
    assert {r["command"]: r["heavy_imports"] for r in record["results"]} == {command: [] for command in commands}
    assert all(r["median_s"] > 0 for r in record["results"])
    assert [line.split()[0] for line in result.stdout.splitlines()[2:]] == [c.split()[0] for c in commands]


@pytest.mark.ray
def test_gpu_check_dry_runs_every_step_on_cpu(tmp_path):
    """bench/gpu_check.py --device cpu --quick: what a lent GPU runs, at CPU sizes; its packed
    sweeps run on a Ray that declares one GPU (bench/gpu_shaped.py)."""
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--device", "cpu", "--quick", "--out", str(out)],
                            capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((out / "gpu_check.json").read_text())
    assert json.loads(result.stdout.splitlines()[-9]) == summary  # the JSON line, then the table (a header and 7 rows)
    assert all(summary[step]["ok"] for step in ("environment", "gpu_tests", "train", "throughput", "packed", "stacked", "group"))
    # its group step: the group's GPU tests (both skipped on a CPU), then `bench/group.py --device cpu --quick`, each
    # figure against one trial's step (no streams on a CPU: no overlap check)
    assert summary["group"]["tests"]["exit"] == 0 and summary["group"]["tests"]["skipped"] == 2 and "passed" not in summary["group"]["tests"]
    assert sorted(summary["group"]["summary"]) == sorted(["single_images_per_s", "step_1_over_single", "step_2_over_single",
                                                          *[f"end_to_end_{n}_over_{what}" for n in (1, 2) for what in ("step", "single")]])
    # its stacked step: `bench/stacked.py --device cpu --quick`, a ratio of images/s for each N
    assert sorted(summary["stacked"]["summary"]) == [f"stacked_over_separate_{n}" for n in (1, 2, 4)]
    assert all(row["images_per_second"] > 0 for row in summary["stacked"]["rows"])
    variants = summary["train"]["variants"]
    assert variants["graph_bf16_channels_last"] == variants["graph_bf16_full_diagnostics"] == {"skipped": "the captured graph needs CUDA"}
    # auto is eager fp32 on a CPU: the same losses as the plain run
    assert variants["auto"]["ce_loss"] == variants["eager_fp32"]["ce_loss"] and variants["auto"]["images_per_s"] > 0
    for run in (variants["auto"], variants["eager_fp32"]):  # the last epoch by part, from epochs.parquet
        parts = run["last_epoch_parts"]
        assert set(parts) == {"train_seconds", "diagnostics_seconds", "validation_seconds"} and sum(parts.values()) <= run["epoch_seconds"][-1] + 0.02
        assert run["steps_images_per_s"] >= run["images_per_s"] and 0 < run["end_to_end_over_steps"] <= 1
    assert list(summary["packed"]["sweeps"]) == ["trials_per_gpu_2"]  # --quick's one wave of two trials sharing the GPU
    for packs, sweep in summary["packed"]["sweeps"].items():
        assert sweep["trials_ok"] == sweep["trials"] and sweep["gpu_ids"] == ["0"] and sweep["devices"] == ["cpu"], (packs, sweep)
    # its throughput step is `bench/throughput.py --device cpu --quick`: the JSON line it printed
    # (its log holds its output and its "[bench]" progress lines) is the record it wrote, then the table
    record = json.loads((out / "throughput.json").read_text())
    printed = (out / "throughput.log").read_text().splitlines()
    at = next(i for i, line in enumerate(printed) if line.startswith('{"benchmark": "throughput"'))
    assert json.loads(printed[at]) == record and summary["throughput"]["summary"] == record["summary"]
    assert_throughput_record(record, printed[at + 1:])
    # what comes back from the device tool: at most 8 files, no folders
    assert len(list(out.iterdir())) <= 8 and all(path.is_file() for path in out.iterdir())


def test_precision_benchmark_trains_each_seed_in_both_precisions_and_compares_by_seed_sd(tmp_path):
    """bench/precision.py --device cpu --quick: the CPU twin of the GPU's bf16-against-fp32 check
    (bf16 autocast on a CPU), its comparison recomputed here from the runs it reports."""
    import statistics

    out = tmp_path / "precision.json"
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "precision.py"), "--device", "cpu", "--quick", "--json-out", str(out)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    record = json.loads(result.stdout.splitlines()[0])
    assert record == json.loads(out.read_text()) and record["benchmark"] == "precision"
    runs = {(run["precision"], run["seed"]): run for run in record["runs"]}
    assert sorted(runs) == [("bf16", 0), ("bf16", 1), ("fp32", 0), ("fp32", 1)] and all(run["exit"] == 0 for run in runs.values())
    # bf16 really ran: each seed's bf16 run ends with another loss than its fp32 twin
    assert all(runs["bf16", seed]["last_epoch"]["ce_loss"] != runs["fp32", seed]["last_epoch"]["ce_loss"] for seed in (0, 1))
    for score in ("hps", "aps"):
        for metric in ("set_size", "coverage"):
            values = {p: [runs[p, seed]["scores"][score][metric] for seed in (0, 1)] for p in ("fp32", "bf16")}
            row = record["comparison"][f"{score}_{metric}"]
            pooled = ((statistics.stdev(values["fp32"]) ** 2 + statistics.stdev(values["bf16"]) ** 2) / 2) ** 0.5
            difference = statistics.mean(values["bf16"]) - statistics.mean(values["fp32"])
            assert row["difference"] == pytest.approx(difference) and row["pooled_sd"] == pytest.approx(pooled)
            assert row["within_one_sd"] == (abs(difference) < pooled or difference == 0)
    for run in runs.values():  # each epoch by part: the parts are inside the epoch
        parts = run["epoch_parts"]
        assert len(parts["epoch_seconds"]) == 2
        for epoch in range(2):
            assert sum(parts[name][epoch] for name in ("train_seconds", "diagnostics_seconds", "validation_seconds")) <= parts["epoch_seconds"][epoch] + 0.005
    table = result.stdout.splitlines()[1:]
    assert table[0].split()[:3] == ["score", "/", "metric"] and [line.split()[0] for line in table[1:5]] == ["hps_set_size", "hps_coverage", "aps_set_size", "aps_coverage"]


def test_precision_benchmark_rejects_bad_options_by_name():
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "precision.py"), "--quick", "--seeds", "3"], capture_output=True, text=True)
    assert result.returncode == 2 and "--seeds: at least two seeds" in result.stderr


def test_stacked_benchmark_prints_a_record_and_a_table(tmp_path):
    """bench/stacked.py --device cpu --quick: separate and stacked steps for each N, their ratio."""
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "stacked.py"), "--device", "cpu", "--quick", "--trials", "1,2", "--steps", "1",
                             "--warmup", "0", "--json-out", str(tmp_path / "stacked.json")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads(result.stdout.splitlines()[0])
    assert record == json.loads((tmp_path / "stacked.json").read_text())
    assert [(row["path"], row["trials"]) for row in record["rows"]] == [("separate", 1), ("stacked", 1), ("separate", 2), ("stacked", 2)]
    rates = {(row["path"], row["trials"]): row["images_per_second"] for row in record["rows"]}
    assert record["summary"] == {f"stacked_over_separate_{n}": rates["stacked", n] / rates["separate", n] for n in (1, 2)}
    table = result.stdout.splitlines()[-2:]
    assert [line.split()[0] for line in table] == ["1", "2"] and all(line.endswith("x") for line in table)


def test_group_benchmark_measures_each_group_size_against_one_trial_and_skips_what_is_past_its_budget(tmp_path):
    """bench/group.py --device cpu --quick: one trial's step, then N = 1, 2 members side by side
    (one after another on a CPU) and end to end; its summary recomputed from its rows."""
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "group.py"), "--device", "cpu", "--quick", "--json-out", str(tmp_path / "g.json")],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    record = json.loads(result.stdout.splitlines()[0])
    assert record == json.loads((tmp_path / "g.json").read_text()) and record["benchmark"] == "group" and record["failed"] == record["skipped"] == 0
    rows = record["rows"]
    assert [(r["measurement"], r["members"]) for r in rows] == [("single", 1), ("step", 1), ("step", 2), ("end_to_end", 1), ("end_to_end", 2)]
    for row in rows:
        assert row["images_per_s"] == row["images"] / row["seconds"] > 0
    assert [r["images"] for r in rows] == [32 * 3, 32 * 3, 2 * 32 * 3, 64, 2 * 64]  # rounds x batch x N; an epoch of 64 images each
    single = rows[0]["images_per_s"]
    assert record["summary"] == {"single_images_per_s": single, "step_1_over_single": rows[1]["images_per_s"] / single,
                                 "step_2_over_single": rows[2]["images_per_s"] / single,
                                 "end_to_end_1_over_step": rows[3]["images_per_s"] / rows[1]["images_per_s"],
                                 "end_to_end_1_over_single": rows[3]["images_per_s"] / single,
                                 "end_to_end_2_over_step": rows[4]["images_per_s"] / rows[2]["images_per_s"],
                                 "end_to_end_2_over_single": rows[4]["images_per_s"] / single}
    assert [line.split()[:2] for line in result.stdout.splitlines()[3:8]] == [["single", "1"], ["step", "1"], ["step", "2"], ["end_to_end", "1"],
                                                                               ["end_to_end", "2"]]
    skipped = subprocess.run([sys.executable, str(ROOT / "bench" / "group.py"), "--device", "cpu", "--quick", "--budget-s", "0"],
                             capture_output=True, text=True, timeout=300)
    assert skipped.returncode == 0 and json.loads(skipped.stdout.splitlines()[0])["skipped"] == 5, skipped.stderr[-2000:]
    wrong = subprocess.run([sys.executable, str(ROOT / "bench" / "group.py"), "--quick", "--members", "2,x"], capture_output=True, text=True)
    assert wrong.returncode == 2 and "--members must be comma-separated integers; got '2,x'" in wrong.stderr


def test_the_group_benchmark_s_overlap_is_the_time_kernels_of_two_streams_ran_at_once():
    """bench/group.py's reading of a profiler trace, on a trace written by hand: stream 1 runs 0-10,
    20-30 and 30-35 us, stream 2 runs 5-25 us (and a CPU event and a memcpy that are not kernels)."""
    sys.path.insert(0, str(ROOT / "bench"))
    from group import concurrency, kernel_intervals

    kernel = lambda ts, dur, stream: {"ph": "X", "cat": "kernel", "ts": ts, "dur": dur, "args": {"stream": stream}}  # noqa: E731
    trace = {"traceEvents": [kernel(0, 10, 1), kernel(20, 10, 1), kernel(30, 5, 1), kernel(5, 20, 2),
                             {"ph": "X", "cat": "cpu_op", "ts": 0, "dur": 100, "args": {}}, {"ph": "X", "cat": "gpu_memcpy", "ts": 40, "dur": 5, "args": {"stream": 2}}]}
    intervals = kernel_intervals(trace)
    assert sorted(intervals) == [(0.0, 10.0, 1), (5.0, 25.0, 2), (20.0, 30.0, 1), (30.0, 35.0, 1)]
    # busy 0-35; two streams at once 5-10 and 20-25; 30 touches 30 without overlapping
    assert concurrency(intervals) == {"kernels": 4, "streams": 2, "busy_us": 35.0, "concurrent_us": 10.0, "concurrent_share": 10 / 35}
    assert concurrency([(0.0, 10.0, 1), (10.0, 20.0, 2)])["concurrent_us"] == 0.0  # one stream after the other


@pytest.mark.ray
def test_base_models_benchmark_runs_quick_on_the_session_s_ray_and_the_tasks_weights_are_the_driver_s(ray_session, tmp_path):
    import ray

    out = tmp_path / "base_models.json"
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "base_models.py"), "--quick", "--json-out", str(out)],
                            capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads(result.stdout.splitlines()[0])
    assert record == json.loads(out.read_text()) and record["benchmark"] == "base_models" and record["quick"] and record["seeds"] == 2
    rows = record["results"]
    assert rows[0]["how"] == "driver, one after another, 1 thread" and rows[-1]["how"].startswith("Ray tasks, 1 CPU each")
    assert len(rows) == (2 if record["default_threads"] == 1 else 3) and all(row["seconds"] > 0 for row in rows)
    assert rows[0]["identical"] is True and rows[-1]["identical"] is True  # a task trains what the driver trained at one thread
    table = result.stdout.splitlines()[1:]
    assert table[0].split() == ["how", "seconds", "speed-up", "identical"] and len(table) == len(rows) + 1
    bad = subprocess.run([sys.executable, str(ROOT / "bench" / "base_models.py"), "--seeds", "0"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--seeds and --epochs must be >= 1; got 0" in bad.stderr


@pytest.mark.ray
def test_predictor_export_benchmark_runs_quick_on_the_session_s_ray_and_the_tasks_predictors_are_the_driver_s(ray_session, tmp_path):
    import ray

    out = tmp_path / "predictor_export.json"
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "predictor_export.py"), "--quick", "--json-out", str(out)],
                            capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads(result.stdout.splitlines()[0])
    assert record == json.loads(out.read_text()) and record["benchmark"] == "predictor_export" and record["models"] == 3
    rows = record["rows"]
    assert rows[0]["how"] == "driver, one after another, 1 thread" and rows[-1]["how"].startswith("Ray tasks, 1 CPU each")
    assert len(rows) == (2 if record["default_threads"] == 1 else 3) and all(row["seconds"] > 0 for row in rows)
    assert rows[-1]["identical"] is True  # a task writes the predictor the driver wrote at one thread
    table = result.stdout.splitlines()[1:]
    assert table[0].split() == ["how", "seconds", "speed-up", "identical"] and len(table) == len(rows) + 1
    bad = subprocess.run([sys.executable, str(ROOT / "bench" / "predictor_export.py")], capture_output=True, text=True)
    assert bad.returncode == 2 and "give --results DIR (a finished sweep) or --quick" in bad.stderr


@pytest.mark.ray
def test_the_search_grid_and_the_replays_on_it_run_quick_and_the_regret_is_the_pick_s_against_the_best_cell(ray_session, tmp_path):
    """bench/search_grid.py --quick (CE and DPSM, 2 values a knob, through the study driver on the session's Ray), then
    bench/search_quality.py --quick on its table; and the sweep's pick rule on rows written by hand."""
    import ray

    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    grid = subprocess.run([sys.executable, str(ROOT / "bench" / "search_grid.py"), "--quick", "--methods", "ce,dpsm", "--results-dir",
                           str(tmp_path / "grid"), "--out", str(tmp_path / "cells.csv")], capture_output=True, text=True, timeout=900, env=env)
    assert grid.returncode == 0, grid.stderr[-3000:]
    record = json.loads(next(line for line in grid.stdout.splitlines() if line.startswith("{")))
    assert record["cells"] == 2 + 16 and record["ok"] == 18 and len(record["commit"]) == 40
    import pandas as pd

    cells = pd.read_csv(tmp_path / "cells.csv")
    assert len(cells) == 18 and cells[cells.method == "ce"].conformal_weight.isna().all()
    assert sorted(cells[cells.method == "dpsm"].lr.unique()) == [0.001, 0.1] and cells.test_set_size_hps.notna().all()

    out = tmp_path / "quality"
    quality = subprocess.run([sys.executable, str(ROOT / "bench" / "search_quality.py"), "--quick", "--table", f"digits={tmp_path / 'cells.csv'}",
                              "--out-dir", str(out)], capture_output=True, text=True, timeout=900)
    assert quality.returncode == 0, quality.stderr[-3000:]
    rows = pd.read_csv(out / "quality.csv")
    assert set(rows.sampler) == {"tpe", "random", "sobol"} and set(rows.budget) == {2, 4} and (rows.repetitions == 20).all()
    feasible = cells[(cells.status == "ok") & (cells.val_coverage >= 0.9 - 0.02)]
    for method, mine in rows.groupby("method"):
        assert (mine.best_val_size == feasible[feasible.method == method].val_set_size.min()).all()
    assert (rows.regret_p10 >= 0).all() and (rows.regret_p10 <= rows.regret_median).all() and (rows.regret_median <= rows.regret_p90).all()
    assert rows.feasible_share.between(0, 1).all() and (out / "regret.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from search_quality import pick
    finally:
        sys.path.remove(str(ROOT / "bench"))
    row = lambda status, size, coverage: pd.Series({"status": status, "val_set_size": size, "val_coverage": coverage, "test_set_size_hps": size + 1})
    rows = [row("ok", 1.5, 0.95), row("failed", float("nan"), float("nan")), row("ok", 1.2, 0.85), row("ok", 1.5, 0.90)]
    assert pick(rows, 0.88) == {"val_set_size": 1.5, "test_set_size": 2.5, "feasible": True}  # 1.2 misses the floor; a tie to the earlier
    assert pick(rows[2:3], 0.88) == {"val_set_size": 1.2, "test_set_size": 2.2, "feasible": False}  # none feasible: the highest coverage


def assert_generated_block(doc: str, command: str) -> None:
    """The block of ``doc`` between "<!-- generated by: COMMAND -->" and "<!-- end of generated -->" is
    exactly what COMMAND (``command``: a regex of it) prints, run from the repository's root."""
    import re
    import shlex

    text = (ROOT / "docs" / doc).read_text()
    block = re.search(rf"<!-- generated by: (?P<command>{command}) -->\n(?P<text>.*?)<!-- end of generated -->\n", text, re.S)
    assert block is not None
    printed = subprocess.run([sys.executable, *shlex.split(block["command"])[1:]], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert printed.returncode == 0, printed.stderr[-2000:]
    assert block["text"] == printed.stdout


def test_docs_sweeps_search_quality_table_is_what_the_committed_replays_give():
    """docs/sweeps.md quotes bench/search_quality.py --report-from on the committed replays, between these lines."""
    assert_generated_block("sweeps.md", r"python bench/search_quality\.py --report-from \S+")


def test_classwise_fonts_benchmark_runs_quick_and_the_committed_table_is_what_the_committed_files_give(tmp_path):
    """bench/classwise_fonts.py --quick (12 font classes, 2 epochs, 3 re-splits): a row per score and calibration, its class
    coverage range the one classes.parquet gives, and a second call reads the finished run instead of training it again; then
    --report-from on the committed results gives their table.csv to the last digit (docs/predictor.md quotes it)."""
    import pandas as pd

    script = [sys.executable, str(ROOT / "bench" / "classwise_fonts.py")]
    quick = [*script, "--quick", "--out", str(tmp_path / "run"), "--results", str(tmp_path / "results")]
    first = subprocess.run(quick, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    record = json.loads(next(line for line in first.stdout.splitlines() if line.startswith("{")))
    assert record["rows"] == 12 and record["train_wall_seconds"] > 0 and len(record["commit"]) == 40
    table = pd.read_csv(tmp_path / "results" / "table.csv")
    pairs = [(s, c) for s in ("hps", "aps", "raps") for c in ("marginal", "class", "cluster", "rc3p")]
    assert list(zip(table.score, table.calibration)) == pairs
    assert (table.splits == 3).all() and (table.classes == 12).all() and (table.alpha == 0.1).all()
    assert table.coverage.between(0.75, 1).all() and table.set_size.between(1, 12).all() and (table.covgap >= 0).all()
    assert table.class_coverage_min.between(0, 1).all() and (table.class_coverage_min <= table.class_coverage_max).all()
    assert table.class_coverage_max.le(1).all() and table.classes_under.between(0, 12).all()
    assert table.classes_under_per_split.between(0, 12).all()
    classes = pd.read_parquet(tmp_path / "run" / "classes.parquet")  # each class's coverage averaged over the re-splits, by hand
    for row in table.itertuples():
        mine = classes[(classes.score == row.score) & (classes.calibration == row.calibration)]
        averaged = [rows.coverage.mean() for _, rows in mine.groupby("label")]
        assert abs(min(averaged) - row.class_coverage_min) < 1e-5 and abs(max(averaged) - row.class_coverage_max) < 1e-5
        assert row.classes_under == sum(c < 0.9 - 1e-9 for c in averaged)
    again = subprocess.run(quick, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "read, not trained again" in again.stderr, again.stderr[-3000:]
    second = json.loads(next(line for line in again.stdout.splitlines() if line.startswith("{")))
    assert second["train_wall_seconds"] == record["train_wall_seconds"]

    committed = ROOT / "bench" / "results" / "classwise-fonts-2026-11-29"
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from classwise_fonts import summary, table_csv
    finally:
        sys.path.remove(str(ROOT / "bench"))
    assert table_csv(summary(committed)) == (committed / "table.csv").read_text()
    printed = subprocess.run([*script, "--report-from", str(committed), "--markdown"], capture_output=True, text=True, timeout=120)
    assert printed.returncode == 0, printed.stderr[-2000:]
    saved = pd.read_csv(committed / "table.csv")
    lines = [line for line in printed.stdout.splitlines() if line.startswith("| ") and not line.startswith("| score")]
    assert [line.strip("| ").split(" | ")[:2] for line in lines] == [[s.upper(), c] for s, c in zip(saved.score, saved.calibration)]
    for row, line in zip(saved.itertuples(), lines):
        assert f"| {row.coverage:.3f} | {row.set_size:.2f} ({row.set_size_sd:.2f}) |" in line and line.endswith(f"| {row.covgap:.2f}% |")


def test_docs_predictor_classwise_table_is_what_the_committed_fonts_run_gives():
    """docs/predictor.md quotes bench/classwise_fonts.py --report-from on the committed files, between these lines."""
    assert_generated_block("predictor.md", r"python bench/classwise_fonts\.py --report-from \S+ --markdown")
