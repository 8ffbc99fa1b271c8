"""Ends what an embedded Ray instance leaves behind when its driver is killed.

Ray ties its main services to the process that started them (they die with it), but its two node
agents (``ray::DashboardAgent``, ``ray::RuntimeEnvAgent``) are children of the raylet: when the
driver is killed with SIGKILL they notice the raylet is gone and then wait on the dead GCS for a
minute before exiting, one of them listening on every interface meanwhile.  A sweep that starts
its own Ray starts this watchdog beside it:

    python -m dpsm_ray.reaper DRIVER_PID RAYLET_PID

It polls the driver once a second, noting each time the processes under the raylet (its children,
theirs, ...) with their start times; when the driver is gone, it sends SIGKILL to those still
running and to every process of this user whose environment says it belongs to that raylet
(``RAY_RAYLET_PID``), then exits.  Both, because each misses some: the raylet's orphans are
re-parented once it dies, and a process that sets its title (the agents: ``ray::DashboardAgent``)
may overwrite the memory ``/proc/PID/environ`` shows.  After a normal ``ray.shutdown()`` it finds
nothing to end.  Standard library only: it starts in ~50 ms.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

PROC = Path("/proc")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie (exited, not yet reaped by its parent) counts as gone
    try:
        return (PROC / str(pid) / "stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def children_named(parent: int, name: str) -> list[int]:
    """Processes whose parent is ``parent`` and whose command line mentions ``name``."""
    found = []
    for entry in PROC.iterdir() if PROC.exists() else []:
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[1]) == parent and name in (entry / "cmdline").read_bytes().decode(errors="replace"):
                found.append(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue
    return found


def belonging_to(raylet_pid: int) -> list[int]:
    """This user's processes started by the raylet ``raylet_pid`` (its agents and workers)."""
    marker = f"RAY_RAYLET_PID={raylet_pid}".encode()
    found = []
    for entry in PROC.iterdir() if PROC.exists() else []:
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if entry.stat().st_uid == os.getuid() and marker in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def start_time(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot): with the pid, names one process even after
    the pid is reused.  None once it has ended."""
    try:
        return int((PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def descendants(root: int) -> dict[int, int]:
    """The processes under ``root`` -- its children, theirs, and so on -- each with its start time."""
    children: dict[int, list[int]] = {}
    started: dict[int, int] = {}
    for entry in PROC.iterdir() if PROC.exists() else []:
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(entry.name))
            started[int(entry.name)] = int(fields[19])
        except (OSError, ValueError, IndexError):
            continue
    found, todo = {}, [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found[child] = started[child]
                todo.append(child)
    return found


def watch(driver_pid: int, raylet_pid: int, every_s: float = 1.0) -> list[int]:
    """Wait for the driver to end, then end the raylet's processes; returns their pids."""
    seen: dict[int, int] = {}
    while alive(driver_pid):
        seen.update(descendants(raylet_pid))
        time.sleep(every_s)
    still = {pid for pid, started in seen.items() if start_time(pid) == started and alive(pid)}
    ended = []
    for pid in sorted(still | set(belonging_to(raylet_pid))):
        try:
            os.kill(pid, signal.SIGKILL)
            ended.append(pid)
        except OSError:
            pass
    return ended


def start(raylet_pid: int) -> None:
    """Start the watchdog for this process (the driver) and its raylet, detached from both."""
    import subprocess

    subprocess.Popen(
        [sys.executable, "-m", "dpsm_ray.reaper", str(os.getpid()), str(raylet_pid)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )


if __name__ == "__main__":
    watch(int(sys.argv[1]), int(sys.argv[2]))
