"""``dpsm-ray serve``: a predictor behind a JSON endpoint on Ray Serve (docs/predictor.md).

    POST /predict  {"inputs": [[...], ...], "score": "hps", "calibration": "class", "ids": [...], "probabilities": false,
                    "p_values": false, "non_empty": false}
                -> {"sets": [[3], [1, 7]], "set_size": [1, 2], "top1": [3, 7], "set_names": ..., "top1_name": ...,
                    "score": "hps", "calibration": "class", "alpha": 0.1, "threshold": null, "class_thresholds": [...],
                    "fallback_classes": [], "p_values": [[...], ...]}
    GET  /health   {"status": "ok", "run_id": ..., "classes": K, "input_shape": [...], "thresholds": {...}, ...}

``inputs`` are raw inputs as ``Predictor.predict_sets`` takes them (``[n, *shape]`` or
``[n, features]``), or, for a predictor trained on a table, one object per input of its feature
names in any order (``Predictor.named_inputs``: missing or unexpected names are refused);
``score``, ``calibration`` (``marginal``; ``class``, ``cluster`` or ``rc3p``: a threshold per class; default the
predictor's own), ``ids`` (integers drawing the randomised scores' uniforms, default ``0 .. n-1``),
``probabilities``, ``p_values`` (each input's conformal p-value of every class) and ``non_empty``
(the top class in every empty set: ``Predictor.predict_sets``) are optional.  A bad request gets
a 4xx status and ``{"error": "<one line>"}``; the replica goes on serving.  ``answer`` is the whole
request logic, without Ray (``_parse_request``, a forward pass, ``_respond``); ``PredictorServer``
puts it on a Serve replica, its forward passes shared.

**Under load** a replica takes up to ``--max-ongoing`` requests at once and joins the inputs of
those waiting into one forward pass (``RowBatcher``: up to ``--batch-rows`` inputs, waiting up to
``--batch-wait-ms`` for more), so added clients queue instead of collapsing throughput.  Serve's
default of 5 requests per replica made its router back off and retry the others (25 ms, doubling to
0.5 s) while the replica idled: 127 requests/s with 8 clients fell to 12 with 32 (bench/serve_load.py;
the same collapse returns beyond ``--max-ongoing`` clients per replica).  Each request is checked
on its own before it joins a batch, so a malformed one is refused alone; the forward pass is the
only shared work, and each caller's sets are computed from its own rows.

**A bearer token** guards every request but ``GET /health`` when the server listens beyond this
machine (any ``--host`` but a loopback address), or whenever ``--token-file`` is given: requests
carry ``Authorization: Bearer TOKEN``, others get 401.  The token is read from ``--token-file`` (a
file only its owner may read), or generated into it -- by default ``$DPSM_RAY_CACHE/serve-token``
-- and never printed; the replicas hold only its SHA-256.  ``--no-token`` serves without one, and
says what that opens.  **Every refusal** (4xx) is one line on the serve command's terminal (method,
path, client, status, the error; never a body or a token): a replica's own log goes to Ray's session
files only, so the replicas hand the lines to a small actor (``RefusalLog``) the command drains.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import json
import logging
import math
import os
import secrets
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

from dpsm_ray.conformal import CALIBRATIONS
from dpsm_ray.predict.predictor import InputError, Predictor, PredictorError, check_ids

_MAX_BODY_BYTES = 64 * 2**20  # 64 MiB: 4096 CIFAR images as JSON numbers take ~40 MiB
_QUOTED_CALIBRATIONS = ", ".join(f'"{name}"' for name in CALIBRATIONS)  # as JSON writes them
_REQUEST_FIELDS = ("inputs", "score", "calibration", "ids", "probabilities", "p_values", "non_empty")
_TOKEN_FILE = "serve-token"  # under the cache folder, when --token-file is not given
_MIN_TOKEN_CHARS = 16
REFUSALS_HELD = 200  # refusal lines the RefusalLog holds between two drains; the rest are counted
_REFUSALS_EVERY_S = 0.5  # how often the serve command prints the refusal lines


def is_loopback(host: str) -> bool:
    """Whether ``host`` is an address only this machine can reach."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve beyond this machine
        return False


