"""cluster/gpu.yaml's shape at cluster scale, simulated on this CPU machine: Ray's fake multi-node
provider (the autoscaler's ``fake_multinode``, which Ray's own tests use) starts "nodes" as
processes here with declared resources.  Node types as in cluster/gpu.yaml -- a head that trains
nothing and GPU workers with ``min_workers: 0`` -- scaled to 2 cores.  A packed sweep on it must
make the autoscaler add GPU nodes, run every trial once, and the idle nodes must go away.

The head starts with ``ray start``, in a temporary directory of its own, so that no plain driver
on the machine joins it; it takes Ray's default head port, so the test is ``cluster``-marked: run
before any other Ray test of the run, and skipped beside a Ray the run did not start
(tests/conftest.py).  It is stopped by ending its own processes only (``ray stop`` would end
every Ray instance of this user on the machine).
"""

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml

from dpsm_ray import reaper

pytestmark = pytest.mark.cluster
OWNS_THE_MACHINES_RAY = "its fake cluster's head takes Ray's default head port, 6379, where the fake nodes join it"  # tests/conftest.py
ROOT = Path(__file__).resolve().parents[1]
PORT = 6379  # the fake provider's nodes join the head at this machine's address, port 6379
FAKE_HEAD_TYPE = "ray.head.default"  # the fake provider's name for the head (cluster/gpu.yaml: head)
WORKER_CPUS, MAX_GPU_NODES = 2, 2
IDLE_TIMEOUT_MINUTES = 0.25  # cluster/gpu.yaml: 10
CLUSTER_MARK = "DPSM_RAY_FAKE_CLUSTER"  # in the environment of the fake cluster's processes: its temporary directory


def fake_cluster_config(gpu_yaml: dict) -> dict:
    """cluster/gpu.yaml's node types (names, GPUs per worker, min_workers) on the fake provider."""
    worker = "gpu_worker"
    gpus = gpu_yaml["available_node_types"][worker]["resources"]["GPU"]
    return {
        "cluster_name": "gpu-shaped",
        "max_workers": MAX_GPU_NODES,
        "provider": {"type": "fake_multinode", "use_node_id_as_ip": True, "disable_node_updaters": True, "disable_launch_config_check": True},
        "available_node_types": {
            FAKE_HEAD_TYPE: {"resources": {"CPU": 1, "GPU": 0}, "node_config": {}, "max_workers": 0},
            worker: {"resources": {"CPU": WORKER_CPUS, "GPU": gpus}, "node_config": {},
                     "min_workers": gpu_yaml["available_node_types"][worker]["min_workers"], "max_workers": MAX_GPU_NODES},
        },
        "head_node_type": FAKE_HEAD_TYPE,
        "auth": {}, "upscaling_speed": 1.0, "idle_timeout_minutes": IDLE_TIMEOUT_MINUTES, "docker": {},
        "initialization_commands": [], "setup_commands": [], "head_setup_commands": [], "worker_setup_commands": [],
        "head_start_ray_commands": [], "worker_start_ray_commands": [], "file_mounts": {}, "cluster_synced_files": [],
        "file_mounts_sync_continuously": False, "rsync_exclude": [], "rsync_filter": [],
    }


def cluster_processes(mark: str) -> list[int]:
    """Pids of the fake cluster's processes: those whose environment holds ``CLUSTER_MARK=mark``
    (``ray start`` passes its environment on to every process it starts, and they to theirs; the
    Ray client server's command line names neither the session nor its directory), and every
    process under them (a node's agents set their titles, which hides their environment)."""
    children: dict[int, list[int]] = {}
    marked = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit():
                children.setdefault(int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]), []).append(int(entry.name))
                if f"{CLUSTER_MARK}={mark}".encode() in (entry / "environ").read_bytes().split(b"\0"):
                    marked.append(int(entry.name))
        except (OSError, ValueError, IndexError):
            pass
    found, todo = set(), marked
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo.extend(children.get(pid, []))
    return sorted(pid for pid in found if reaper.alive(pid) and pid != os.getpid())


def end_cluster(mark: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while (pids := cluster_processes(mark)) and time.monotonic() < deadline:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.5)


