"""``dpsm-ray serve``: a predictor behind a JSON endpoint on Ray Serve (docs/predictor.md).

    POST /predict  {"inputs": [[...], ...], "score": "hps", "ids": [...], "probabilities": false, "non_empty": false}
                -> {"sets": [[3], [1, 7]], "set_size": [1, 2], "top1": [3, 7], "set_names": ..., "top1_name": ...,
                    "score": "hps", "alpha": 0.1, "threshold": 0.83}
    GET  /health   {"status": "ok", "run_id": ..., "classes": K, "input_shape": [...], "thresholds": {...}, ...}

``inputs`` are raw inputs as ``Predictor.predict_sets`` takes them (``[n, *shape]`` or
``[n, features]``); ``score``, ``ids`` (integers drawing the APS/RAPS uniforms, default
``0 .. n-1``), ``probabilities`` and ``non_empty`` (the top class in every empty set:
``Predictor.predict_sets``) are optional.  A bad request gets a 4xx status and
``{"error": "<one line>"}``; the replica goes on serving.  ``answer`` is the whole request logic,
without Ray; ``PredictorServer`` puts it on a Serve replica.

**A bearer token** guards every request but ``GET /health`` when the server listens beyond this
machine (any ``--host`` but a loopback address), or whenever ``--token-file`` is given: requests
carry ``Authorization: Bearer TOKEN``, others get 401 and a log line without their body.  The token
is read from ``--token-file`` (a file only its owner may read), or generated into it -- by default
``$DPSM_RAY_CACHE/serve-token`` -- and never printed; the replicas hold only its SHA-256.
``--no-token`` serves without one, and says what that opens.
"""

from __future__ import annotations

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
from pathlib import Path

from dpsm_ray.predict.predictor import InputError, Predictor

MAX_BODY_BYTES = 64 * 2**20  # 64 MiB: 4096 CIFAR images as JSON numbers take ~40 MiB
REQUEST_FIELDS = ("inputs", "score", "ids", "probabilities", "non_empty")
TOKEN_FILE = "serve-token"  # under the cache folder, when --token-file is not given
MIN_TOKEN_CHARS = 16


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
        token_file = cache_home() / TOKEN_FILE
    path = Path(token_file).expanduser()
    return (read_token(path) if path.exists() else new_token(path)), path


def read_token(path: Path) -> str:
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        raise ValueError(f"--token-file {path}: others may read it (mode {mode:o}); chmod 600 {path}, or give another file")
    token = path.read_text(encoding="utf-8").strip()
    if len(token) < MIN_TOKEN_CHARS or any(c.isspace() for c in token):
        raise ValueError(f"--token-file {path}: holds no token (one line of at least {MIN_TOKEN_CHARS} characters without spaces)")
    return token


def new_token(path: Path) -> str:
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


def answer(predictor: Predictor, body: bytes, max_batch: int) -> tuple[int, dict]:
    """``(HTTP status, JSON payload)`` of a POST /predict with ``body``."""
    import numpy as np

    try:
        request = json.loads(body)
    except (ValueError, UnicodeDecodeError) as error:
        return 400, {"error": f"the body is not JSON ({str(error)[:120]}); send {{\"inputs\": [...]}}"}
    if not isinstance(request, dict) or "inputs" not in request:
        return 400, {"error": "the body must be a JSON object with an \"inputs\" field: {\"inputs\": [[...], ...]}"}
    unknown = sorted(set(request) - set(REQUEST_FIELDS))
    if unknown:
        return 400, {"error": f"unknown field {unknown[0]!r}; the fields are {', '.join(REQUEST_FIELDS)}"}
    inputs, score = request["inputs"], request.get("score", "hps")
    if not isinstance(inputs, list):
        return 400, {"error": f"\"inputs\" must be a list of inputs; got {type(inputs).__name__}"}
    if not inputs:
        return 400, {"error": "empty batch: \"inputs\" holds no input"}
    if len(inputs) > max_batch:
        return 413, {"error": f"{len(inputs)} inputs in one request; at most {max_batch} (dpsm-ray serve --max-batch)"}
    if score not in predictor.info["scores"]:  # the scores it was calibrated for
        return 400, {"error": f"\"score\" must be one of {', '.join(predictor.info['scores'])}; got {score!r}"}
    for flag in ("probabilities", "non_empty"):
        if not isinstance(request.get(flag, False), bool):
            return 400, {"error": f"\"{flag}\" must be true or false"}
    try:
        array = np.asarray(inputs)
    except ValueError:  # numpy refuses ragged nesting
        return 400, {
            "error": f"\"inputs\" must be a rectangular array of numbers, shape [n, {', '.join(map(str, predictor.input_spec.shape))}]"
        }
    try:
        probs = predictor.predict_proba(array)
        sets = predictor.sets_from_proba(probs, score, example_ids=request.get("ids"), non_empty=request.get("non_empty", False))
    except InputError as error:
        return 400, {"error": str(error)}
    q = predictor.threshold(score)
    payload = {"sets": sets.lists, "set_size": [len(s) for s in sets.lists], "top1": probs.argmax(dim=1).tolist(),
               "score": score, "alpha": predictor.alpha, "threshold": q if math.isfinite(q) else None}
    names = predictor.class_names
    if names is not None:
        payload["set_names"] = [[names[k] for k in s] for s in sets.lists]
        payload["top1_name"] = [names[k] for k in payload["top1"]]
    if request.get("probabilities", False):
        payload["probabilities"] = probs.tolist()
    return 200, payload


