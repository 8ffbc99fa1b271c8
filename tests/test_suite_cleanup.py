"""The test suite leaves the machine as it found it (tests/conftest.py, tests/suite_processes.py):
a run fails, naming them, when processes it started outlive it, and ends them -- never a process
that is not the run's -- and the tests that own the machine's Ray leave a Ray they did not start
alone.  Each starts a pytest run of its own, as a user would start the suite."""

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import suite_processes

from dpsm_ray import reaper

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent

LEAKY = '''
import subprocess

holder = None


def test_a_test_that_leaves_a_process_running():
    subprocess.Popen(["sleep", "307"])


def test_a_test_whose_process_outlives_its_parent_with_an_environment_of_its_own():
    """The sleep's environment holds no mark, and once its parent has gone it is no process's
    under the run: only the note taken after this test still names it."""
    global holder
    holder = subprocess.Popen(["bash", "-c", "env -i sleep 308 >/dev/null & echo $!; read line"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert int(holder.stdout.readline())  # the sleep has started


def test_a_test_that_cleans_up_after_itself():
    holder.communicate(b"go\\n", timeout=30)  # the bash above ends: its sleep is re-parented
    sleeper = subprocess.Popen(["sleep", "309"])
    sleeper.kill()
    sleeper.wait()
'''


def run_pytest(args: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", "PYTEST_XDIST_WORKER")} | {"PYTHONPATH": str(TESTS)}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:randomly", "-p", "no:cacheprovider", *args],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def running(pid: int, started: int) -> bool:
    return reaper.start_time(pid) == started and reaper.alive(pid)


def sleeps(seconds: str) -> list[int]:
    """The processes on this machine running ``sleep SECONDS``."""
    return [p.pid for p in suite_processes.snapshot().values() if p.command == f"sleep {seconds}"]


def test_the_leak_check_fails_the_run_names_and_ends_what_it_left_and_nothing_else(tmp_path):
    """A run of three tests (tests/conftest.py as a plugin: its leak check and its mark), beside a
    process started before it that also lives on (this test's, not that run's)."""
    (tmp_path / "test_leaky.py").write_text(LEAKY)
    before = subprocess.Popen(["sleep", "306"])
    try:
        started = reaper.start_time(before.pid)
        run = run_pytest(["-p", "conftest", "--basetemp", str(tmp_path / "basetemp"), "test_leaky.py"], tmp_path, timeout=300)
        output = run.stdout + run.stderr
        assert run.returncode == 1 and "3 passed" in output, output[-3000:]
        section = output[output.index("processes left running"):]
        named = [line.split(": ", 1)[1] for line in section.splitlines() if line.startswith("  pid ")]
        assert sorted(named) == ["sleep 307", "sleep 308"], section  # not sleep 306 (before the run), not 309 (ended)
        assert "were ended now" in section
        assert not sleeps("307") and not sleeps("308")
        assert running(before.pid, started), "the run ended a process it had not started"
    finally:
        before.kill()
        before.wait()


FOREIGN = textwrap.dedent('''
    import sys
    import ray

    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)


    @ray.remote
    def square(x):
        return x * x


    print("up", flush=True)
    for line in sys.stdin:
        print("answer", ray.get(square.remote(int(line))), flush=True)
    ray.shutdown()
''')
CLUSTER_MODULES = ("tests/test_cluster_launcher.py", "tests/test_gpu_autoscaling.py")


@pytest.mark.ray
def test_the_tests_that_own_the_machine_s_ray_leave_a_foreign_one_alone(tmp_path):
    """A Ray that another program started (an embedded one, ``ray.init()`` in a process of its
    own) runs while the suite's `cluster` tests are run: they are skipped, naming it, and it goes
    on answering afterwards, its processes the same."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    core: dict[int, int] = {}
    foreign = subprocess.Popen([sys.executable, "-c", FOREIGN], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                               text=True, env=env, cwd=tmp_path)
    try:
        assert foreign.stdout.readline().strip() == "up"
        core = {pid: reaper.start_time(pid) for name in suite_processes.RAY_CORE for pid in reaper.children_named(foreign.pid, name)}
        assert len(core) == 2, core  # its GCS server and its raylet
        run = run_pytest(["-rs", "--basetemp", str(tmp_path / "basetemp"), *CLUSTER_MODULES], ROOT, timeout=600)
        output = run.stdout + run.stderr
        assert run.returncode == 0 and "passed" not in output and "processes left running" not in output, output[-3000:]
        # one line per test: each names the foreign Ray (the launcher's module is skipped as a whole
        # where sshd, rsync or nc is missing)
        skipped = [line for line in output.splitlines() if line.startswith("SKIPPED")]
        beside = [line.split("running on this machine", 1)[1] for line in skipped if "a Ray this test run did not start is running" in line]
        assert len(skipped) == len(CLUSTER_MODULES) and len(beside) >= len(CLUSTER_MODULES) - 1, output[-3000:]
        assert all(set(core) <= {int(pid) for pid in re.findall(r"\b\d+\b", line)} for line in beside), (core, skipped)
        assert all("needs " in line for line in skipped if "running on this machine" not in line), skipped
        foreign.stdin.write("7\n")
        foreign.stdin.flush()
        assert foreign.stdout.readline().strip() == "answer 49"
        assert all(running(pid, started) for pid, started in core.items())
    finally:
        foreign.stdin.close()  # it shuts its Ray down and exits
        try:
            foreign.wait(timeout=60)
        except subprocess.TimeoutExpired:
            foreign.send_signal(signal.SIGKILL)
            foreign.wait()
    deadline = time.monotonic() + 30
    while any(running(pid, started) for pid, started in core.items()) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not any(running(pid, started) for pid, started in core.items())
