"""``dpsm-ray serve``: a predictor behind a JSON endpoint on Ray Serve (docs/predictor.md).

    POST /predict  {"inputs": [[...], ...], "score": "hps", "ids": [...], "probabilities": false}
                -> {"sets": [[3], [1, 7]], "set_size": [1, 2], "top1": [3, 7], "set_names": ..., "top1_name": ...,
                    "score": "hps", "alpha": 0.1, "threshold": 0.83}
    GET  /health   {"status": "ok", "run_id": ..., "classes": K, "input_shape": [...], "thresholds": {...}, ...}

``inputs`` are raw inputs as ``Predictor.predict_sets`` takes them (``[n, *shape]`` or
``[n, features]``); ``score``, ``ids`` (integers drawing the APS/RAPS uniforms, default
``0 .. n-1``) and ``probabilities`` are optional.  A bad request gets a 4xx status and
``{"error": "<one line>"}``; the replica goes on serving.  ``answer`` is the whole request logic,
without Ray; ``PredictorServer`` puts it on a Serve replica.
"""

from __future__ import annotations

import json
import math
import signal
import socket
import time
from pathlib import Path

from dpsm_ray.conformal import SCORE_KINDS
from dpsm_ray.predict.predictor import InputError, Predictor

MAX_BODY_BYTES = 64 * 2**20  # 64 MiB: 4096 CIFAR images as JSON numbers take ~40 MiB
REQUEST_FIELDS = ("inputs", "score", "ids", "probabilities")


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
    if score not in SCORE_KINDS:
        return 400, {"error": f"\"score\" must be one of {', '.join(SCORE_KINDS)}; got {score!r}"}
    if not isinstance(request.get("probabilities", False), bool):
        return 400, {"error": "\"probabilities\" must be true or false"}
    try:
        array = np.asarray(inputs)
    except ValueError:  # numpy refuses ragged nesting
        return 400, {"error": f"\"inputs\" must be a rectangular array of numbers, shape [n, {', '.join(map(str, predictor.input_spec.shape))}]"}
    try:
        probs = predictor.predict_proba(array)
        sets = predictor.sets_from_proba(probs, score, example_ids=request.get("ids"))
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
    card = predictor.card
    return {"status": "ok", "run_id": card["run_id"], "method": card["method"], "architecture": card["model"]["architecture"],
            "classes": predictor.num_classes, "class_names": predictor.class_names, "input_shape": list(predictor.input_spec.shape),
            "input": predictor.input_spec.raw, "alpha": predictor.alpha,
            "thresholds": {kind: (q if math.isfinite(q) else None) for kind, q in predictor.thresholds.items()}, "max_batch": max_batch}


class PredictorServer:
    """The Serve replica: one loaded predictor, routes /predict and /health."""

    def __init__(self, predictor_dir: str, device: str, max_batch: int) -> None:
        self.predictor = Predictor.load(predictor_dir, device=device)
        self.max_batch = max_batch

    async def __call__(self, request):
        from starlette.responses import JSONResponse

        path = request.url.path.rstrip("/")
        if path == "/health":
            if request.method != "GET":
                return JSONResponse({"error": "/health takes a GET"}, status_code=405)
            return JSONResponse(health(self.predictor, self.max_batch))
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


def serve_predictor(path: Path, *, host: str, port: int, replicas: int, device: str, cpus_per_replica: float, max_batch: int,
                    address: str | None = None, log=None) -> None:
    """Serve the predictor in ``path`` until Ctrl-C or SIGTERM, then shut Serve and Ray down
    (``check_port`` first, for a one-line error)."""
    import logging

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
        serve.run(deployment.bind(str(path), device, max_batch), name="dpsm-ray", route_prefix="/")
        log(f"serving {path} on {replicas} replica{'s' if replicas > 1 else ''} ({device}): POST http://{host}:{port}/predict, "
            f"GET http://{host}:{port}/health; Ctrl-C stops")
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        log("stopping")
    finally:
        if ray.is_initialized():
            serve.shutdown()
            ray.shutdown()


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt
