"""Load on ``dpsm-ray serve``: throughput and latency as concurrent clients are added, then Ctrl-C and a restart on the same port.

    python bench/serve_load.py                          # 8, 16, 32, 64 clients, 1000 requests each (~1.5 min on 2 cores)
    python bench/serve_load.py --quick                  # 2 and 8 clients, 60 requests each (the tests run it)
    python bench/serve_load.py --source /tmp/before     # serve the dpsm_ray package of another checkout (a before/after pair)
    python bench/serve_load.py --serve-args "--replicas 2"

Starts ``dpsm-ray serve`` on 127.0.0.1 (a free port) in a session of its own, serving a digits MLP
predictor (random weights, seed 0, calibrated on the digits calibration split: the work per input
does not depend on the weights; ``--predictor DIR`` serves another digits-shaped one).  At each
concurrency N, N client threads send ``--requests`` requests in all (or stop sending after
``--max-seconds``), each ``--rows`` digits rows on a new connection, every ``--malformed-every``-th
a malformed one (rows of 3 numbers) that must be refused with 400.  Every answer is checked against
``Predictor.predict_sets`` on the same rows; anything else -- another status, other sets, a timeout
-- is an error.  Beside each concurrency: the load average and how busy the machine's CPUs were
(``/proc/stat``) and the CPU the clients themselves used, since clients and server share the machine.

Then Ctrl-C (SIGINT to the server's process group, as a terminal sends it): the seconds until the
port refuses connections and until the command exits, and the processes it started still running
at its exit and how long after it the last ended (30 s at most).  Then the same command again on the
same port as soon as the first has exited: whether it is refused ("cannot listen"; retried every
2 s, for 2 minutes at most), how long after the Ctrl-C it was launched, the seconds until it serves,
one request, Ctrl-C again.  The before/after pair this measured and what it taught are in
docs/predictor.md.

Prints one JSON line (every measurement, the machine, the command), then a table.  Stops by itself;
a server it started is stopped (and what it leaves ended) whatever happens.
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import math
import os
import platform
import queue
import resource
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from record import emit, listed, with_preset  # bench/record.py (bench/ is on the path of python bench/NAME.py)

ROOT = Path(__file__).resolve().parents[1]
FULL = dict(concurrency="8,16,32,64", requests=1000, max_seconds=120.0)
QUICK = dict(concurrency="2,8", requests=60, max_seconds=60.0)
START_S = 300  # Ray and Serve take ~35 s to start on 2 busy cores
REQUEST_TIMEOUT_S = 60
MALFORMED = json.dumps({"inputs": [[1.0, 2.0, 3.0]]}).encode()  # 3 features where the digits model takes 64: 400


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"small counts (CI): {QUICK}")
    parser.add_argument("--concurrency", help=f"comma-separated client counts (default: {FULL['concurrency']})")
    parser.add_argument("--requests", type=int, help=f"requests per concurrency (default: {FULL['requests']})")
    parser.add_argument("--max-seconds", type=float, help=f"stop sending at a concurrency after this long (default: {FULL['max_seconds']:g})")
    parser.add_argument("--rows", type=int, default=10, help="digits rows per request (default: %(default)s)")
    parser.add_argument("--malformed-every", type=int, default=50, help="every Nth request is malformed; 0: none (default: %(default)s)")
    parser.add_argument("--predictor", help="a digits-shaped predictor directory (default: one built here)")
    parser.add_argument("--serve-args", default="", help="more options for dpsm-ray serve, e.g. \"--replicas 2\"")
    parser.add_argument("--source", help="serve the dpsm_ray package in this directory (PYTHONPATH) instead of the installed one")
    parser.add_argument("--no-restart", action="store_true", help="skip the restart on the same port")
    parser.add_argument("--json-out", help="also write the JSON line to this file")
    args = parser.parse_args(argv)
    with_preset(args, QUICK, FULL)
    try:
        args.concurrency = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        parser.error(f"--concurrency must be comma-separated integers; got {args.concurrency!r}")
    if min(args.concurrency) < 1 or args.requests < 1 or args.rows < 1 or args.malformed_every < 0 or args.max_seconds <= 0:
        parser.error("--concurrency, --requests and --rows must be >= 1, --malformed-every >= 0, --max-seconds > 0")
    if args.source and not (Path(args.source) / "dpsm_ray" / "__init__.py").exists():
        parser.error(f"--source {args.source}: holds no dpsm_ray package (dpsm_ray/__init__.py)")
    return args


# ----------------------------------------------------------------------------- the predictor and the requests


def digits_predictor(directory: Path):
    """A digits MLP predictor (random weights, seed 0) calibrated on the digits calibration split, saved in ``directory``."""
    import torch

    from dpsm_ray.cards import build_model, load_splits
    from dpsm_ray.predict.predictor import Predictor

    data = load_splits("digits", seed=0)
    torch.manual_seed(0)
    model = build_model("mlp", 10, input_shape=data.input_shape)
    predictor = Predictor.create(model, architecture="mlp", input_spec=data.input_spec, num_classes=10, alpha=0.1, device="cpu")
    predictor = predictor.recalibrate(data.cal.source.inputs[data.cal.ids], data.cal.labels, example_ids=data.cal.ids)
    predictor.save(directory)
    return predictor


def request_pool(predictor, rows: int) -> list[tuple[bytes, list]]:
    """Bodies of ``rows`` consecutive digits test rows and the sets ``predict_sets`` gives them."""
    from dpsm_ray.cards import load_splits

    data = load_splits("digits", seed=0)
    x = data.test.source.inputs[data.test.ids]
    pool = []
    for start in range(0, len(x) - rows + 1, rows):
        part = x[start : start + rows]
        pool.append((json.dumps({"inputs": part.reshape(rows, -1).tolist()}).encode(), predictor.predict_sets(part).lists))
    return pool


def post(port: int, body: bytes) -> tuple[int, bytes]:
    """One POST /predict on a new connection, closed by the server after its answer (``Connection: close``, as
    urllib sends it): each leaves a TIME_WAIT entry on the server's port."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT_S)
    try:
        connection.request("POST", "/predict", body, {"Content-Type": "application/json", "Connection": "close"})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def outcome(port: int, body: bytes, expected: list | None) -> str:
    """``answered``, ``refused`` (a malformed request's 400), or what went wrong."""
    try:
        status, data = post(port, body)
    except (OSError, http.client.HTTPException) as error:
        return f"{type(error).__name__}"
    if expected is None:
        return "refused" if status == 400 else f"malformed request got {status}"
    if status != 200:
        return f"status {status}"
    return "answered" if json.loads(data)["sets"] == expected else "wrong sets"


# ----------------------------------------------------------------------------- driving one concurrency


def cpu_times() -> tuple[int, int]:
    """(busy, total) clock ticks of every CPU since boot."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def percentile(sorted_values: list[float], p: float) -> float:
    """The nearest-rank percentile (the smallest value with at least p% of the values at or below it)."""
    rank = max(1, -(-len(sorted_values) * p // 100))
    return sorted_values[int(rank) - 1]


def drive(port: int, pool, clients: int, args) -> dict:
    """``clients`` threads sending ``args.requests`` requests in all; their latencies and outcomes."""
    counter = itertools.count()
    results: list[tuple[float, str]] = []
    deadline = time.monotonic() + args.max_seconds

    def client() -> None:
        while True:
            i = next(counter)
            if i >= args.requests or time.monotonic() > deadline:
                return
            malformed = args.malformed_every and i % args.malformed_every == args.malformed_every - 1
            body, expected = (MALFORMED, None) if malformed else pool[i % len(pool)]
            started = time.perf_counter()
            result = outcome(port, body, expected)
            results.append((time.perf_counter() - started, result))

    for body, expected in pool[: min(len(pool), 2 * clients)]:  # warm-up, untimed: one connection each
        outcome(port, body, expected)
    load_before, busy_before, client_before = os.getloadavg()[0], cpu_times(), own_cpu_s()
    started = time.perf_counter()
    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - started
    busy_after = cpu_times()
    latencies = sorted(latency for latency, _ in results)
    counts: dict[str, int] = {}
    for _, result in results:
        counts[result] = counts.get(result, 0) + 1
    return {
        "clients": clients, "requests": len(results), "seconds": seconds, "requests_per_s": len(results) / seconds,
        "p50_ms": 1000 * percentile(latencies, 50), "p95_ms": 1000 * percentile(latencies, 95), "p99_ms": 1000 * percentile(latencies, 99),
        "max_ms": 1000 * latencies[-1], "answered": counts.pop("answered", 0), "refused_malformed": counts.pop("refused", 0), "errors": counts,
        "stopped_by_max_seconds": len(results) < args.requests, "load_average_1m": [load_before, os.getloadavg()[0]],
        "cpu_busy": (busy_after[0] - busy_before[0]) / max(1, busy_after[1] - busy_before[1]),
        "client_cpu_cores": (own_cpu_s() - client_before) / seconds,
    }


# ----------------------------------------------------------------------------- the server's process


class Server:
    """``dpsm-ray serve`` in a session of its own, its output read by a thread."""

    def __init__(self, predictor: Path, port: int, args) -> None:
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        if args.source:
            env["PYTHONPATH"] = str(Path(args.source).resolve())
        self.port = port
        self.command = f"dpsm-ray serve {shlex.quote(str(predictor))} --host 127.0.0.1 --port {port} {args.serve_args}".strip()
        self.launched = time.monotonic()
        self.process = subprocess.Popen(["bash", "-c", f"exec {self.command}"], cwd=args.source or None, env=env, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.output: list[str] = []
        self.lines: queue.Queue = queue.Queue()
        self.seen: dict[int, int] = {}  # every process it started, with its start time (a pid may be reused)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.output.append(line)
            self.lines.put(line)

    def wait_until_serving(self) -> float | None:
        """Seconds from the launch until it serves; None when it exited first."""
        deadline = self.launched + START_S
        while time.monotonic() < deadline:
            self.note_processes()
            try:
                if self.lines.get(timeout=1).startswith("serving "):
                    self.note_processes()
                    return time.monotonic() - self.launched
            except queue.Empty:
                if self.process.poll() is not None:
                    return None
        raise TimeoutError(f"not serving after {START_S} s:\n{''.join(self.output)[-3000:]}")

    def note_processes(self) -> None:
        from dpsm_ray import reaper

        self.seen.update(reaper.descendants(self.process.pid))
        for raylet in reaper.children_named(self.process.pid, "raylet"):
            self.seen.update({pid: reaper.start_time(pid) for pid in reaper.belonging_to(raylet)})

    def alive(self) -> list[int]:
        from dpsm_ray import reaper

        return sorted(pid for pid, started in self.seen.items() if started is not None and reaper.start_time(pid) == started and reaper.alive(pid))

    def interrupt(self) -> dict:
        """Ctrl-C: seconds until the port refuses connections and until the command exits, its exit
        status, and what it started still alive at its exit."""
        self.note_processes()
        closed = {}

        def watch_port() -> None:
            while time.monotonic() < sent + 120:
                with socket.socket() as probe:
                    if probe.connect_ex(("127.0.0.1", self.port)) != 0:
                        closed["at"] = time.monotonic()
                        return
                time.sleep(0.02)

        sent = time.monotonic()
        os.killpg(self.process.pid, signal.SIGINT)
        watcher = threading.Thread(target=watch_port, daemon=True)
        watcher.start()
        status = self.process.wait(timeout=120)
        self.exited = time.monotonic()
        watcher.join(5)
        return {"exit_status": status, "ctrl_c_to_exit_s": self.exited - sent, "ctrl_c_to_port_closed_s": closed.get("at", math.nan) - sent,
                "left_at_exit": [process_name(pid) for pid in self.alive()]}

    def leftovers(self, wait_s: float = 30) -> dict:
        """How long after its exit the last process it started ended, and what is still alive ``wait_s`` seconds after its exit."""
        while self.alive() and time.monotonic() < self.exited + wait_s:
            time.sleep(0.2)
        left = [process_name(pid) for pid in self.alive()]
        return {"all_gone_after_exit_s": None if left else time.monotonic() - self.exited, "left": left, "looked_for_s": wait_s}

    def end(self) -> None:
        """SIGKILL to whatever it started that is still alive (the bench's own cleanup; reported first)."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        for pid in self.alive():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def process_name(pid: int) -> str:
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return str(pid)
    return f"{pid} {command[:80].strip()}"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def restart(predictor: Path, port: int, pool, args, ctrl_c_at: float, exited_at: float) -> dict:
    """The same command on the same port as soon as the first has exited: refused (retried every 2 s, 120 s at most) or serving."""
    refusals = []
    while True:
        server = Server(predictor, port, args)
        try:
            serving_after = server.wait_until_serving()
            if serving_after is None:
                refusals.append("".join(server.output).strip().splitlines()[-1])
                if time.monotonic() - exited_at > 120:
                    return {"accepted": False, "refusals": len(refusals), "refused": sorted(set(refusals))}
                time.sleep(2)
                continue
            record = {"accepted": True, "refusals": len(refusals), "refused": sorted(set(refusals)), "launched_after_exit_s": server.launched - exited_at,
                      "launched_after_ctrl_c_s": server.launched - ctrl_c_at, "serving_after_launch_s": serving_after,
                      "request": outcome(port, *pool[0])}
            record["stop"] = server.interrupt()
            record["stop"].update(server.leftovers())
            return record
        finally:
            server.end()


# ----------------------------------------------------------------------------- report


def table(rows: list[dict]) -> str:
    lines = ["| clients | requests | throughput | p50 | p95 | p99 | errors | malformed -> 400 | CPUs busy | client CPU | load avg (1 min) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        errors = ", ".join(f"{n} {what}" for what, n in r["errors"].items()) or "none"
        lines.append(f"| {r['clients']} | {r['requests']}{' (time cap)' if r['stopped_by_max_seconds'] else ''} | {r['requests_per_s']:.0f} req/s"
                     f" | {r['p50_ms']:.0f} ms | {r['p95_ms']:.0f} ms | {r['p99_ms']:.0f} ms | {errors} | {r['refused_malformed']}"
                     f" | {100 * r['cpu_busy']:.0f}% | {r['client_cpu_cores']:.2f} cores | {r['load_average_1m'][0]:.1f} -> {r['load_average_1m'][1]:.1f} |")
    return "\n".join(lines)


def stopped(stop: dict) -> str:
    gone = f"the last gone {stop['all_gone_after_exit_s']:.1f} s after it" if stop["left"] == [] else f"{len(stop['left'])} still running"
    return (f"port closed {stop['ctrl_c_to_port_closed_s']:.1f} s and exit {stop['exit_status']} {stop['ctrl_c_to_exit_s']:.1f} s after"
            f" Ctrl-C; {len(stop['left_at_exit'])} of its processes running"
            f" at its exit, {gone}" + (f" {stop['looked_for_s']:.0f} s later: {', '.join(stop['left'])}" if stop["left"] else ""))


def stop_lines(stop: dict, again: dict | None) -> list[str]:
    lines = [f"Ctrl-C: {stopped(stop)}"]
    if again is not None and again["accepted"]:
        lines.append(f"restart on the same port: launched {again['launched_after_ctrl_c_s']:.1f} s after Ctrl-C, after {again['refusals']} refusals"
                     f" ({'; '.join(again['refused']) or 'none'}); serving {again['serving_after_launch_s']:.0f} s after its launch, a request"
                     f" {again['request']}; Ctrl-C: {stopped(again['stop'])}")
    elif again is not None:
        lines.append(f"restart on the same port: refused for 120 s ({again['refusals']} tries): {'; '.join(again['refused'])}")
    return lines


def machine() -> dict:
    import ray
    import torch

    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")), "?")
    return {"cpu": model, "cores": os.cpu_count(), "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
            "python": platform.python_version(), "torch": torch.__version__, "ray": ray.__version__, "platform": platform.platform()}


def source_commit(args) -> str:
    where = Path(args.source) if args.source else ROOT
    if (where / "COMMIT").exists():  # a `git archive` copy: its commit written beside it
        return (where / "COMMIT").read_text().strip()
    result = subprocess.run(["git", "-C", str(where), "describe", "--always", "--dirty"], capture_output=True, text=True)
    return result.stdout.strip() or "?"


def terminate(signum, frame) -> None:
    raise KeyboardInterrupt  # SIGTERM (a test's timeout) ends the servers too, in main's finally


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, terminate)
    from dpsm_ray.predict.predictor import Predictor

    with tempfile.TemporaryDirectory(prefix="serve_load_") as scratch:
        if args.predictor:
            predictor_dir = Path(args.predictor).resolve()
            predictor = Predictor.load(predictor_dir, device="cpu")
        else:
            predictor_dir = Path(scratch) / "digits-mlp"
            predictor = digits_predictor(predictor_dir)
        pool = request_pool(predictor, args.rows)
        port = free_port()
        record = {"benchmark": "serve_load", "quick": args.quick, "machine": machine(), "source": args.source or str(ROOT),
                  "commit": source_commit(args), "argv": sys.argv[1:], "rows_per_request": args.rows, "malformed_every": args.malformed_every}
        server = Server(predictor_dir, port, args)
        try:
            record["command"] = server.command
            record["serving_after_s"] = server.wait_until_serving()
            if record["serving_after_s"] is None:
                print("".join(server.output)[-3000:], file=sys.stderr)
                return 1
            record["start_up_lines"] = [line.rstrip() for line in server.output]
            rows = []
            for clients in args.concurrency:
                rows.append(drive(port, pool, clients, args))
                print(f"[bench] {table(rows[-1:]).splitlines()[-1]}", file=sys.stderr, flush=True)
            record["results"] = rows
            record["stop"] = server.interrupt()
            ctrl_c_at = server.exited - record["stop"]["ctrl_c_to_exit_s"]
            # the restart at once, on the same port, while a thread watches the first server's processes end
            watcher = threading.Thread(target=lambda: record["stop"].update(server.leftovers()), daemon=True)
            watcher.start()
            record["restart"] = None if args.no_restart else restart(predictor_dir, port, pool, args, ctrl_c_at, server.exited)
            watcher.join()
            refusals = [line.rstrip() for line in server.output if line.startswith("refused ")]
            record["refusal_lines"] = {"count": len(refusals), "first": refusals[:1]}
            record["server_output_tail"] = [line.rstrip() for line in server.output[-3:]]
        finally:
            server.end()
    emit(record, args.json_out)
    print(f"{record['command']}  (serving after {record['serving_after_s']:.0f} s; {record['rows_per_request']} rows per request)")
    print(table(record["results"]))
    print(f"refusal lines on the server's terminal: {record['refusal_lines']['count']} {record['refusal_lines']['first']}")
    print("\n".join(stop_lines(record["stop"], record["restart"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