def serve_token(host: str, token_file: str | os.PathLike | None, no_token: bool) -> tuple[str | None, Path | None]:
    """The token requests must carry and the file it is in; (None, None) without one: on a
    loopback host unless ``token_file`` is given, or with ``no_token``.  ValueError naming the file
    when it cannot be used."""
    from dpsm_ray.files import cache_home

    if no_token:
        return None, None
    if token_file is None:
        if is_loopback(host):
            return None, None
        token_file = cache_home() / _TOKEN_FILE
    path = Path(token_file).expanduser()
    return (_read_token(path) if path.exists() else _new_token(path)), path


def _read_token(path: Path) -> str:
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        raise ValueError(f"--token-file {path}: others may read it (mode {mode:o}); chmod 600 {path}, or give another file")
    token = path.read_text(encoding="utf-8").strip()
    if len(token) < _MIN_TOKEN_CHARS or any(c.isspace() for c in token):
        raise ValueError(f"--token-file {path}: holds no token (one line of at least {_MIN_TOKEN_CHARS} characters without spaces)")
    return token


def _new_token(path: Path) -> str:
    """A random token written to ``path``, readable by its owner only, whole or not at all."""
    token = secrets.token_urlsafe(32)
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(f".{path.name}.{os.getpid()}.part")
    handle = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(handle, (token + "\n").encode())
        os.fsync(handle)
    finally:
        os.close(handle)
    os.replace(part, path)
    return token


def token_digest(token: str | None) -> str | None:
    return None if token is None else hashlib.sha256(token.encode()).hexdigest()


def authorized(header: str | None, digest: str | None) -> bool:
    """Whether an ``Authorization`` header carries the token whose SHA-256 is ``digest`` (any
    request passes without a token)."""
    if digest is None:
        return True
    scheme, _, presented = (header or "").partition(" ")
    if scheme.lower() != "bearer" or not presented.strip():
        return False
    return hmac.compare_digest(hashlib.sha256(presented.strip().encode()).hexdigest(), digest)


class Parsed(NamedTuple):
    """A checked POST /predict request."""

    inputs: object  # torch.Tensor [n, *shape]: Predictor.check_inputs's
    score: str
    ids: object  # torch.Tensor [n] of the randomised scores' uniforms' ids
    probabilities: bool
    non_empty: bool
    calibration: str  # marginal | class | cluster | rc3p
    p_values: bool


def _parse_request(predictor: Predictor, body: bytes, max_batch: int) -> Parsed | tuple[int, dict]:
    """The request in ``body``, checked as a whole before it joins a forward pass, or ``(4xx
    status, {"error": "<one line>"})``."""
    import numpy as np

    try:
        request = json.loads(body)
    except (ValueError, UnicodeDecodeError) as error:
        return 400, {"error": f"the body is not JSON ({str(error)[:120]}); send {{\"inputs\": [...]}}"}
    if not isinstance(request, dict) or "inputs" not in request:
        return 400, {"error": "the body must be a JSON object with an \"inputs\" field: {\"inputs\": [[...], ...]}"}
    unknown = sorted(set(request) - set(_REQUEST_FIELDS))
    if unknown:
        return 400, {"error": f"unknown field {unknown[0]!r}; the fields are {', '.join(_REQUEST_FIELDS)}"}
    inputs, score = request["inputs"], request.get("score", "hps")
    if not isinstance(inputs, list):
        return 400, {"error": f"\"inputs\" must be a list of inputs; got {type(inputs).__name__}"}
    if not inputs:
        return 400, {"error": "empty batch: \"inputs\" holds no input"}
    if len(inputs) > max_batch:
        return 413, {"error": f"{len(inputs)} inputs in one request; at most {max_batch} (dpsm-ray serve --max-batch)"}
    if score not in predictor.info["scores"]:  # the scores it was calibrated for
        return 400, {"error": f"\"score\" must be one of {', '.join(predictor.info['scores'])}; got {score!r}"}
    for flag in ("probabilities", "p_values", "non_empty"):
        if not isinstance(request.get(flag, False), bool):
            return 400, {"error": f"\"{flag}\" must be true or false"}
    try:  # the calibration, and what it and the p-values need of the predictor
        calibration = predictor.check_request(score, request.get("calibration"), request.get("p_values", False))
    except PredictorError as error:
        return 400, {"error": str(error)}
    except ValueError:
        return 400, {"error": f"\"calibration\" must be one of {_QUOTED_CALIBRATIONS}; got {request.get('calibration')!r}"}
    try:
        # objects of feature names (a predictor trained on a table), or arrays in the model's order
        rows = predictor.check_inputs(predictor.named_inputs(inputs) if isinstance(inputs[0], dict) else np.asarray(inputs))
    except InputError as error:
        return 400, {"error": str(error)}
    except ValueError:  # numpy refuses ragged nesting
        return 400, {
            "error": f"\"inputs\" must be a rectangular array of numbers, shape [n, {', '.join(map(str, predictor.input_spec.shape))}]"
        }
    try:
        ids = check_ids(request.get("ids"), len(rows))
    except ValueError as error:  # InputError, or numpy's for ragged ids
        return 400, {"error": str(error) if isinstance(error, InputError) else f"\"ids\" must be {len(rows)} integers, one per input"}
    return Parsed(rows, score, ids, request.get("probabilities", False), request.get("non_empty", False), calibration,
                  request.get("p_values", False))