@pytest.fixture
def fake_gpu_cluster(tmp_path):
    """The fake cluster's head, started with ``ray start`` in a temporary directory of its own
    (``--temp-dir``): the address it records there is no plain driver's on this machine (Ray's
    machine-wide /tmp/ray is neither read nor written).  Its processes carry that directory in
    their environment; whatever fails, once ``ray start`` has been run, they are ended."""
    gpu_yaml = yaml.safe_load((ROOT / "cluster" / "gpu.yaml").read_text())
    assert gpu_yaml["available_node_types"]["gpu_worker"]["min_workers"] == 0  # the shape this test scales
    config = tmp_path / "fake.yaml"
    config.write_text(yaml.safe_dump(fake_cluster_config(gpu_yaml)))
    # short: Ray's socket paths under it must stay within the 107 characters a Unix socket's may have
    temp_dir = Path(tempfile.mkdtemp(prefix="ray-gpu-"))
    # token authentication, as cluster/gpu.yaml has it (the README's `ray get-auth-token --generate`)
    env = dict(os.environ, RAY_FAKE_CLUSTER="1", AUTOSCALER_UPDATE_INTERVAL_S="1", RAY_enable_autoscaler_v2="0", RAY_AUTH_MODE="token")
    env.pop("RAY_ADDRESS", None)
    env[CLUSTER_MARK] = str(temp_dir)
    ray = str(Path(sys.executable).parent / "ray")
    try:
        subprocess.run([ray, "get-auth-token", "--generate"], env=env, check=True, capture_output=True, timeout=120)
        started = subprocess.run([ray, "start", "--head", f"--port={PORT}", "--num-cpus=1", "--num-gpus=0", f"--autoscaling-config={config}",
                                  f"--temp-dir={temp_dir}", "--dashboard-host=127.0.0.1", "--disable-usage-stats"],
                                 env=env, capture_output=True, text=True, timeout=300)
        output = started.stdout[-3000:] + started.stderr[-3000:]
        assert started.returncode == 0, f"`ray start` exited with {started.returncode}:\n{output}"
        yield (temp_dir / "ray_current_cluster").read_text().strip(), env  # this machine's address: where the fake nodes join
    finally:
        end_cluster(str(temp_dir))
        shutil.rmtree(temp_dir, ignore_errors=True)


def gpu_nodes(address: str, env: dict) -> int:
    """Alive nodes with GPUs, by a driver of its own (-1 if it could not ask)."""
    probe = ("import ray; ray.init(address=%r, logging_level='ERROR', log_to_driver=False); "
             "print('GPU_NODES', sum(1 for n in ray.nodes() if n['Alive'] and n['Resources'].get('GPU')))" % address)
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    found = re.findall(r"^GPU_NODES (\d+)$", done.stdout, re.M)  # the autoscaler's event lines come through stdout too
    return int(found[-1]) if found else -1


def test_a_packed_sweep_makes_the_autoscaler_add_gpu_nodes_and_idle_ones_go_away(fake_gpu_cluster, tmp_path):
    address, env = fake_gpu_cluster
    assert gpu_nodes(address, env) == 0  # min_workers 0: no GPU node until a sweep asks
    seen, stop = [], threading.Event()

    def watch():
        while not stop.is_set():
            seen.append(gpu_nodes(address, env))
            stop.wait(3)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    results = tmp_path / "results"
    # 4 trials of half a GPU and one CPU each, 4 at once: two GPU nodes' worth
    sweep = subprocess.run(
        [sys.executable, str(ROOT / "sweeps" / "cifar100.py"), "--address", address, "--results-dir", str(results), "--dataset", "synthetic",
         "--model", "mlp", "--init", "scratch", "--methods", "ce", "--trials", "4", "--concurrency", "4", "--final-seeds", "1",
         "--trials-per-gpu", "2", "--device", "cpu", "--cpus-per-worker", "1", "--epochs", "30", "--batch-size", "64", "--resource-timeout", "300"],
        env=env, capture_output=True, text=True, timeout=1200, cwd=ROOT)
    stop.set()
    watcher.join()
    assert sweep.returncode == 0, sweep.stdout[-3000:] + sweep.stderr[-3000:]
    # no GPU in the cluster when the sweep starts: the sweep waits while the autoscaler adds one, and
    # says what for once the wait passes 2 s; the fake autoscaler, updating every second, sometimes
    # places the first trial sooner (a suite run, 2026-11-26), so the line is checked when it is there
    # and the wait's own line is tested on its own (tests/train/test_ray_session.py)
    waited = re.search(r"waiting up to 300s for the Ray cluster to provide (.*?) \(", sweep.stdout + sweep.stderr)
    assert waited is None or waited.group(1) == "1 CPU and 0.5 GPUs", waited.group(0)
    assert max(seen) == MAX_GPU_NODES, f"GPU nodes seen during the sweep: {seen}"
    trials = pd.read_parquet(results / "trials.parquet")
    search = trials[trials.stage == "search"]
    # every trial once: four search trials and the final one, each ended ok
    assert len(search) == 4 and sorted(search.trial_index) == [0, 1, 2, 3] and len(trials) == 5 and (trials.status == "ok").all()
    assert set(search.gpu_ids) == {"0"} and (trials.device == "cpu").all()  # each node has one GPU, id 0
    deadline = time.monotonic() + 60 * IDLE_TIMEOUT_MINUTES + 120
    while (left := gpu_nodes(address, env)) != 0 and time.monotonic() < deadline:
        time.sleep(5)
    assert left == 0, "idle GPU nodes were not removed"
