"""Which Ray a process joins, and runs that ask for more than Ray has (issue 13)."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dpsm_ray.train.ray_session import Demand, InsufficientResources, run_demand, wait_for


# --- demands and their messages (no Ray) ------------------------------------------------------


def test_a_train_run_needs_its_workers_and_the_message_names_the_options():
    demand = run_demand(3, 1, 0)
    assert demand.bundles == [{"CPU": 1.0}] * 3 and demand.total("CPU") == 3 and demand.total("GPU") == 0
    assert not demand.fits({"CPU": 2.0}) and demand.fits({"CPU": 3.0})
    message = demand.shortfall({"CPU": 2.0}, "the embedded Ray on this machine")
    assert message == (
        "a run needs 3 CPUs at once (--workers 3 x --cpus-per-worker 1), but the embedded Ray on this machine has 2 CPUs; "
        "at most --workers 2 fit with these per-worker values: lower --workers, --cpus-per-worker or --gpus-per-worker"
    )


def test_a_sweep_trial_needs_its_own_share_and_gpus_are_named_when_asked_for():
    demand = run_demand(2, 4, 0.5, own={"cpu": 0.1})
    assert demand.bundles == [{"CPU": 0.1}, {"CPU": 4.0, "GPU": 0.5}, {"CPU": 4.0, "GPU": 0.5}]
    assert demand.total("CPU") == pytest.approx(8.1) and demand.total("GPU") == 1.0
    assert not demand.fits({"CPU": 16.0, "GPU": 0.0}) and demand.fits({"CPU": 16.0, "GPU": 1.0})
    message = demand.shortfall({"CPU": 16.0, "GPU": 0.0}, "X")
    assert "needs 8.1 CPUs and 1 GPU at once (0.1 CPUs for the trial's own process + --workers 2 x --cpus-per-worker 4 and --gpus-per-worker 0.5)" in message
    assert "X has 16 CPUs and 0 GPUs" in message and "at most --workers 0 fit" in message
    # 4 of 8 GPUs' worth: the GPU is the limit, not the CPUs
    assert "at most --workers 1 fit" in demand.shortfall({"CPU": 16.0, "GPU": 0.75}, "X")


def test_an_in_process_trial_holds_its_own_resources():
    demand = run_demand(0, 1, 0.25, own={"cpu": 1, "gpu": 0.25})
    assert demand == Demand(own={"CPU": 1.0, "GPU": 0.25}, workers=0, per_worker={"CPU": 1.0, "GPU": 0.25}, in_process=True)
    assert demand.bundles == [{"CPU": 1.0, "GPU": 0.25}]
    message = demand.shortfall({"CPU": 2.0}, "X")
    assert "--workers 0: each trial trains in its own process, holding 1 CPU and 0.25 GPUs" in message
    assert message.endswith("lower --cpus-per-worker or --gpus-per-worker")


# --- against a running Ray --------------------------------------------------------------------


@pytest.mark.ray
def test_waiting_on_a_cluster_says_what_it_waits_for_and_gives_up(ray_session):
    lines = []
    wait_for(run_demand(2, 1, 0, own={"cpu": 0.1}), 30, lines.append)  # fits: no wait, no line
    assert lines == []
    started = time.monotonic()
    with pytest.raises(InsufficientResources, match=r"after 3s the Ray cluster has 4 CPUs; at most --workers 4 fit .* raise --resource-timeout"):
        wait_for(run_demand(5, 1, 0), 3, lines.append)
    assert 2.5 < time.monotonic() - started < 15
    assert len(lines) == 1 and lines[0].startswith("waiting up to 3s for the Ray cluster to provide 5 CPUs (--workers 5 x --cpus-per-worker 1); it has 4 CPUs now")
    import ray

    assert not [pg for pg in ray.util.placement_group_table().values() if pg["state"] == "PENDING"]  # the request was withdrawn


@pytest.mark.ray
def test_the_state_api_answers_so_ray_train_can_clean_up_its_placement_groups(ray_session):
    """Ray Train's placement-group cleaner asks the state API whether a run's controller is alive;
    without the dashboard (ray[default]) it warns every second and never frees the group."""
    from ray.util.state import list_actors

    list_actors(limit=1, raise_on_missing_output=False)


@pytest.mark.ray
def test_a_second_process_starts_its_own_ray_instead_of_joining_another_processes(ray_session):
    """Ray's address="auto" joins any instance on the machine, including this test session's
    embedded one, which dies with this process; only RAY_ADDRESS, --address or a `ray start`
    cluster may be joined."""
    import ray

    code = ("from dpsm_ray.train.ray_session import ensure_ray; s = ensure_ray(worker_output=False); "
            "import ray; print(s.embedded, ray.get_runtime_context().gcs_address)")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    own = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=180)
    assert own.returncode == 0, own.stderr
    embedded, address = own.stdout.split()[-2:]
    assert embedded == "True" and address != ray.get_runtime_context().gcs_address
    told = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180,
                          env={**env, "RAY_ADDRESS": ray.get_runtime_context().gcs_address})
    assert told.returncode == 0, told.stderr
    assert told.stdout.split()[-2:] == ["False", ray.get_runtime_context().gcs_address]


def test_dpsm_ray_train_with_more_workers_than_cpus_fails_at_once_naming_the_options(tmp_path):
    cpus = os.cpu_count()
    workers = cpus + 1
    command = ["dpsm-ray", "train", "--dataset", "digits", "--epochs", "1", "--workers", str(workers), "--cpus-per-worker", "1",
               "--batch-size", str(2 * workers * 5)]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    started = time.monotonic()
    run = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
    seconds = time.monotonic() - started
    assert run.returncode == 2, run.stdout + run.stderr
    assert f"--workers {workers} x --cpus-per-worker 1" in run.stderr and f"has {cpus} CPUs" in run.stderr
    assert f"at most --workers {cpus} fit" in run.stderr
    assert "Started a local Ray instance" not in run.stderr  # known before starting Ray (~10 s on 2 cores); it used to wait forever
    print(f"failed after {seconds:.1f}s")


@pytest.mark.ray
def test_a_sweep_whose_trials_cannot_fit_stops_before_claiming_its_results_directory(ray_session, tmp_path):
    from dpsm_ray.sweep.driver import SweepSpec, run_sweep
    from dpsm_ray.config import TrainConfig

    spec = SweepSpec(name="big", base=TrainConfig(dataset="digits", workers=4), methods=("ce",), trials=1, final_seeds=1, trial_resources=(("cpu", 0.1),))
    expected = (r"needs 4.1 CPUs at once \(0.1 CPUs for the trial's own process \+ --workers 4 x --cpus-per-worker 1\), "
                r"but the embedded Ray on this machine has 4 CPUs; at most --workers 3 fit")
    with pytest.raises(InsufficientResources, match=expected):
        run_sweep(spec, tmp_path / "sweep", log=lambda line: None)
    assert not (tmp_path / "sweep" / "sweep.json").exists()  # nothing to --resume: the same command with fewer workers starts afresh


def test_the_check_before_starting_ray_applies_only_where_this_process_would_start_its_own(monkeypatch):
    from dpsm_ray.train import ray_session

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray_session, "started_cluster_address", lambda: None)
    monkeypatch.setattr(ray_session, "current_session", lambda: None)  # as in a process that has not connected yet
    too_many = run_demand(os.cpu_count() + 1, 1, 0)
    with pytest.raises(InsufficientResources, match="the embedded Ray on this machine"):
        ray_session.check_before_start(too_many)
    ray_session.check_before_start(run_demand(1, 1, 0))
    ray_session.check_before_start(too_many, address="10.0.0.1:6379")  # a cluster may have (or add) more
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    ray_session.check_before_start(too_many)


def agents_of(processes: dict[int, int]) -> list[int]:
    """The node agents among ``processes``, by the titles they give themselves."""
    found = []
    for pid in processes:
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if title.startswith((b"ray::DashboardAgent", b"ray::RuntimeEnvAgent")):
            found.append(pid)
    return found


@pytest.mark.ray
def test_a_driver_killed_with_sigkill_leaves_no_ray_process_behind(tmp_path):
    """Issue 21: after `kill -9` of a driver, Ray's node agents (one listening on every interface)
    stayed for a minute, waiting on the dead GCS; the watchdog an embedded Ray starts ends them.
    The agents are found by their titles: the title an agent sets may overwrite the environment
    (RAY_RAYLET_PID) that /proc shows, which the watchdog once went by alone -- then missed them."""
    import signal

    from dpsm_ray import reaper

    code = ("from dpsm_ray.train.ray_session import start_embedded; start_embedded(num_cpus=1, worker_output=False); "
            "print('up', flush=True); import time; time.sleep(600)")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    driver = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env, cwd=tmp_path)
    try:
        assert driver.stdout.readline().strip() == "up"
        raylets = reaper.children_named(driver.pid, "raylet")
        assert len(raylets) == 1
        deadline = time.monotonic() + 120
        while len(agents_of(reaper.descendants(raylets[0]))) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(agents_of(reaper.descendants(raylets[0]))) == 2, reaper.descendants(raylets[0])
        time.sleep(2.5)  # the watchdog notes the raylet's processes once a second
        under = reaper.descendants(raylets[0])  # the agents and Ray's workers
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.wait()

    def left() -> list[int]:
        return sorted({pid for pid, started in under.items() if reaper.start_time(pid) == started and reaper.alive(pid)} | set(reaper.belonging_to(raylets[0])))

    deadline = time.monotonic() + 15
    while left() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left(), f"still running after the driver was killed: {left()}"
