"""The watchdog an embedded Ray starts beside its driver (dpsm_ray/reaper.py), on a stand-in for a
driver, its raylet and an agent: plain processes, no Ray."""

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time

from dpsm_ray import reaper

RAYLET = "import subprocess, time; agent = subprocess.Popen(['sleep', '600']); print('agent', agent.pid, flush=True); time.sleep(600)"
DRIVER = f"import subprocess, sys, time; raylet = subprocess.Popen([sys.executable, '-c', {RAYLET!r}]); print('raylet', raylet.pid, flush=True); time.sleep(600)"


def test_the_watchdog_ends_the_raylet_s_orphans_it_knows_by_parentage_alone(monkeypatch):
    """The agent's environment names no raylet (as when the title an agent sets overwrites what
    /proc shows of it); once the driver and the raylet are killed it is re-parented, and the
    watchdog, which noted it under the raylet while the driver ran, ends it."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_RAYLET_PID"}
    # a session of its own: whatever fails below, the finally ends the driver, its raylet and the agent
    driver = subprocess.Popen([sys.executable, "-c", DRIVER], stdout=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        stand_in_for_a_ray(driver, monkeypatch)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(driver.pid, signal.SIGKILL)
        driver.wait()


def stand_in_for_a_ray(driver, monkeypatch):
    pids = dict(driver.stdout.readline().split() for _ in range(2))
    raylet, agent = int(pids["raylet"]), int(pids["agent"])
    assert reaper.belonging_to(raylet) == [] and agent in reaper.descendants(raylet)
    noted = threading.Event()
    descendants = reaper.descendants
    monkeypatch.setattr(reaper, "descendants", lambda root: (found := descendants(root), noted.set())[0])
    ended: list[int] = []
    watcher = threading.Thread(target=lambda: ended.extend(reaper.watch(driver.pid, raylet, every_s=0.05)))
    watcher.start()
    try:
        assert noted.wait(timeout=30)
    finally:
        for pid in (driver.pid, raylet):
            os.kill(pid, signal.SIGKILL)
        driver.wait()
    watcher.join(timeout=30)
    assert agent in ended
    deadline = time.monotonic() + 10
    while reaper.alive(agent) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not reaper.alive(agent)


def test_a_pid_reused_by_another_process_is_not_the_one_noted():
    started = reaper.start_time(os.getpid())
    assert started is not None and reaper.start_time(os.getpid()) == started
    sleeper = subprocess.Popen(["sleep", "600"])
    try:
        assert reaper.start_time(sleeper.pid) >= started and reaper.descendants(os.getpid()).get(sleeper.pid) == reaper.start_time(sleeper.pid)
    finally:
        sleeper.kill()
        sleeper.wait()
    assert reaper.start_time(sleeper.pid) is None  # ended and reaped: nothing to match
