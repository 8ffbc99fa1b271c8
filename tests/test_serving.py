"""dpsm-ray serve: the bearer token -- when one is needed, where it comes from, what a request
must carry -- and the request logic's non_empty; the replica without Ray (concurrent requests
sharing forward passes, the refusal lines); the port check and the start-up line; and, with Ray,
the server under concurrent load stopped with Ctrl-C and started again at once on the same port
(the endpoint's every answer and refusal: tests/test_predictor_sweep.py)."""

import asyncio
import errno
import hashlib
import json
import os
import random
import socket
import stat
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dpsm_ray.cards import build_model, load_splits
from dpsm_ray.predict.predictor import Predictor
from dpsm_ray.predict.serving import (
    REFUSALS_HELD, PredictorServer, RefusalLog, answer, authorized, check_port, is_loopback, serve_token, start_up_line, token_digest,
)

ROOT = Path(__file__).resolve().parents[1]


def test_a_token_is_needed_beyond_this_machine_or_when_a_file_is_given(tmp_path, monkeypatch):
    monkeypatch.setenv("DPSM_RAY_CACHE", str(tmp_path / "cache"))
    for host in ("127.0.0.1", "::1", "localhost", "127.0.0.2"):
        assert is_loopback(host) and serve_token(host, None, False) == (None, None)
    for host in ("0.0.0.0", "::", "10.1.2.3", "example.org"):
        assert not is_loopback(host)
    token, path = serve_token("0.0.0.0", None, False)
    assert path == tmp_path / "cache" / "serve-token" and path.read_text() == token + "\n" and len(token) >= 32
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # readable by its owner only
    assert serve_token("0.0.0.0", None, False) == (token, path)  # the same token the next time
    assert serve_token("0.0.0.0", None, True) == (None, None)  # --no-token
    given, where = serve_token("127.0.0.1", tmp_path / "mine", False)  # a file given: a token on loopback too
    assert where == tmp_path / "mine" and given != token
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["serve-token"]  # no partial file left


def test_a_token_file_others_can_read_or_without_a_token_is_refused_naming_it(tmp_path):
    shared = tmp_path / "shared"
    shared.write_text("a-long-enough-token-for-sure\n")
    os.chmod(shared, 0o644)
    with pytest.raises(ValueError, match=rf"--token-file {shared}: others may read it \(mode 644\); chmod 600"):
        serve_token("0.0.0.0", shared, False)
    short = tmp_path / "short"
    short.write_text("abc\n")
    os.chmod(short, 0o600)
    with pytest.raises(ValueError, match=rf"--token-file {short}: holds no token"):
        serve_token("0.0.0.0", short, False)


def test_a_request_passes_with_the_token_only():
    digest = token_digest("s3cret-token-0123456789")
    assert digest == hashlib.sha256(b"s3cret-token-0123456789").hexdigest()
    assert authorized("Bearer s3cret-token-0123456789", digest) and authorized("bearer  s3cret-token-0123456789 ", digest)
    for header in (None, "", "Bearer", "Bearer wrong", "Basic s3cret-token-0123456789", "s3cret-token-0123456789"):
        assert not authorized(header, digest), header
    assert authorized(None, None)  # no token: every request passes


def test_a_request_may_ask_for_non_empty_sets():
    data = load_splits("digits", seed=0)
    torch.manual_seed(0)
    model = build_model("mlp", 10, input_shape=data.input_shape)
    predictor = Predictor.create(model, architecture="mlp", input_spec=data.input_spec, num_classes=10, alpha=0.8, device="cpu")
    predictor = predictor.recalibrate(data.cal.source.inputs[data.cal.ids], data.cal.labels, example_ids=data.cal.ids)
    x = data.test.source.inputs[data.test.ids][:50]
    status, plain = answer(predictor, json.dumps({"inputs": x.tolist()}).encode(), 100)
    assert status == 200 and [] in plain["sets"]  # alpha 0.8: some sets empty
    status, filled = answer(predictor, json.dumps({"inputs": x.tolist(), "non_empty": True}).encode(), 100)
    assert status == 200 and filled["sets"] == [s or [top] for s, top in zip(plain["sets"], plain["top1"])]
    assert filled["sets"] == predictor.predict_sets(x, non_empty=True).lists
    status, error = answer(predictor, json.dumps({"inputs": x.tolist(), "non_empty": "yes"}).encode(), 100)
    assert status == 400 and error["error"] == '"non_empty" must be true or false'


def test_a_request_may_ask_for_class_conditional_sets_and_p_values():
    data = load_splits("digits", seed=0)
    torch.manual_seed(0)
    model = build_model("mlp", 10, input_shape=data.input_shape)
    predictor = Predictor.create(model, architecture="mlp", input_spec=data.input_spec, num_classes=10, alpha=0.1, device="cpu")
    predictor = predictor.recalibrate(data.cal.source.inputs[data.cal.ids], data.cal.labels, example_ids=data.cal.ids)
    x = data.test.source.inputs[data.test.ids][:40]
    request = {"inputs": x.tolist(), "score": "saps", "ids": list(range(40)), "calibration": "class", "p_values": True}
    status, payload = answer(predictor, json.dumps(request).encode(), 100)
    assert status == 200 and payload["calibration"] == "class" and payload["threshold"] is None
    assert payload["sets"] == predictor.predict_sets(x, "saps", calibration="class").lists
    assert payload["sets"] != predictor.predict_sets(x, "saps").lists  # the marginal sets differ: the request was heard
    assert payload["class_thresholds"] == predictor.class_thresholds("saps").tolist() and payload["fallback_classes"] == []
    assert [[k for k, p in enumerate(row) if p > 0.1] for row in payload["p_values"]] == payload["sets"]
    status, marginal = answer(predictor, json.dumps({"inputs": x.tolist(), "score": "saps"}).encode(), 100)
    assert marginal["calibration"] == "marginal" and marginal["threshold"] == predictor.threshold("saps") and "p_values" not in marginal
    for change, message in (({"calibration": "mondrian"}, '"calibration" must be one of "marginal", "class", "cluster", "rc3p"; got \'mondrian\''),
                            ({"p_values": 1}, '"p_values" must be true or false')):
        status, error = answer(predictor, json.dumps({"inputs": x.tolist(), **change}).encode(), 100)
        assert status == 400 and error["error"] == message


# ----------------------------------------------------------------------------- the replica, without Ray


@pytest.fixture(scope="module")
def digits_predictor_dir(tmp_path_factory):
    """A digits MLP predictor (random weights, seed 0), calibrated on the digits calibration split, on disk."""
    data = load_splits("digits", seed=0)
    torch.manual_seed(0)
    model = build_model("mlp", 10, input_shape=data.input_shape)
    predictor = Predictor.create(model, architecture="mlp", input_spec=data.input_spec, num_classes=10, alpha=0.1, device="cpu")
    predictor = predictor.recalibrate(data.cal.source.inputs[data.cal.ids], data.cal.labels, example_ids=data.cal.ids)
    return predictor.save(tmp_path_factory.mktemp("served") / "digits-mlp")


def digits_rows(start: int, count: int):
    data = load_splits("digits", seed=0)
    return data.test.source.inputs[data.test.ids][start : start + count]


def replica(directory, **options):
    return PredictorServer(str(directory), "cpu", 4096, **{"batch_rows": 512, "batch_wait_ms": 50.0, "torch_threads": 1, **options})


