"""The processes a test run started, told apart from everything else running on the machine.

Other work shares the machine -- sweeps, Ray instances, other test runs -- and the suite must end
what it started and nothing else.  So a run marks its processes: ``mark`` puts a token of the run
in ``DPSM_RAY_TEST_RUN``, which every process the run starts inherits and ``/proc/PID/environ``
shows.  A process is the run's when

- its environment carries the run's token;
- or it descends from such a process, or from the pytest process itself: a process that sets its
  title (Ray's agents, workers and dashboard modules, PostgreSQL's) overwrites what /proc shows of
  its environment, and a test may start a program with an environment of its own;
- or it was the run's when last looked at (``Seen``) and is still the same process (its pid and
  start time): an orphan of the above, re-parented when its parent ended.

The pytest process and its ancestors never count.  A run that a test starts (tests/
test_suite_cleanup.py) adds a token of its own after the outer run's: its processes count for
both runs, the outer run's for the outer one only.  Standard library only, /proc only (Linux).
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import time
from dataclasses import dataclass
from pathlib import Path

MARKER = "DPSM_RAY_TEST_RUN"
PROC = Path("/proc")
RAY_CORE = ("gcs_server", "raylet")  # the processes every Ray instance runs, embedded or started with `ray start`
# a watchdog an embedded Ray starts (dpsm_ray/reaper.py): it ends when the process it watches does
WATCHDOG = re.compile(r"-m dpsm_ray\.reaper (\d+) ")


@dataclass(frozen=True)
class Process:
    pid: int
    ppid: int
    started: int  # clock ticks since boot: with the pid, names one process even after the pid is reused
    zombie: bool  # ended, not yet reaped by its parent
    tokens: tuple[str, ...]  # the test runs its environment names
    command: str

    @property
    def program(self) -> str:
        """The name of the program it runs (of its first word)."""
        return Path(self.command.split(" ", 1)[0]).name


def mark(worker: bool) -> str:
    """This run's token, set in this process's environment for every process it starts: a new one
    after those the environment holds already (a run started inside another's), unless this is a
    pytest-xdist worker, whose run is the one its controller marked.  The token starts with when
    the run's first process started: none of the run's processes started before it."""
    tokens = [token for token in os.environ.get(MARKER, "").split(":") if token]
    if not worker or not tokens:
        tokens.append(f"{read(os.getpid()).started}-{os.getpid()}-{secrets.token_hex(4)}")
        os.environ[MARKER] = ":".join(tokens)
    return tokens[-1]


def run_start(token: str) -> int:
    return int(token.split("-", 1)[0])


def this_run() -> str:
    """The token of the run this process belongs to (after ``mark``): the innermost."""
    return os.environ[MARKER].rsplit(":", 1)[-1]


def read_file(pid: int, name: str) -> bytes:
    with open(f"{PROC}/{pid}/{name}", "rb") as opened:
        return opened.read()


def read(pid: int, since: int = 0) -> Process | None:
    """The process ``pid`` (None if it has ended or started before ``since``)."""
    try:
        fields = read_file(pid, "stat").rsplit(b")", 1)[1].split()
        if int(fields[19]) < since:
            return None
        command = read_file(pid, "cmdline").replace(b"\0", b" ").decode(errors="replace").strip()
    except (OSError, IndexError):
        return None
    try:
        environ = read_file(pid, "environ").split(b"\0")
    except OSError:  # another user's process, without the right to read it
        environ = []
    prefix = f"{MARKER}=".encode()
    value = next((entry[len(prefix):].decode(errors="replace") for entry in environ if entry.startswith(prefix)), "")
    return Process(pid, int(fields[1]), int(fields[19]), fields[0] == b"Z", tuple(t for t in value.split(":") if t), command)


def snapshot(since: int = 0) -> dict[int, Process]:
    """The processes on the machine now that started at ``since`` (clock ticks since boot) or later."""
    found = {}
    for name in os.listdir(PROC):
        if name.isdigit() and (process := read(int(name), since)) is not None:
            found[process.pid] = process
    return found


def lineage(processes: dict[int, Process], pid: int) -> set[int]:
    """``pid`` and its ancestors."""
    found = set()
    while pid in processes and pid not in found:
        found.add(pid)
        pid = processes[pid].ppid
    return found


def started_by(token: str, processes: dict[int, Process] | None = None) -> dict[int, Process]:
    """The run's processes running now (as the module docstring says, less what was seen before)."""
    processes = snapshot(run_start(token)) if processes is None else processes
    children: dict[int, list[int]] = {}
    for process in processes.values():
        children.setdefault(process.ppid, []).append(process.pid)
    found: set[int] = set()
    todo = [pid for pid, process in processes.items() if token in process.tokens] + [os.getpid()]
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo.extend(children.get(pid, []))
    return {pid: processes[pid] for pid in found - lineage(processes, os.getpid()) if not processes[pid].zombie}


class Seen:
    """The run's processes noted so far, by pid and start time, with their commands.  Each note
    looks only at the processes that appeared since the last one (a process is the run's from its
    start or never): a listing of /proc, where reading every process's stat took ~8 ms."""

    def __init__(self, token: str) -> None:
        self.token = token
        self.noted: dict[tuple[int, int], str] = {}
        self.looked_at: set[int] = set()  # the pids of the last listing
        self.mine: set[int] | None = None  # this process and its ancestors

    def note(self) -> None:
        pids = {int(name) for name in os.listdir(PROC) if name.isdigit()}
        new = {pid: process for pid in pids - self.looked_at if (process := read(pid, run_start(self.token))) is not None}
        self.looked_at = pids
        if self.mine is None:
            self.mine = lineage(snapshot(), os.getpid())
        ours = {pid for pid, _ in self.noted} | {os.getpid()}
        grown = True
        while grown:  # parents before children, whatever order the listing had
            grown = False
            for process in new.values():
                if process.pid not in ours and process.pid not in self.mine and not process.zombie and (
                        self.token in process.tokens or process.ppid in ours):
                    self.noted[(process.pid, process.started)] = process.command
                    ours.add(process.pid)
                    grown = True

    def rows(self) -> list[list]:
        """For pytest-xdist's workeroutput (plain lists: it serializes them)."""
        return [[pid, started, command] for (pid, started), command in self.noted.items()]

    def add_rows(self, rows: list[list]) -> None:
        self.noted.update({(pid, started): command for pid, started, command in rows})

    def running(self, processes: dict[int, Process]) -> dict[int, Process]:
        return {pid: processes[pid] for pid, started in self.noted if pid in processes and processes[pid].started == started
                and not processes[pid].zombie}


def still_running(token: str, seen: Seen) -> list[Process]:
    """The run's processes running now, and those noted before that still run; not the watchdog of
    this process or an ancestor, which ends with it."""
    processes = snapshot(run_start(token))
    mine = lineage(processes, os.getpid())
    running = started_by(token, processes) | seen.running(processes)
    running = {pid: p for pid, p in running.items() if pid not in mine}
    return sorted((p for p in running.values() if not ((w := WATCHDOG.search(p.command)) and int(w.group(1)) in mine)), key=lambda p: p.pid)


def left_running(token: str, seen: Seen, wait_s: float) -> list[Process]:
    """What is still running after up to ``wait_s`` seconds (a process ending on its own -- an
    exited worker's watchdog and the Ray processes it ends -- gets the time to)."""
    deadline = time.monotonic() + wait_s
    while (left := still_running(token, seen)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def end(processes: list[Process], wait_s: float = 5.0) -> None:
    """SIGTERM, then SIGKILL for those still running after ``wait_s`` (each only while its pid
    still names the same process)."""
    def same(p: Process) -> bool:
        now = read(p.pid)
        return now is not None and now.started == p.started and not now.zombie

    for signal_number in (signal.SIGTERM, signal.SIGKILL):
        for process in filter(same, processes):
            try:
                os.kill(process.pid, signal_number)
            except OSError:
                pass
        deadline = time.monotonic() + wait_s
        while any(map(same, processes)) and time.monotonic() < deadline:
            time.sleep(0.1)


def foreign_rays(token: str) -> list[Process]:
    """Ray instances on this machine that this run did not start: their GCS servers and raylets."""
    processes = snapshot()
    ours = started_by(token, processes)
    return [p for p in processes.values() if p.pid not in ours and not p.zombie and p.program in RAY_CORE]