def _respond(predictor: Predictor, request: Parsed, probs) -> tuple[int, dict]:
    """``(200, payload)`` of a checked request from its inputs' softmax rows ``probs``."""
    sets = predictor.sets_from_proba(probs, request.score, calibration=request.calibration, example_ids=request.ids,
                                     non_empty=request.non_empty)
    q = predictor.threshold(request.score)
    payload = {"sets": sets.lists, "set_size": [len(s) for s in sets.lists], "top1": probs.argmax(dim=1).tolist(),
               "score": request.score, "calibration": request.calibration, "alpha": predictor.alpha,
               "threshold": q if math.isfinite(q) and request.calibration == "marginal" else None}
    if request.calibration != "marginal":  # null: a class every set holds, too few calibration points for alpha
        thresholds, rank_limits = predictor.set_thresholds(request.score, request.calibration)
        payload["class_thresholds"] = [v if math.isfinite(v) else None for v in thresholds.tolist()]
        payload["fallback_classes"] = [k for k, v in enumerate(thresholds.tolist()) if math.isinf(v)
                                       and (rank_limits is None or rank_limits[k] >= predictor.num_classes)]
        if rank_limits is not None:
            payload["rank_limits"] = rank_limits.tolist()
    names = predictor.class_names
    if names is not None:
        payload["set_names"] = [[names[k] for k in s] for s in sets.lists]
        payload["top1_name"] = [names[k] for k in payload["top1"]]
    if request.probabilities:
        payload["probabilities"] = probs.tolist()
    if request.p_values:
        payload["p_values"] = predictor.p_values_from_proba(probs, request.score, calibration=request.calibration,
                                                            example_ids=request.ids).tolist()
    return 200, payload


def answer(predictor: Predictor, body: bytes, max_batch: int) -> tuple[int, dict]:
    """``(HTTP status, JSON payload)`` of a POST /predict with ``body``, its inputs in a forward
    pass of their own."""
    request = _parse_request(predictor, body, max_batch)
    if not isinstance(request, Parsed):
        return request
    return _respond(predictor, request, predictor.ordered_proba(request.inputs))


def health(predictor: Predictor, max_batch: int) -> dict:
    info = predictor.info
    return {"status": "ok", "run_id": info["run_id"], "method": info["method"], "architecture": info["model"]["architecture"],
            "classes": predictor.num_classes, "class_names": predictor.class_names, "input_shape": list(predictor.input_spec.shape),
            "input": predictor.input_spec.raw, "alpha": predictor.alpha, "calibration": predictor.calibrated_by,
            "thresholds": {kind: (q if math.isfinite(q) else None) for kind, q in predictor.thresholds.items()}, "max_batch": max_batch}