def health(predictor: Predictor, max_batch: int) -> dict:
    info = predictor.info
    return {"status": "ok", "run_id": info["run_id"], "method": info["method"], "architecture": info["model"]["architecture"],
            "classes": predictor.num_classes, "class_names": predictor.class_names, "input_shape": list(predictor.input_spec.shape),
            "input": predictor.input_spec.raw, "alpha": predictor.alpha,
            "thresholds": {kind: (q if math.isfinite(q) else None) for kind, q in predictor.thresholds.items()}, "max_batch": max_batch}


class PredictorServer:
    """The Serve replica: one loaded predictor, routes /predict and /health."""

    def __init__(self, predictor_dir: str, device: str, max_batch: int, token_sha256: str | None = None, trust_code: bool = False) -> None:
        self.predictor = Predictor.load(predictor_dir, device=device, trust_code=trust_code)
        self.max_batch = max_batch
        self.token_sha256 = token_sha256

    async def __call__(self, request):
        from starlette.responses import JSONResponse

        path = request.url.path.rstrip("/")
        if path == "/health" and request.method == "GET":
            return JSONResponse(health(self.predictor, self.max_batch))
        if not authorized(request.headers.get("authorization"), self.token_sha256):
            client = request.client.host if request.client else "?"
            logging.getLogger("dpsm_ray.serve").warning("refused %s %s from %s: no valid bearer token", request.method, path or "/", client)
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
        if path == "/health":
            return JSONResponse({"error": "/health takes a GET"}, status_code=405)
        if path != "/predict":
            return JSONResponse({"error": f"no route {path or '/'}: POST /predict or GET /health"}, status_code=404)
        if request.method != "POST":
            return JSONResponse({"error": "/predict takes a POST with a JSON body"}, status_code=405)
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > MAX_BODY_BYTES:
                return JSONResponse({"error": f"the body exceeds {MAX_BODY_BYTES // 2**20} MiB"}, status_code=413)
        status, payload = answer(self.predictor, bytes(body), self.max_batch)
        return JSONResponse(payload, status_code=status)


def check_port(host: str, port: int) -> None:
    """Raise ``OSError`` naming the address when it cannot be listened on (before Ray starts:
    Serve's proxy would otherwise retry it in the background forever)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        try:
            probe.bind((host, port))
        except OSError as error:
            raise OSError(f"cannot listen on {host}:{port} ({error.strerror}); pass another --port or --host") from None


def serve_predictor(
    path: Path,
    *,
    host: str,
    port: int,
    replicas: int,
    device: str,
    cpus_per_replica: float,
    max_batch: int,
    address: str | None = None,
    token: str | None = None,
    token_file: Path | None = None,
    trust_code: bool = False,
    log=None,
) -> None:
    """Serve the predictor in ``path`` until Ctrl-C or SIGTERM, then shut Serve and Ray down
    (``check_port`` and ``serve_token`` first, for a one-line error).  With ``token``, every
    request but GET /health must carry it."""
    import torch

    import ray
    from ray import serve

    from dpsm_ray.train.ray_session import ensure_ray

    log = log or (lambda line: print(line, flush=True))
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    logging.getLogger("ray.serve").setLevel(logging.WARNING)
    try:
        ensure_ray(address, worker_output=False)
        # after ray.init, which installs a SIGTERM handler of its own that only prints a stack:
        # SIGTERM (and Ctrl-C, even where the shell ignored it) shut Serve and Ray down
        for stop in (signal.SIGTERM, signal.SIGINT):
            signal.signal(stop, _interrupt)
        serve.start(http_options={"host": host, "port": port})
        resources = {"num_cpus": cpus_per_replica, "num_gpus": 1 / replicas if device == "cuda" else 0}  # the replicas share one GPU
        deployment = serve.deployment(PredictorServer, name="predictor", num_replicas=replicas, ray_actor_options=resources)
        serve.run(deployment.bind(str(path), device, max_batch, token_digest(token), trust_code), name="dpsm-ray", route_prefix="/")
        log(f"serving {path} on {replicas} replica{'s' if replicas > 1 else ''} ({device}): POST http://{host}:{port}/predict, "
            f"GET http://{host}:{port}/health; Ctrl-C stops")
        if token is not None:
            log(f"requests but GET /health need the header 'Authorization: Bearer TOKEN', the token in {token_file}")
        elif not is_loopback(host):
            log(f"warning: no token (--no-token): anyone who can reach {host}:{port} can query the model and occupy its replicas")
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        log("stopping")
    finally:
        if ray.is_initialized():
            with silenced_output():  # Serve's teardown makes Ray report the controller it kills as a failed task
                serve.shutdown()
                ray.shutdown()


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
