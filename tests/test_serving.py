"""dpsm-ray serve without Ray (the served endpoint itself: tests/test_predictor_sweep.py): the bearer
token -- when one is needed, where it comes from, what a request must carry -- and the request
logic's non_empty."""

import hashlib
import os
import stat

import pytest

from dpsm_ray.predict.serving import answer, authorized, is_loopback, serve_token, token_digest


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
    import json

    import torch

    from dpsm_ray.cards import load_splits
    from dpsm_ray.cards import build_model
    from dpsm_ray.predict.predictor import Predictor

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