class RowBatcher:
    """The inputs of concurrent callers joined into one forward pass.

    One pass runs at a time, in a worker thread (the event loop goes on taking requests).  Each
    takes the callers waiting, in arrival order, up to ``max_rows`` inputs (a caller with more runs
    alone).  A caller that finds no pass running waits up to ``wait_s`` for others while they hold
    fewer than ``max_rows`` inputs; the callers that arrive during a pass make up the next one at
    once.  Each caller gets back the rows of its own inputs; a pass that raises, raises in its
    callers only."""

    def __init__(self, forward, max_rows: int, wait_s: float, threads: int | None = None) -> None:
        import torch

        self.forward, self.max_rows, self.wait_s = forward, max_rows, wait_s
        self.waiting: list[tuple[object, asyncio.Future]] = []
        self.arrived: asyncio.Event | None = None  # made in the event loop that serves
        self.running: asyncio.Task | None = None
        # torch's thread count is per thread: set in the worker that runs the passes
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="forward", initializer=torch.set_num_threads if threads else None,
                                         initargs=(threads,) if threads else ())
        self.passes = 0  # forward passes run

    async def __call__(self, rows):
        """The forward pass's output for ``rows`` (a tensor ``[n, ...]``), once a pass has run them."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.waiting.append((rows, future))
        if self.arrived is None:
            self.arrived = asyncio.Event()
        self.arrived.set()
        if self.running is None or self.running.done():
            self.running = loop.create_task(self.run())
        return await future

    def waiting_rows(self) -> int:
        return sum(len(rows) for rows, _ in self.waiting)

    async def run(self) -> None:
        import torch

        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait_s  # for the first pass only: the later ones take who came during the last
        while self.waiting:
            while self.waiting_rows() < self.max_rows and loop.time() < deadline:
                self.arrived.clear()
                try:
                    await asyncio.wait_for(self.arrived.wait(), deadline - loop.time())
                except asyncio.TimeoutError:
                    break
            batch = [self.waiting.pop(0)]
            size = len(batch[0][0])
            while self.waiting and size + len(self.waiting[0][0]) <= self.max_rows:
                batch.append(self.waiting.pop(0))
                size += len(batch[-1][0])
            batch = [(rows, future) for rows, future in batch if not future.done()]  # a caller gone (its request cancelled)
            if not batch:
                continue
            # no conversion here: each input reaches the model as it would alone (torch.cat promotes integers to float64, exactly)
            joined = torch.cat([rows for rows, _ in batch]) if len(batch) > 1 else batch[0][0]
            try:
                output = await loop.run_in_executor(self.worker, self.forward, joined)
            except Exception as error:  # noqa: BLE001 -- handed to the callers, each answers with it
                for _, future in batch:
                    if not future.done():
                        future.set_exception(error)
                continue
            self.passes += 1
            for (_, future), part in zip(batch, output.split([len(rows) for rows, _ in batch])):
                if not future.done():
                    future.set_result(part)


class RefusalLog:
    """The refusal lines of the replicas, until the serve command drains them to its terminal (a
    Ray actor; a replica's own log reaches Ray's session files only).  Holds ``REFUSALS_HELD``
    lines between two drains and counts the rest."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.dropped = 0

    def record(self, line: str) -> None:
        if len(self.lines) < REFUSALS_HELD:
            self.lines.append(line)
        else:
            self.dropped += 1

    def drain(self) -> tuple[list[str], int]:
        lines, dropped = self.lines, self.dropped
        self.lines, self.dropped = [], 0
        return lines, dropped


