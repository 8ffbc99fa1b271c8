"""``dpsm-ray export --format torchscript|onnx``: a predictor's sets with torch alone, or onnxruntime and numpy alone.

Each export's LOAD.md holds its loader; the tests run that code as written (in this process, and once per format in a
process where dpsm_ray cannot be imported) and compare its sets with ``Predictor.predict_sets`` on held-out raw inputs:
every score, every set rule (calibration), both formats.  The predictor is a digits MLP trained here for 60 full-batch steps
(under a second), its inputs standardised as the dataset's card prepares them, so the exported module must prepare raw
inputs itself.  No Ray.
"""

import ast
import importlib.util
import json
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from dpsm_ray.cards import build_model, load_splits, score_card, score_names
from dpsm_ray.cli import main
from dpsm_ray.conformal import CALIBRATIONS, example_uniforms, label_ranks
from dpsm_ray.files import write_checked_json
from dpsm_ray.predict import portable
from dpsm_ray.predict.export import CHOICE_RULE
from dpsm_ray.predict.portable import LOAD_FILE, LOADERS, MODEL_FILES, THRESHOLDS_FILE, export_portable
from dpsm_ray.predict.predictor import Predictor, PredictorError
from dpsm_ray.storage.layout import INDEX_FILE, PREDICTORS, SWEEP_FILE

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.load` is deprecated:FutureWarning")  # the TorchScript loader's
FORMATS = tuple(MODEL_FILES)
ONLY = {"torchscript": {"json", "torch"}, "onnx": {"json", "numpy", "onnxruntime"}}  # what each loader may import


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    """The trained predictor (class-conditional unless asked otherwise), saved, and the test split's raw inputs and ids."""
    data = load_splits("digits", seed=0)
    torch.manual_seed(0)
    model = build_model("mlp", 10, input_shape=data.input_shape)
    inputs, labels = data.input_spec.apply(data.train.source.inputs[data.train.ids]), data.train.labels
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a network this small trains about 20 times faster on one thread than on two that share the cores
    try:
        for _ in range(60):
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(inputs), labels).backward()
            optimizer.step()
    finally:
        torch.set_num_threads(threads)
    predictor = Predictor.create(model.eval(), architecture="mlp", input_spec=data.input_spec, num_classes=10, alpha=0.1,
                                 class_names=data.class_names, uniform_seed=7, device="cpu")
    predictor = predictor.recalibrate(data.cal.source.inputs[data.cal.ids], data.cal.labels, by="class", example_ids=data.cal.ids)
    directory = predictor.save(tmp_path_factory.mktemp("predictor") / "digits")
    return predictor, directory, data.test.source.inputs[data.test.ids].numpy(), data.test.ids.numpy()


def loader(directory):
    """``prediction_sets`` of the export's LOAD.md, its code run as written in a namespace of its own."""
    code = loader_code(directory)
    namespace = {}
    exec(compile(code, str(directory / LOAD_FILE), "exec"), namespace)
    return namespace["prediction_sets"]


def loader_code(directory) -> str:
    return re.search(r"```python\n(.*?)```", (directory / LOAD_FILE).read_text(encoding="utf-8"), re.S).group(1)


def imports(code: str) -> set[str]:
    tree = ast.parse(code)
    return ({alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
            | {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)})


def exported_outputs(directory, x, u=None):
    """The exported module's (scores, ranks) as numpy, run the way its format runs."""
    rule = json.loads((directory / THRESHOLDS_FILE).read_text())
    if rule["model"] == MODEL_FILES["onnx"]:
        import onnxruntime

        session = onnxruntime.InferenceSession(str(directory / rule["model"]), providers=["CPUExecutionProvider"])
        return session.run(None, {"x": x.astype(np.float32), **({"u": u} if u is not None else {})})
    with torch.no_grad():
        module = torch.jit.load(str(directory / rule["model"]))
        return [t.numpy() for t in module(torch.from_numpy(x).float(), *([torch.from_numpy(u)] if u is not None else []))]


# ----------------------------------------------------------------------------- the sets


@pytest.mark.parametrize("form", FORMATS)
@pytest.mark.parametrize("score", score_names())
def test_the_loader_gives_the_predictor_s_sets_for_every_score(digits, tmp_path, form, score):
    predictor, _, x, ids = digits
    out = export_portable(predictor, tmp_path / "out", form, score=score)
    assert imports(loader_code(out)) == ONLY[form]
    sets = np.asarray(loader(out)(out, x, ids))
    expected = predictor.predict_sets(x, score, example_ids=ids).mask
    assert expected.dtype == bool and (sets == expected).all()
    sizes = expected.sum(1)  # a model about 0.95 accurate: sets of several sizes, none of every class
    assert len(set(sizes.tolist())) > 1 and sizes.max() < 10
    assert (np.asarray(loader(out)(out, x[:1], ids[:1])) == expected[:1]).all()  # one input: the batch axis is free
    # the scores themselves: TorchScript runs torch's kernels, bit for bit; ONNX Runtime its own float32 ones
    u = example_uniforms(predictor.uniform_seed, torch.from_numpy(ids)).numpy() if score_card(score).randomised else None
    scores, ranks = exported_outputs(out, x, u)
    mine = predictor.score_matrix(predictor.predict_proba(x), score, example_ids=ids).numpy()
    assert (ranks == label_ranks(predictor.predict_proba(x)).numpy()).all()
    if form == "torchscript":
        assert (scores == mine).all()
    else:
        assert np.abs(scores - mine).max() < 1e-5  # float32 rounding of the logits: 1.3e-6 at most, when this test was written


@pytest.mark.parametrize("form", FORMATS)
@pytest.mark.parametrize("calibration", CALIBRATIONS)
def test_the_loader_gives_the_predictor_s_sets_for_every_calibration(digits, tmp_path, form, calibration):
    predictor, _, x, ids = digits
    out = export_portable(predictor, tmp_path / "out", form, score="aps", calibration=calibration)
    rule = json.loads((out / THRESHOLDS_FILE).read_text())
    thresholds, rank_limits = predictor.set_thresholds("aps", calibration)
    assert rule["calibration"] == calibration and rule["score"] == "aps" and rule["alpha"] == 0.1
    assert rule["thresholds"] == [None if q == float("inf") else q for q in thresholds.tolist()]  # exact: JSON keeps every bit
    assert rule["rank_limits"] == (rank_limits.tolist() if rank_limits is not None else [10] * 10)
    assert rule["uniforms"]["seed"] == 7 and rule["class_names"] == predictor.class_names
    sets = np.asarray(loader(out)(out, x, ids))
    assert (sets == predictor.predict_sets(x, "aps", calibration=calibration, example_ids=ids).mask).all()
    assert (np.asarray(loader(out)(out, x)) == predictor.predict_sets(x, "aps", calibration=calibration).mask).all()  # ids 0 .. n-1


@pytest.mark.parametrize("form", FORMATS)
def test_a_risk_controlled_predictor_exports_its_own_sets(digits, tmp_path, form):
    predictor, _, x, ids = digits
    data = load_splits("digits", seed=0)
    risky = predictor.control_risk(data.cal.source.inputs[data.cal.ids], data.cal.labels, {3: 1.0, 8: 0.5}, 0.02, example_ids=data.cal.ids)
    out = export_portable(risky, tmp_path / "out", form, score="aps")  # calibration: its own, risk
    rule = json.loads((out / THRESHOLDS_FILE).read_text())
    assert rule["calibration"] == "risk" and len(set(rule["thresholds"])) == 1  # lambda, for every class
    assert (np.asarray(loader(out)(out, x, ids)) == risky.predict_sets(x, "aps", example_ids=ids).mask).all()


def test_rc3p_s_rank_limits_are_what_the_loader_applies(digits, tmp_path):
    predictor, _, x, ids = digits
    _, rank_limits = predictor.set_thresholds("hps", "rc3p")
    assert rank_limits.min() < 10  # some class is limited: the rank test is not idle
    out = export_portable(predictor, tmp_path / "out", "onnx", score="hps", calibration="rc3p")
    rule = json.loads((out / THRESHOLDS_FILE).read_text())
    unlimited = dict(rule, rank_limits=[10] * 10)
    (out / THRESHOLDS_FILE).write_text(json.dumps(unlimited))
    without = np.asarray(loader(out)(out, x, ids))
    expected = predictor.predict_sets(x, "hps", calibration="rc3p", example_ids=ids).mask
    assert (without >= expected).all() and (without != expected).any()  # the limits drop classes the thresholds admit


def test_the_loader_s_uniforms_are_dpsm_ray_s(tmp_path):
    ids = np.array([0, 1, 2, 1_000_003, 2**31 - 1, 2**40 + 5, -1, -(2**35)], dtype=np.int64)
    for seed in (0, 7, 2**62 + 12345):
        expected = example_uniforms(seed, torch.from_numpy(ids)).numpy()
        for form in FORMATS:
            namespace = {}
            exec(LOADERS[form], namespace)
            assert (np.asarray(namespace["uniforms"](seed, ids)) == expected).all()


def test_raw_inputs_go_in_the_module_prepares_them(digits, tmp_path):
    predictor, _, x, _ = digits
    spec = predictor.input_spec
    assert spec.divisor == 16.0 and np.abs(np.asarray(spec.mean)).max() > 0  # the card standardises: raw and prepared differ
    out = export_portable(predictor, tmp_path / "out", "torchscript")
    raw_scores, _ = exported_outputs(out, x)
    prepared_scores, _ = exported_outputs(out, spec.apply(torch.from_numpy(x)).numpy())
    assert (raw_scores == predictor.score_matrix(predictor.predict_proba(x), "hps").numpy()).all()
    assert not np.allclose(prepared_scores, raw_scores)


def test_tied_probabilities_rank_the_lower_class_first_in_both_formats(digits, tmp_path):
    predictor, _, x, ids = digits
    model = build_model("mlp", 10, input_shape=predictor.input_spec.shape)
    model.load_state_dict(predictor.model.state_dict())
    last = [m for m in model.modules() if isinstance(m, torch.nn.Linear)][-1]
    with torch.no_grad():  # classes 2, 5 and 7: the same logit, the bias alone, so the same probability everywhere
        last.weight[[2, 5, 7]] = 0.0
        last.bias[[2, 5, 7]] = 0.5
    tied = Predictor.create(model, architecture="mlp", input_spec=predictor.input_spec, num_classes=10, alpha=0.1, device="cpu")
    data = load_splits("digits", seed=0)
    tied = tied.recalibrate(data.cal.source.inputs[data.cal.ids], data.cal.labels, example_ids=data.cal.ids)
    probs = tied.predict_proba(x)
    assert (probs[:, 2] == probs[:, 5]).all() and (probs[:, 5] == probs[:, 7]).all()
    for form in FORMATS:
        out = export_portable(tied, tmp_path / form, form, score="aps")
        _, ranks = exported_outputs(out, x, example_uniforms(7, torch.from_numpy(ids)).numpy())
        assert (ranks[:, 5] == ranks[:, 2] + 1).all() and (ranks[:, 7] == ranks[:, 2] + 2).all()  # by hand: 2, then 5, then 7
        assert (np.asarray(loader(out)(out, x, ids)) == tied.predict_sets(x, "aps", example_ids=ids).mask).all()


@pytest.mark.parametrize("form", FORMATS)
def test_the_loader_runs_where_dpsm_ray_cannot_be_imported(digits, tmp_path, form):
    predictor, _, x, ids = digits
    out = export_portable(predictor, tmp_path / "out", form, score="raps", calibration="marginal")
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "ids.npy", ids)
    blocked = ["dpsm_ray"] + (["torch"] if form == "onnx" else [])
    script = "\n".join([
        "import sys", *(f"sys.modules[{name!r}] = None" for name in blocked), "import numpy as np",
        loader_code(out), f"x, ids = np.load({str(tmp_path / 'x.npy')!r}), np.load({str(tmp_path / 'ids.npy')!r})",
        f"sets = prediction_sets({str(out)!r}, x, ids)",
        f"np.save({str(tmp_path / 'sets.npy')!r}, np.asarray(sets))",
    ])
    subprocess.run([sys.executable, "-W", "ignore", "-c", script], check=True, cwd=tmp_path, timeout=120)
    assert (np.load(tmp_path / "sets.npy") == predictor.predict_sets(x, "raps", calibration="marginal", example_ids=ids).mask).all()


# ----------------------------------------------------------------------------- the command and its refusals


def export(*argv) -> int:
    return main(["export", *map(str, argv)])


def refused(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as ended:
        export(*argv)
    assert ended.value.code == 2
    return capsys.readouterr().err.strip()


def test_export_of_a_predictor_directory_writes_whole_and_refuses_an_existing_out(digits, tmp_path, capsys):
    predictor, directory, x, ids = digits
    out = tmp_path / "portable"
    assert export(directory, "--format", "onnx", "--score", "aps", "--out", out) == 0
    assert sorted(p.name for p in out.iterdir()) == [LOAD_FILE, "model.onnx", THRESHOLDS_FILE]
    assert f"-> {out}: aps sets, class calibration, alpha 0.1" in capsys.readouterr().out
    rule = json.loads((out / THRESHOLDS_FILE).read_text())
    assert rule["calibration"] == "class" and rule["source"]["predictor"] == str(directory.resolve())  # the predictor's own
    assert (np.asarray(loader(out)(out, x, ids)) == predictor.predict_sets(x, "aps", example_ids=ids).mask).all()
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    message = refused(capsys, directory, "--format", "onnx", "--out", out)
    assert message.endswith(f"--out {out} holds an export already; choose another directory, or --overwrite it")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert export(directory, "--format", "torchscript", "--calibration", "marginal", "--out", out, "--overwrite") == 0
    assert sorted(p.name for p in out.iterdir()) == [LOAD_FILE, "model.pt", THRESHOLDS_FILE]
    assert json.loads((out / THRESHOLDS_FILE).read_text())["calibration"] == "marginal"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["portable"]  # no temporary directory left beside it
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    message = refused(capsys, directory, "--format", "onnx", "--out", tmp_path / "mine", "--overwrite")
    assert "is a non-empty directory without an export in it" in message and (tmp_path / "mine" / "notes.txt").read_text() == "mine"


def test_an_export_that_fails_leaves_the_earlier_one_and_nothing_half_written(digits, tmp_path, monkeypatch):
    predictor, _, _, _ = digits
    out = export_portable(predictor, tmp_path / "out", "onnx")
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def cut_short(module, example, path):
        path.write_bytes(b"half a model")
        raise OSError("disk gone")

    monkeypatch.setattr(portable, "write_torchscript", cut_short)
    for target in (out, tmp_path / "new"):
        with pytest.raises(OSError, match="disk gone"):
            export_portable(predictor, target, "torchscript", overwrite=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_sweep_s_chosen_predictor_exports_in_either_format(digits, tmp_path, capsys):
    _, directory, _, _ = digits
    results = tmp_path / "results"
    (results / PREDICTORS).mkdir(parents=True)
    (results / SWEEP_FILE).write_text("{}")
    Predictor.load(directory, device="cpu").save(results / PREDICTORS / "dpsm-seed0")
    entry = {"name": "dpsm-seed0", "directory": f"{PREDICTORS}/dpsm-seed0", "method": "dpsm", "seed": 0}
    write_checked_json(results / PREDICTORS / INDEX_FILE, {"rule": CHOICE_RULE, "predictors": [entry], "chosen": {"dpsm": "dpsm-seed0"}})
    assert export(results, "--method", "dpsm", "--format", "torchscript", "--out", tmp_path / "portable") == 0
    source = json.loads((tmp_path / "portable" / THRESHOLDS_FILE).read_text())["source"]
    assert source["chosen_by"] == CHOICE_RULE and source["predictor"] == str((results / PREDICTORS / "dpsm-seed0").resolve())
    assert export(results, "--method", "dpsm", "--seed", "0", "--out", tmp_path / "copy") == 0  # --format predictor, as before
    assert Predictor.load(tmp_path / "copy").info["provenance"]["chosen_by"] == "--seed 0"
    assert "dpsm: dpsm-seed0 (--seed 0) ->" in capsys.readouterr().out


def test_the_command_refuses_what_does_not_fit_in_one_line(digits, tmp_path, capsys, monkeypatch):
    predictor, directory, _, _ = digits
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / SWEEP_FILE).write_text("{}")
    out = tmp_path / "out"
    for argv, message in [
        ((directory, "--out", out), "is a predictor already: --format torchscript or onnx exports it to run without dpsm_ray"),
        ((directory, "--method", "dpsm", "--format", "onnx", "--out", out), "is a predictor directory: --method and --seed choose among"),
        ((tmp_path / "results", "--format", "onnx", "--out", out), "is a sweep's results directory: --method names the method"),
        ((tmp_path / "results", "--method", "dpsm", "--score", "aps", "--out", out), "--score and --calibration choose the sets of"),
        ((tmp_path, "--format", "onnx", "--out", out), "is neither a sweep's results directory (no sweep.json) nor a predictor directory"),
    ]:
        error = refused(capsys, *argv)
        assert message in error and "\n" not in error
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *rest: None if name == "onnx" else real(name, *rest))
    error = refused(capsys, directory, "--format", "onnx", "--out", out)
    assert error.endswith('--format onnx needs the onnx package, which torch\'s exporter writes with: pip install "dpsm_ray[onnx]"')
    assert not out.exists()


def test_a_bf16_model_and_an_uncalibrated_score_are_refused(digits, tmp_path):
    predictor, _, _, _ = digits
    info = dict(predictor.info, model=dict(predictor.info["model"], precision="bf16"))
    with pytest.raises(PredictorError, match=r"^this predictor's model runs in bf16 \(model.precision\): only an fp32 model exports"):
        export_portable(Predictor(predictor.model, info, device="cpu"), tmp_path / "out", "onnx")
    bare = Predictor.create(predictor.model, architecture="mlp", input_spec=predictor.input_spec, num_classes=10, alpha=0.1, device="cpu")
    with pytest.raises(PredictorError, match="no calibrated threshold for hps"):
        export_portable(bare, tmp_path / "out", "torchscript")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("form", FORMATS)
def test_a_computation_that_does_not_trace_to_one_graph_is_refused(digits, tmp_path, monkeypatch, form):
    predictor, _, _, _ = digits

    class ByValue(torch.nn.Module):  # Python control flow on a value: a trace would keep the example's branch
        def forward(self, x, u=None):
            scores = torch.zeros(x.shape[0], 10, dtype=torch.float64)
            return (scores + 1 if float(x.sum()) > 0 else scores), torch.ones(x.shape[0], 10, dtype=torch.int64)

    monkeypatch.setattr(portable, "set_scores", lambda predictor, score: ByValue())
    with pytest.raises(PredictorError, match=r"^the model or the hps score does not trace to one graph for every input, so it does not "
                                             r"export \(Converting a tensor to a Python"):
        export_portable(predictor, tmp_path / "out", form)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_docs_show_the_onnx_loader_as_exports_write_it():
    from pathlib import Path

    docs = (Path(__file__).resolve().parents[1] / "docs" / "predictor.md").read_text(encoding="utf-8")
    section = docs.split("## Predictors without the package", 1)[1].split("\n## ", 1)[0]
    assert f"```python\n{LOADERS['onnx']}```" in section