def test_concurrent_requests_share_one_forward_pass_and_each_gets_the_sets_predict_gives(digits_predictor_dir):
    """Twelve requests at once (10 rows each, as [n, 1, 8, 8] or [n, 64], floats or integers,
    different scores, ids and flags; the seventh malformed): one forward pass answers the eleven
    good ones, each with exactly the sets ``predict_sets`` gives its own rows, and the malformed
    one is refused alone with 400."""
    predictor = Predictor.load(digits_predictor_dir, device="cpu")
    server = replica(digits_predictor_dir)
    requests, expected = [], []
    for i in range(12):
        rows = digits_rows(10 * i, 10)
        if i == 6:
            requests.append({"inputs": [[1.0, 2.0, 3.0]] * 10})
            expected.append(None)
            continue
        score, ids = ("aps", list(range(100 * i, 100 * i + 10))) if i % 3 == 1 else ("hps", None)
        inputs = rows.long() if i == 8 else rows.reshape(10, 64) if i % 2 else rows  # integers (JSON 3, not 3.0) beside floats
        request = {"inputs": inputs.tolist(), "score": score, "non_empty": i % 4 == 3}
        if ids is not None:
            request["ids"] = ids
        if i == 5:
            request["probabilities"] = True
        requests.append(request)
        expected.append((predictor.predict_sets(rows, score, example_ids=ids, non_empty=i % 4 == 3).lists, predictor.predict_proba(rows)))

    async def at_once():
        return await asyncio.gather(*(server.predict(json.dumps(r).encode()) for r in requests))

    answers = asyncio.run(at_once())
    assert server.batcher.passes == 1
    for i, ((status, payload), want) in enumerate(zip(answers, expected)):
        if want is None:
            assert status == 400 and payload["error"] == "inputs must have shape [n, 1, 8, 8] (or [n, 8, 8], or [n, 64] flattened); got [10, 3]"
            continue
        sets, probs = want
        assert status == 200 and payload["sets"] == sets, i
        assert payload["score"] == requests[i]["score"] and payload["top1"] == probs.argmax(1).tolist()
    assert (torch.tensor(answers[5][1]["probabilities"], dtype=torch.float64) - expected[5][1]).abs().max() < 1e-6


def test_a_forward_pass_takes_at_most_batch_rows_inputs_and_a_larger_request_runs_alone(digits_predictor_dir):
    predictor = Predictor.load(digits_predictor_dir, device="cpu")
    server = replica(digits_predictor_dir, batch_rows=25)
    sizes = [10] * 7 + [30]  # 10 + 10 fit in 25, a third does not: passes of 20, 20, 20, 10, then the 30 alone
    bodies = [json.dumps({"inputs": digits_rows(10 * i, n).tolist()}).encode() for i, n in enumerate(sizes)]

    async def at_once():
        return await asyncio.gather(*(server.predict(body) for body in bodies))

    answers = asyncio.run(at_once())
    assert server.batcher.passes == 5
    for i, (n, (status, payload)) in enumerate(zip(sizes, answers)):
        assert status == 200 and payload["sets"] == predictor.predict_sets(digits_rows(10 * i, n)).lists


def test_a_table_s_predictor_takes_objects_of_feature_names_in_any_order_and_refuses_missing_or_extra_ones(digits_predictor_dir, tmp_path):
    """Inputs as {"feature": value} objects, keys shuffled, get the sets their rows get in the
    model's order -- unbatched and sharing a forward pass; a missing or an unexpected name is
    refused with 400 naming it; arrays keep their positional order; a predictor without feature
    names refuses objects."""
    data = load_splits("digits", seed=0)
    names = [f"pixel_{i}" for i in range(64)]
    torch.manual_seed(0)
    model = build_model("mlp", 10, input_shape=data.input_shape)
    predictor = Predictor.create(model, architecture="mlp", input_spec=data.input_spec, num_classes=10, alpha=0.1, feature_names=names,
                                 device="cpu")
    predictor = predictor.recalibrate(data.cal.source.inputs[data.cal.ids], data.cal.labels, example_ids=data.cal.ids)
    rows = digits_rows(0, 6).reshape(6, 64)
    shuffle = random.Random(0)
    records = []
    for row in rows.tolist():
        pairs = list(zip(names, row))
        shuffle.shuffle(pairs)
        records.append(dict(pairs))
    assert list(records[0]) != names  # the keys really are out of order
    expected = predictor.predict_sets(rows).lists
    status, payload = answer(predictor, json.dumps({"inputs": records, "probabilities": True}).encode(), 100)
    assert status == 200 and payload["sets"] == expected and payload["probabilities"] == predictor.predict_proba(rows).tolist()
    status, payload = answer(predictor, json.dumps({"inputs": rows.tolist()}).encode(), 100)
    assert status == 200 and payload["sets"] == expected
    server = replica(predictor.save(tmp_path / "named"))
    missing = [dict(records[0]), *records[1:]]
    del missing[0]["pixel_5"]
    extra = [*records[:3], {**records[3], "colour": 1.0}]

    async def at_once():
        return await asyncio.gather(*(server.predict(json.dumps({"inputs": inputs}).encode()) for inputs in (records, missing, extra)))

    (status, named), (missing_status, missing_error), (extra_status, extra_error) = asyncio.run(at_once())
    assert status == 200 and named["sets"] == expected
    assert missing_status == 400 and missing_error["error"].startswith("input 0: the predictor takes the 64 features it trained on, by name;")
    assert "missing 1 ('pixel_5')" in missing_error["error"]
    assert extra_status == 400 and extra_error["error"].startswith("input 3: ") and "unexpected 1 ('colour')" in extra_error["error"]
    unnamed = Predictor.load(digits_predictor_dir, device="cpu")
    status, error = answer(unnamed, json.dumps({"inputs": records}).encode(), 100)
    assert status == 400 and error["error"].startswith("this predictor has no feature names")


def http_request(method: str, path: str, body: bytes = b"", authorization: str | None = None):
    """A Starlette request as Serve's proxy hands one to the replica."""
    from starlette.requests import Request

    headers = [(b"content-type", b"application/json")] + ([(b"authorization", authorization.encode())] if authorization else [])
    scope = {"type": "http", "method": method, "path": path, "raw_path": path.encode(), "query_string": b"", "headers": headers,
             "client": ("10.1.2.3", 50123), "server": ("127.0.0.1", 8000), "scheme": "http", "root_path": "", "http_version": "1.1"}

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    return Request(scope, receive)


def test_every_refusal_is_one_line_for_the_terminal_without_the_token_or_the_body(digits_predictor_dir):
    """The lines a replica hands the serve command (which prints them): 401, 400, 404 and 405,
    each naming the method, path, client, status and error; control characters in the path are
    escaped; an answered request adds none."""
    token = "s3cret-token-0123456789"
    lines: list[str] = []
    server = replica(digits_predictor_dir, token_sha256=token_digest(token), refusals=SimpleNamespace(record=SimpleNamespace(remote=lines.append)))
    good = json.dumps({"inputs": digits_rows(0, 2).tolist()}).encode()
    bad = json.dumps({"inputs": [[7.0] * 3]}).encode()
    calls = [("POST", "/predict", good, "Bearer wrong-token-0123456789"), ("POST", "/predict", bad, f"Bearer {token}"),
             ("POST", "/predict", good, f"Bearer {token}"), ("GET", "/nowhere\x1b[31m", b"", f"Bearer {token}"),
             ("GET", "/predict", b"", f"Bearer {token}"), ("GET", "/health", b"", None)]

    async def send():
        return [await server(http_request(*call)) for call in calls]

    statuses = [response.status_code for response in asyncio.run(send())]
    assert statuses == [401, 400, 200, 404, 405, 200]
    assert lines == [
        "refused POST /predict from 10.1.2.3: 401 no valid bearer token",
        "refused POST /predict from 10.1.2.3: 400 inputs must have shape [n, 1, 8, 8] (or [n, 8, 8], or [n, 64] flattened); got [1, 3]",
        r"refused GET /nowhere\x1b[31m from 10.1.2.3: 404 no route /nowhere\x1b[31m: POST /predict or GET /health",
        "refused GET /predict from 10.1.2.3: 405 /predict takes a POST with a JSON body",
    ]
    assert not any(token in line or "wrong-token" in line or "7.0" in line for line in lines)


def test_the_refusal_log_holds_a_bounded_number_of_lines_and_counts_the_rest():
    log = RefusalLog()
    for i in range(REFUSALS_HELD + 7):
        log.record(f"line {i}")
    lines, dropped = log.drain()
    assert lines == [f"line {i}" for i in range(REFUSALS_HELD)] and dropped == 7
    assert log.drain() == ([], 0)


# ----------------------------------------------------------------------------- the port and the start-up line


def test_the_port_check_refuses_a_listened_port_and_accepts_one_left_in_time_wait():
    """A server that just stopped leaves its closed connections in TIME_WAIT on its port for ~60 s:
    a probe without SO_REUSEADDR is refused there (shown first, so the test would catch it), the
    port check is not; a port something listens on is refused, on its own address or any."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as Serve's server (asyncio) listens: its TIME_WAIT entries carry it
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    with pytest.raises(OSError, match=rf"cannot listen on 127.0.0.1:{port} \(Address already in use\); pass another --port or --host"):
        check_port("127.0.0.1", port)
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = listener.accept()
    accepted.close()  # the server closes first: its side of the connection waits in TIME_WAIT
    client.recv(1)
    client.close()
    listener.close()
    with socket.socket() as plain, pytest.raises(OSError) as refused:
        plain.bind(("127.0.0.1", port))
    assert refused.value.errno == errno.EADDRINUSE
    check_port("127.0.0.1", port)
    with socket.socket() as everywhere:
        everywhere.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        everywhere.bind(("0.0.0.0", port))
        everywhere.listen()
        with pytest.raises(OSError, match="Address already in use"):
            check_port("127.0.0.1", port)


def test_the_start_up_line_names_an_address_a_client_can_reach(monkeypatch):
    monkeypatch.setattr(socket, "gethostname", lambda: "box.example")
    path = Path("/p/dpsm")
    assert start_up_line(path, 1, "cpu", "127.0.0.1", 8000) == (
        "serving /p/dpsm on 1 replica (cpu): POST http://127.0.0.1:8000/predict, GET http://127.0.0.1:8000/health; Ctrl-C stops"
    )
    assert start_up_line(path, 2, "cuda", "0.0.0.0", 8000) == (
        "serving /p/dpsm on 2 replicas (cuda), listening on every interface (0.0.0.0:8000): POST http://box.example:8000/predict,"
        " GET http://box.example:8000/health (from this machine: http://127.0.0.1:8000/predict); Ctrl-C stops"
    )
    assert "listening on every interface ([::]:8000)" in start_up_line(path, 1, "cpu", "::", 8000)
    assert "(from this machine: http://[::1]:8000/predict)" in start_up_line(path, 1, "cpu", "::", 8000)
    assert "POST http://[::1]:9000/predict" in start_up_line(path, 1, "cpu", "::1", 9000)


# ----------------------------------------------------------------------------- with Ray: load, Ctrl-C, a restart at once


@pytest.mark.ray
def test_the_server_holds_concurrent_clients_stops_on_ctrl_c_and_restarts_on_the_same_port_at_once(tmp_path):
    """``bench/serve_load.py --quick``: ``dpsm-ray serve`` on 127.0.0.1 answers 2 and 8 concurrent
    clients (every answer the sets ``predict_sets`` gives, every malformed request refused with
    400 and a line on the server's terminal); after Ctrl-C, with the traffic's closed connections
    in TIME_WAIT on the port, the same command is accepted on the same port at once, serves, and
    stops; neither server leaves a process behind.  The bench stops its servers whatever fails."""
    out = tmp_path / "serve_load.json"
    bench = subprocess.Popen([sys.executable, str(ROOT / "bench" / "serve_load.py"), "--quick", "--json-out", str(out)], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = bench.communicate(timeout=600)
    finally:
        if bench.poll() is None:
            bench.terminate()  # the bench stops its servers on SIGTERM
            bench.communicate(timeout=120)
    assert bench.returncode == 0, output[-3000:]
    record = json.loads(out.read_text())
    assert [r["clients"] for r in record["results"]] == [2, 8]
    for row in record["results"]:
        assert row["errors"] == {} and row["answered"] + row["refused_malformed"] == row["requests"] == 60 and row["refused_malformed"] == 1
    assert record["refusal_lines"]["count"] == 2 and "400 inputs must have shape" in record["refusal_lines"]["first"][0]
    stop, again = record["stop"], record["restart"]
    assert stop["exit_status"] == 0 and stop["left"] == [] and record["server_output_tail"][-1] == "stopping"
    assert again["accepted"] and again["refusals"] == 0 and again["launched_after_exit_s"] < 2 and again["request"] == "answered"
    assert again["stop"]["exit_status"] == 0 and again["stop"]["left"] == []