def _printable(text: str, limit: int = 240) -> str:
    """``text`` safe for a terminal: control characters escaped, at most ``limit`` characters."""
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class PredictorServer:
    """The Serve replica: one loaded predictor, routes /predict and /health; /predict requests
    share forward passes (``RowBatcher``), refusals go to ``refusals`` (a ``RefusalLog`` actor)."""

    def __init__(
        self,
        predictor_dir: str,
        device: str,
        max_batch: int,
        token_sha256: str | None = None,
        trust_code: bool = False,
        *,
        batch_rows: int,
        batch_wait_ms: float,
        torch_threads: int | None = None,
        refusals=None,
    ) -> None:
        import torch

        if torch_threads:
            torch.set_num_threads(torch_threads)
        self.predictor = Predictor.load(predictor_dir, device=device, trust_code=trust_code)
        self.max_batch = max_batch
        self.token_sha256 = token_sha256
        self.batcher = RowBatcher(self.predictor.ordered_proba, batch_rows, batch_wait_ms / 1000, torch_threads)
        self.refusals = refusals

    async def predict(self, body: bytes) -> tuple[int, dict]:
        """``answer``'s ``(status, payload)``, the forward pass shared with concurrent requests."""
        request = _parse_request(self.predictor, body, self.max_batch)
        if not isinstance(request, Parsed):
            return request
        return _respond(self.predictor, request, await self.batcher(request.inputs))

    def refused(self, request, path: str, status: int, error: str) -> None:
        """One line naming a refused request (never its body or headers), in the replica's log and on the serve command's terminal."""
        client = request.client.host if request.client else "?"
        line = f"refused {_printable(request.method, 16)} {_printable(path or '/', 120)} from {client}: {status} {_printable(error)}"
        logging.getLogger("dpsm_ray.serve").warning("%s", line)
        if self.refusals is not None:
            self.refusals.record.remote(line)

    async def __call__(self, request):
        from starlette.responses import JSONResponse

        path = request.url.path.rstrip("/")
        if path == "/health" and request.method == "GET":
            return JSONResponse(health(self.predictor, self.max_batch))
        if not authorized(request.headers.get("authorization"), self.token_sha256):
            self.refused(request, path, 401, "no valid bearer token")
            return JSONResponse(
                {
                    "error": (
                        "this endpoint needs the header 'Authorization: Bearer TOKEN', the token in the file dpsm-ray serve "
                        "named when it started"
                    )
                },
                status_code=401,
                headers={"WWW-Authenticate": "Bearer"},
            )
        status, payload = await self.route(request, path)
        if status >= 400:
            self.refused(request, path, status, payload["error"])
        return JSONResponse(payload, status_code=status)

    async def route(self, request, path: str) -> tuple[int, dict]:
        if path == "/health":
            return 405, {"error": "/health takes a GET"}
        if path != "/predict":
            return 404, {"error": f"no route {path or '/'}: POST /predict or GET /health"}
        if request.method != "POST":
            return 405, {"error": "/predict takes a POST with a JSON body"}
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > _MAX_BODY_BYTES:
                return 413, {"error": f"the body exceeds {_MAX_BODY_BYTES // 2**20} MiB"}
        return await self.predict(bytes(body))


def check_port(host: str, port: int) -> None:
    """Raise ``OSError`` naming the address when something listens on it (before Ray starts:
    Serve's proxy would otherwise retry it in the background forever).  The probe sets
    ``SO_REUSEADDR``, as Serve's own server does: the closed connections of a server that just
    stopped (TIME_WAIT, ~60 s) do not block a restart; a listening socket still does."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as error:
            raise OSError(f"cannot listen on {host}:{port} ({error.strerror}); pass another --port or --host") from None


def start_up_line(path: Path, replicas: int, device: str, host: str, port: int) -> str:
    """What is served and where to send requests: for a wildcard ``host`` (0.0.0.0, ::) it listens
    on every interface, and the URLs name this machine."""
    served = f"serving {path} on {replicas} replica{'s' if replicas > 1 else ''} ({device})"
    try:
        wildcard = ipaddress.ip_address(host).is_unspecified
    except ValueError:
        wildcard = False
    if wildcard:
        url, here = f"http://{socket.gethostname()}:{port}", f"http://{'127.0.0.1' if ':' not in host else '[::1]'}:{port}"
        return (f"{served}, listening on every interface ({'[::]' if ':' in host else host}:{port}): POST {url}/predict, GET {url}/health"
                f" (from this machine: {here}/predict); Ctrl-C stops")
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    return f"{served}: POST {url}/predict, GET {url}/health; Ctrl-C stops"


def serve_predictor(
    path: Path,
    *,
    host: str,
    port: int,
    replicas: int,
    device: str,
    cpus_per_replica: float,
    max_batch: int,
    max_ongoing: int,
    batch_rows: int,
    batch_wait_ms: float,
    torch_threads: int | None = None,
    address: str | None = None,
    token: str | None = None,
    token_file: Path | None = None,
    trust_code: bool = False,
    log=None,
) -> None:
    """Serve the predictor in ``path`` until Ctrl-C or SIGTERM, printing each refused request,
    then shut Serve and Ray down (``check_port`` and ``serve_token`` first, for a one-line error).
    With ``token``, every request but GET /health must carry it.  Each replica holds up to
    ``max_ongoing`` requests, their inputs joined into forward passes (``RowBatcher``: ``batch_rows``,
    ``batch_wait_ms``), and computes with ``torch_threads`` threads (default: its CPUs, at least 1)."""
    import torch

    import ray
    from ray import serve

    from dpsm_ray.train.ray_session import ensure_ray

    log = log or (lambda line: print(line, flush=True))
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    logging.getLogger("ray.serve").setLevel(logging.WARNING)
    session = refusals = None
    try:
        session = ensure_ray(address, worker_output=False)
        # after ray.init, which installs a SIGTERM handler of its own that only prints a stack:
        # SIGTERM (and Ctrl-C, even where the shell ignored it) shut Serve and Ray down
        for stop in (signal.SIGTERM, signal.SIGINT):
            signal.signal(stop, _interrupt)
        serve.start(http_options={"host": host, "port": port}, logging_config={"enable_access_log": False})
        refusals = ray.remote(num_cpus=0)(RefusalLog).remote()
        resources = {"num_cpus": cpus_per_replica, "num_gpus": 1 / replicas if device == "cuda" else 0}  # the replicas share one GPU
        # a replica that stops gets 2 s for the requests it holds (Serve's default: 20 s) -- what Ctrl-C waits for on a cluster
        deployment = serve.deployment(PredictorServer, name="predictor", num_replicas=replicas, ray_actor_options=resources,
                                      max_ongoing_requests=max_ongoing, graceful_shutdown_timeout_s=2, graceful_shutdown_wait_loop_s=0.2,
                                      logging_config={"enable_access_log": False})
        threads = torch_threads or max(1, int(cpus_per_replica))
        server = deployment.bind(str(path), device, max_batch, token_digest(token), trust_code, batch_rows=batch_rows,
                                 batch_wait_ms=batch_wait_ms, torch_threads=threads, refusals=refusals)
        serve.run(server, name="dpsm-ray", route_prefix="/")
        log(start_up_line(path, replicas, device, host, port))
        if token is not None:
            log(f"requests but GET /health need the header 'Authorization: Bearer TOKEN', the token in {token_file}")
        elif not is_loopback(host):
            log(f"warning: no token (--no-token): anyone who can reach {host}:{port} can query the model and occupy its replicas")
        while True:
            time.sleep(_REFUSALS_EVERY_S)
            _print_refusals(refusals, log)
    except KeyboardInterrupt:
        if refusals is not None:  # the refusals of the last moments
            try:
                _print_refusals(refusals, log, timeout_s=2)
            except (KeyboardInterrupt, ray.exceptions.RayError):
                pass
        log("stopping")
    finally:
        if ray.is_initialized():
            with silenced_output():  # Serve's teardown makes Ray report the controller it kills as a failed task
                # an instance of its own ends with this process, its proxy and replicas with it: Serve's own
                # shutdown, which drains each proxy and replica first, is for a cluster that stays up
                if session is None or not session.embedded:
                    serve.shutdown()
                ray.shutdown()


def _print_refusals(refusals, log, timeout_s: float | None = None) -> None:
    """Print the lines the ``RefusalLog`` actor ``refusals`` holds, and how many it left out."""
    import ray

    lines, dropped = ray.get(refusals.drain.remote(), timeout=timeout_s)
    for line in lines:
        log(line)
    if dropped:
        log(f"... and {dropped} more refusals (not shown)")


class silenced_output:
    """This process's stdout and stderr (the file descriptors: Ray's log monitor writes to them from
    its own thread) sent to /dev/null inside the block, and restored after it."""

    def __enter__(self):
        import sys

        sys.stdout.flush()
        sys.stderr.flush()
        self.saved = [os.dup(fd) for fd in (1, 2)]
        devnull = os.open(os.devnull, os.O_WRONLY)
        for fd in (1, 2):
            os.dup2(devnull, fd)
        os.close(devnull)
        return self

    def __exit__(self, *exc) -> None:
        for fd, saved in zip((1, 2), self.saved):
            os.dup2(saved, fd)
            os.close(saved)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt
