"""The report from hand-made results directories (no Ray): its tables against hand computations,
its LaTeX, and its figures (files, colours, scales, captions)."""

import hashlib
import json
import math
import re
import zlib

import matplotlib
import pandas as pd
import pytest
from matplotlib.colors import to_rgba

from dpsm_ray.results.figures import COLUMN_WIDTH, PAGE_WIDTH, STYLES, Context, draw_figures, method_style, name_of, y_scale
from dpsm_ray.results.report import comparisons, identical_scores, paper_table, write_report
from fabricated import SIZES, fabricate

matplotlib.use("Agg")
T_975_2 = 4.302652729911275  # Student t quantile, 0.975, 2 degrees of freedom
FIGURES = {"coverage_box", "apss_box", "losses", "loss_gaps", "q_error", "set_size_gap", "class_coverage"}


def quiet(text):
    pass


@pytest.fixture(scope="module")
def reported(tmp_path_factory):
    """The hand-made directory (fabricated.py's defaults) with its report written once: the tests
    that only read that report share it (each report draws every figure, ~3 s)."""
    results = fabricate(tmp_path_factory.mktemp("reported"))
    write_report(results, log=quiet)
    return results


# --- the paired change ---------------------------------------------------------------------


def test_dpsm_against_the_best_baseline_is_a_per_seed_paired_interval_by_hand(reported):
    """CE (10.0 every seed) is the best baseline; DPSM's 10.01, 10.02, 10.03 are changes of
    +0.1%, +0.2%, +0.3%: mean 0.2, sd 0.1, half-width t_{0.975,2} * 0.1 / sqrt(3) = 0.2484, so
    the interval [-0.0484, 0.4484] holds 0: not significant."""
    evals = pd.read_parquet(reported / "evals.parquet")
    hps = next(c for c in comparisons(evals) if c["score"] == "hps" and c["label"] == "best baseline")
    half = T_975_2 * 0.1 / math.sqrt(3)
    assert half == pytest.approx(0.2484, abs=1e-4)
    assert hps["against"] == "ce" and hps["seeds"] == 3 and hps["per_seed"] == [0.1, 0.2, 0.3]
    assert (hps["mean"], hps["low"], hps["high"]) == pytest.approx((0.2, 0.2 - half, 0.2 + half), abs=1e-9)
    assert not hps["significant"]
    assert paper_table(evals)[-2] == ["DPSM vs best baseline", *["+0.20% [−0.05, +0.45] n.s."] * 3]
    base = next(c for c in comparisons(evals) if c["score"] == "hps" and c["label"] == "the CE base model")
    assert base["against"] == "base" and base["significant"] and base["high"] < 0  # 10.02 against 11: about -8.9%

    report = (reported / "report.md").read_text()
    assert "| CE (best baseline) | HPS | +0.10, +0.20, +0.30 | +0.20% | [−0.05, +0.45] | 3 | not significant |" in report
    assert "n = 3 seeds" in report


def test_a_change_whose_interval_excludes_zero_is_not_marked():
    """Changes of -10%, -9%, -11%: mean -10, sd 1, interval -10 -+ 2.484."""
    rows = [{"method": m, "seed": seed, "score": "hps", "split": 0, "set_size": size}
            for seed, dpsm in enumerate((9.0, 9.1, 8.9)) for m, size in (("ce", 10.0), ("dpsm", dpsm))]
    change = comparisons(pd.DataFrame(rows))[0]
    assert (change["low"], change["high"]) == pytest.approx((-10 - T_975_2 / math.sqrt(3), -10 + T_975_2 / math.sqrt(3)))
    assert change["significant"] and paper_table(pd.DataFrame(rows))[-1] == ["DPSM vs best baseline", "−10.00% [−12.48, −7.52]"]


def test_one_seed_gives_a_change_without_an_interval():
    rows = [{"method": "ce", "seed": 0, "score": "hps", "split": 0, "set_size": 2.5}, {"method": "dpsm", "seed": 0, "score": "hps", "split": 0, "set_size": 2.0}]
    assert paper_table(pd.DataFrame(rows))[-1] == ["DPSM vs best baseline", "-20.00% (1 seed: no interval)"]


def test_the_table_gives_mean_and_std():
    rows = [{"method": m, "seed": i, "score": "hps", "split": 0, "set_size": s} for m, sizes in (("ce", (2.0, 4.0)), ("dpsm", (2.0, 2.0))) for i, s in enumerate(sizes)]
    table = paper_table(pd.DataFrame(rows))
    assert table[:3] == [["method", "HPS"], ["CE", "3.00 ± 1.41"], ["DPSM", "2.00 ± 0.00"]]  # std with ddof 1: sqrt(2)


# --- identical scores ------------------------------------------------------------------------


def test_identical_aps_and_raps_get_one_note_with_the_reason_where_raps_could_differ(reported):
    """20 classes, more than RAPS's k_reg = 5: its penalty could change a set, and did not; the
    note says so once, under the first table, in no caption."""
    evals, classes = pd.read_parquet(reported / "evals.parquet"), pd.read_parquet(reported / "classes.parquet")
    assert identical_scores(evals, classes) == [("aps", "raps")]
    report, tex = (reported / "report.md").read_text(), (reported / "report.tex").read_text()
    note = ("Note: APS and RAPS give identical results on all 24 model x re-split evaluations: RAPS adds λ·max(0, rank(y) − k_reg) (λ = 0.01,"
            " k_reg = 5) to APS's score, so it can differ only where a label ranked below the top 5 enters a calibration score or a set; here"
            " the penalty changed no result (lowest test accuracy 0.970).")
    assert report.count("RAPS adds") == 1 and note in report.split("## DPSM against the baselines")[0]  # 4 methods x 3 seeds x 2 re-splits
    assert tex.count("RAPS adds") == 1 and not any("RAPS adds" in c for c in re.findall(r"\\caption\{[^\n]*", tex))


def test_with_no_more_classes_than_k_reg_raps_is_aps_by_construction_in_one_clause(tmp_path):
    small = {method: tuple(size / 10 for size in sizes) for method, sizes in SIZES.items()}  # 1.0-1.44 classes of 3: HPS's differ from APS's
    write_report(fabricate(tmp_path, classes=3, sizes=small), log=quiet)
    report = (tmp_path / "report.md").read_text()
    assert "Note: RAPS is APS here by construction: its penalty λ·max(0, rank(y) − k_reg) is 0 for every one of the 3 classes (k_reg = 5)." in report
    assert report.count("RAPS is APS") == 1 and "identical results" not in report


def test_scores_that_differ_on_one_evaluation_get_no_note(tmp_path):
    fabricate(tmp_path, raps_differs=True)
    assert identical_scores(pd.read_parquet(tmp_path / "evals.parquet"), pd.read_parquet(tmp_path / "classes.parquet")) == []
    write_report(tmp_path, log=quiet)
    for name in ("report.md", "report.tex"):
        assert "identical results" not in (tmp_path / name).read_text() and "RAPS adds" not in (tmp_path / name).read_text()


# --- a model at chance -----------------------------------------------------------------------


def test_models_at_chance_are_warned_of_at_the_top_of_the_report(tmp_path):
    """CE's accuracy 0.06 on 20 classes is 0.01 above chance (1/20); the others' 0.97 is not."""
    printed = []
    write_report(fabricate(tmp_path, accuracy={"ce": 0.06}), log=printed.append)
    warning = ("models at or near chance on these 20 classes: CE: 3 of 3 final models (test accuracy 0.060, at most 0.05 above chance (1/20 ="
               " 0.050)). Their sets still cover as promised")
    assert printed[0].startswith(f"warning: {warning}")
    assert (tmp_path / "report.md").read_text().split("\n")[2].startswith(f"**Warning:** {warning}")
    assert r"\textbf{Warning:} models at or near chance on these 20 classes: CE: 3 of 3" in (tmp_path / "report.tex").read_text()


def test_sets_of_every_class_are_warned_of_and_an_accurate_model_is_not(tmp_path, reported):
    write_report(fabricate(tmp_path, classes=3), log=quiet)  # set sizes 10-14 capped at K = 3: every set holds every class
    report = (tmp_path / "report.md").read_text()
    assert "CE (base model, as in the paper's table): 3 of 3 final models (every prediction set holds all 3 classes)" in report
    assert "at or near chance" not in (reported / "report.md").read_text()  # 0.97 on 20 classes, sets of 10-14


def test_a_wsc_that_could_not_be_measured_is_n_a_with_its_reason(tmp_path):
    write_report(fabricate(tmp_path, wsc=math.nan), log=quiet)
    report = (tmp_path / "report.md").read_text()
    assert "| CE | HPS | 0.901 ± 0.001 | 10.00 ± 0.00 | 2.00 ± 0.00 | 0.050 ± 0.000 | n/a | 0.970 ± 0.000 | 3 |" in report
    assert "a WSC is n/a when no held-out test point fell in its worst slab (too few test points)" in report and "nan" not in report


# --- report.md and report.tex ------------------------------------------------------------------


def test_the_report_holds_configurations_settings_and_versions(reported):
    report = (reported / "report.md").read_text()
    section = report.split("## Chosen configurations")[1].split("##")[0]
    assert "| parameter | CE | CUT | DPSM |" in section
    assert "| λ (conformal_weight) | — | **0.2** | **3.24** |" in section  # searched: bold; CE does not read lambda
    assert "| q_0 (q_init) | — | — | random |" in section and "| η (lr) | **0.02** | **0.03** | **0.01** |" in section
    assert "DPSM: search trial 1" in section and "the CE base model (3 seeds)" in section
    settings = report.split("## Sweep settings")[1].split("##")[0]
    for text in ("| dataset | digits |", "| scheduler | asha (grace period 1 epochs, reduction factor 3) |", "| search | Optuna TPE, 2 trials per method |",
                 "| alpha | 0.1 |", "slack 0.02", "| search space: DPSM | conformal_weight ∈ [0.1, 4] log; lr ∈ [0.001, 0.1] log; quantile_lr", "| final seeds | 3 (seeds 0–2)"):
        assert text in settings, text
    versions = report.split("## Versions")[1].split("##")[0]
    assert "| torch | 2.0.0 |" in versions and "installed when this report was written" in versions


def test_an_older_sweep_without_versions_says_not_recorded(tmp_path):
    write_report(fabricate(tmp_path, versions=False), log=quiet)
    versions = (tmp_path / "report.md").read_text().split("## Versions")[1].split("##")[0]
    assert "| dpsm_ray | not recorded |" in versions


def test_report_tex_is_a_booktabs_document_in_ascii(reported):
    tex = (reported / "report.tex").read_text()
    assert tex.startswith(r"\documentclass{article}") and r"\usepackage{booktabs}" in tex and tex.rstrip().endswith(r"\end{document}")
    tables = tex.count(r"\begin{tabular}")
    assert tables >= 5 and tex.count(r"\toprule") == tex.count(r"\midrule") == tex.count(r"\bottomrule") == tex.count(r"\end{tabular}") == tables
    assert r"+0.20\% [$-$0.05, +0.45] n.s." in tex and "not significant" in tex
    assert r"3.24" in tex and r"$\lambda$ (conformal\_weight)" in tex
    assert all(ord(c) < 128 for c in tex), sorted({c for c in tex if ord(c) >= 128})  # pdflatex's default fonts
    for name in FIGURES:  # at their natural size: drawn at the size they print
        assert rf"\includegraphics{{figures/{name}.pdf}}" in tex


# --- figures -------------------------------------------------------------------------------


def test_every_figure_is_written_as_png_and_pdf_with_a_section(reported):
    report = (reported / "report.md").read_text()
    for name in FIGURES:
        assert (reported / "figures" / f"{name}.png").read_bytes().startswith(b"\x89PNG"), name
        assert (reported / "figures" / f"{name}.pdf").read_bytes().startswith(b"%PDF"), name
        assert f"](figures/{name}.png)" in report
    assert "No search figures: there is no optuna.db in this directory." in report


def test_class_conditional_rows_get_their_own_table_and_figure_and_leave_the_marginal_tables_as_they_were(tmp_path, reported):
    results = fabricate(tmp_path / "both", class_conditional=True)
    printed = write_report(results, log=quiet)
    report = (results / "report.md").read_text()
    marginal_only = (reported / "report.md").read_text()
    # the paper's tables and the paired changes are of the marginal rows: the same as a report without class-conditional rows
    first_table = report.split("\n\n")[1]
    assert first_table == marginal_only.split("\n\n")[1] and first_table.startswith("| method | HPS | APS | RAPS |")
    assert "## Marginal and class-conditional calibration" in report and "## Marginal and class-conditional" not in marginal_only
    lines = [line for line in report.split("## Marginal and class-conditional calibration")[1].split("\n\n")[1].splitlines()]
    rows = {tuple(cells[:3]): cells[3:] for cells in ([c.strip() for c in line.strip("|").split(" | ")] for line in lines[2:])}
    # by hand, CE's HPS rows: marginal coverage 0.900/0.901/0.902 over seeds (std of six values 0.000817 -> 0.001),
    # lowest class 0.85 with classes 0-9 below 0.9 (0.85 + 0.1 l / 19 < 0.9 for l <= 9); class-conditional: 0.91, classes 0.90 to 0.92
    assert rows[("CE", "HPS", "marginal")] == ["0.901 ± 0.001", "10.00 ± 0.00", "2.00 ± 0.00", "0.850", "10 of 20"]
    assert rows[("CE", "HPS", "class-conditional")] == ["0.910 ± 0.000", "15.00 ± 0.00", "0.50 ± 0.00", "0.900", "0 of 20"]
    assert "Marginal and class-conditional calibration" in printed
    assert (results / "figures" / "class_coverage_classwise.png").is_file() and not (reported / "figures" / "class_coverage_classwise.png").exists()
    assert "of class-conditional sets (a threshold per class" in report
    assert r"\label{tab:calibrations}" in (results / "report.tex").read_text()


def pdf_fonts(path) -> list[str]:
    """The /Subtype of every font dictionary of a PDF matplotlib wrote: it writes its objects one
    by one, uncompressed (no object streams); only the streams in them are compressed."""
    data = path.read_bytes()
    assert b"/ObjStm" not in data, path  # a compressed object stream would hide font dictionaries from this reading
    objects = re.findall(rb"\d+ 0 obj(.*?)endobj", data, re.S)
    return [re.search(rb"/Subtype\s*/(\w+)", o).group(1).decode() for o in objects if re.search(rb"/Type\s*/Font\b", o)]


def pdf_text_sizes(path) -> set[float]:
    """The size in pt of every text a PDF draws: the Tf operators of its (compressed) content streams."""
    sizes = set()
    for stream in re.findall(rb"stream\r?\n(.*?)\r?\nendstream", path.read_bytes(), re.S):
        try:
            content = zlib.decompress(stream)
        except zlib.error:
            continue
        sizes |= {float(size) for size in re.findall(rb"/F\d+ ([\d.]+) Tf", content)}
    return sizes


def test_every_pdf_has_truetype_fonts_prints_text_at_7_to_8_pt_and_fits_a_column_or_a_page(tmp_path):
    """Type 3 fonts (matplotlib's default) are refused by many venues; TrueType comes as /TrueType
    or as /Type0 over a /CIDFontType2.  The figures' style is theirs alone: the process's
    matplotlib settings are as they were."""
    fabricate(tmp_path)
    optuna_db(tmp_path, trials=4)
    before = matplotlib.rcParams.copy()
    write_report(tmp_path, log=quiet)
    assert matplotlib.rcParams == before and matplotlib.rcParams["pdf.fonttype"] == 3
    pdfs = sorted((tmp_path / "figures").glob("*.pdf"))
    assert {p.stem for p in pdfs} == FIGURES | {"search_dpsm", "importance_dpsm"}  # the search's are drawn by a second process
    for pdf in pdfs:
        fonts = pdf_fonts(pdf)
        assert fonts and set(fonts) <= {"TrueType", "Type0", "CIDFontType2"}, (pdf.name, fonts)
        assert pdf_text_sizes(pdf) <= {7.0, 8.0, 4.9}, (pdf.name, pdf_text_sizes(pdf))  # 4.9 = 0.7 x 7: a log axis's exponents
        width = float(re.search(rb"/MediaBox \[ 0 0 ([\d.]+)", pdf.read_bytes()).group(1)) / 72
        one_panel = pdf.stem in ("q_error", "search_dpsm", "importance_dpsm")
        assert width == pytest.approx(COLUMN_WIDTH if one_panel else PAGE_WIDTH), pdf.name


def drawn(results):
    evals, epochs, classes = (pd.read_parquet(results / f"{n}.parquet") for n in ("evals", "epochs", "classes"))
    return list(draw_figures(evals, epochs, classes, Context(0.1, q_init={"dpsm": ["random"]}, conformal_weight={"dpsm": "3.24"})))


def test_each_method_has_one_colour_in_every_figure_and_every_axis_is_labelled(tmp_path):
    import matplotlib.pyplot as plt

    figures = drawn(fabricate(tmp_path))
    assert {f.name for f, _ in figures} == FIGURES
    names = {name_of(m): m for m in ("base", "ce", "cut", "dpsm")}
    seen = {}
    for figure, fig in figures:
        assert fig.legends, figure.name  # a legend in every figure
        for handle, text in zip(fig.legends[0].legend_handles, fig.legends[0].get_texts()):
            if text.get_text() in names:
                colour = handle.get_facecolor() if hasattr(handle, "get_facecolor") and not hasattr(handle, "get_color") else handle.get_color()
                seen.setdefault(names[text.get_text()], set()).add(to_rgba(colour, 1.0))
        for ax in fig.axes:
            for line in ax.lines:  # every curve in its method's colour
                if line.get_label() in names:
                    assert to_rgba(line.get_color()) == to_rgba(method_style(names[line.get_label()]).color), (figure.name, line.get_label())
            assert ax.get_ylabel() or ax.get_shared_y_axes().get_siblings(ax) != [ax], (figure.name, ax.get_title())
        if figure.name.endswith("box"):  # boxes coloured by method, in the order of the tick labels
            ax = fig.axes[0]
            labels = [t.get_text() for t in ax.get_xticklabels()]
            faces = [to_rgba(p.get_facecolor(), 1.0) for p in ax.patches]
            assert faces == [to_rgba(method_style(names[label]).color, 1.0) for label in labels]
        plt.close(fig)
    assert all(len(colours) == 1 for colours in seen.values()), seen
    assert {m: next(iter(c)) for m, c in seen.items()} == {m: to_rgba(STYLES[m].color) for m in seen}


def test_panels_share_their_y_axis_and_a_flattened_panel_gets_a_log_scale(tmp_path):
    import matplotlib.pyplot as plt

    figures = dict((f.name, (f, fig)) for f, fig in drawn(fabricate(tmp_path)))
    coverage = figures["coverage_box"][1]
    assert all(coverage.axes[0].get_shared_y_axes().joined(coverage.axes[0], ax) for ax in coverage.axes[1:3])
    losses = figures["losses"][1]
    assert losses.axes[0].get_yscale() == "log"  # DPSM's 3.0 against the others' 0.05 / epoch
    assert "(left panel on a log scale: its series differ by more than 10x)" in figures["losses"][0].caption
    assert figures["q_error"][1].axes[0].get_yscale() == "linear"
    for _, fig in figures.values():
        plt.close(fig)


def test_y_scale_rule():
    assert y_scale([[1.0, 2.0], [5.0, 9.0]]) == "linear"
    assert y_scale([[0.05, 0.04], [3.0, 3.2]]) == "log"
    assert y_scale([[0.0, 0.05], [3.0, 3.2]]) == "symlog"
    assert y_scale([[float("nan")], [3.0]]) == "linear"


def test_captions_say_what_ran(tmp_path):
    import matplotlib.pyplot as plt

    figures = drawn(fabricate(tmp_path))
    captions = {f.name: f.caption for f, _ in figures}
    assert "DPSM's q_0: random (Unif(0, 1) from the run seed)" in captions["q_error"]
    assert "DPSM's upper gap grew from 0.01 (epoch 1) to 0.03 (epoch 3)" in captions["loss_gaps"]  # as fabricated: growing gaps
    assert "each box: 3 models x 2 calibration/test re-splits = 6 values" in captions["coverage_box"]
    assert "λ of the chosen configurations: DPSM 3.24" in captions["losses"]
    for _, fig in figures:
        plt.close(fig)


def test_an_unknown_method_gets_a_stable_style_unlike_the_fixed_ones():
    style = method_style("my_objective")
    assert style == method_style("my_objective") and style.color not in {s.color for s in STYLES.values()}
    assert [STYLES[m].color for m in ("base", "ce", "cut", "conftr", "conftr_published", "dpsm")] == [
        "tab:gray", "tab:blue", "tab:green", "tab:orange", "tab:brown", "tab:red"]


# --- search figures ---------------------------------------------------------------------------


def optuna_db(results, trials: int, params: tuple[str, ...] = ("lr", "conformal_weight")):
    """hand-dpsm's study: trial 1 infeasible (coverage 0.80 below the floor 0.88)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(study_name="hand-dpsm", storage=f"sqlite:///{results / 'optuna.db'}", direction="minimize")
    for number in range(trials):
        trial = study.ask()
        for name in params:
            trial.suggest_float(name, 0.001, 1.0, log=True)
        coverage = 0.80 if number == 1 else 0.90
        trial.set_constraint("coverage", 0.88 - coverage)
        study.tell(trial, 1.0 + 0.1 * number)


def test_a_searchs_history_and_importance_are_drawn_from_a_copy_of_optuna_db(tmp_path):
    fabricate(tmp_path)
    optuna_db(tmp_path, trials=4)
    before = hashlib.sha256((tmp_path / "optuna.db").read_bytes()).hexdigest()
    write_report(tmp_path, log=quiet)
    assert hashlib.sha256((tmp_path / "optuna.db").read_bytes()).hexdigest() == before  # never written
    for name in ("search_dpsm", "importance_dpsm"):
        assert (tmp_path / "figures" / f"{name}.png").exists() and (tmp_path / "figures" / f"{name}.pdf").exists()
    report = (tmp_path / "report.md").read_text()
    assert "1 of 4 infeasible (validation coverage below 0.88" in report
    assert not (tmp_path / "figures" / "search_ce.png").exists()  # no study of CE in this optuna.db


def test_the_search_figures_a_second_process_draws_are_the_ones_this_process_draws(tmp_path, monkeypatch):
    """Issue 26: with two cores the search figures are drawn in a second process while this one
    draws the rest; with one, here.  Both write the same figures and the same report."""
    import os
    import shutil
    import subprocess

    started = []

    class RecordedPopen(subprocess.Popen):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            started.append(self)

    monkeypatch.setattr(subprocess, "Popen", RecordedPopen)
    fabricate(tmp_path / "one")
    optuna_db(tmp_path / "one", trials=4)
    shutil.copytree(tmp_path / "one", tmp_path / "two")
    written = {}
    for results, cores in ((tmp_path / "one", {0}), (tmp_path / "two", {0, 1})):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, cores=cores: cores, raising=False)
        write_report(results, log=quiet)
        written[results.name] = {name: (results / "figures" / f"{name}.png").read_bytes() for name in ("search_dpsm", "importance_dpsm")}
        written[results.name]["report.md"] = (results / "report.md").read_text().split("\n", 1)[1].encode()  # below "# Results: <name>"
    assert len(started) == 1 and started[0].returncode == 0  # a second process, for two cores only, and it drew them
    assert written["one"] == written["two"]


def test_the_history_crosses_the_infeasible_trial_in_black(tmp_path):
    import matplotlib.pyplot as plt

    from dpsm_ray.results.figures import draw_search

    fabricate(tmp_path)
    optuna_db(tmp_path, trials=4)
    sweep = json.loads((tmp_path / "sweep.json").read_text())
    figures = {figure.name: fig for figure, fig in draw_search(tmp_path, sweep)}
    ax = figures["search_dpsm"].axes[0]
    shown = [(c, [tuple(p) for p in c.get_offsets()]) for c in ax.collections if c.get_visible()]
    crossed = [points for c, points in shown if to_rgba(c.get_facecolor()[0]) == to_rgba("black")]
    coloured = [points for c, points in shown if to_rgba(c.get_facecolor()[0]) == to_rgba(STYLES["dpsm"].color)]
    # numbered from 1 as the console numbers them: Optuna's trial 1 (coverage 0.80 < 0.88) is trial 2
    assert crossed == [[(2.0, 1.1)]] and coloured == [[(1.0, 1.0), (3.0, 1.2), (4.0, 1.3)]]
    assert ax.get_xlabel() == "trial" and list(ax.lines[0].get_xdata()) == [1.0, 2.0, 3.0, 4.0]
    assert "infeasible (val coverage < 0.88)" in [t.get_text() for t in ax.get_legend().get_texts()]
    for fig in figures.values():
        plt.close(fig)


def test_too_few_trials_give_a_history_without_importance(tmp_path):
    fabricate(tmp_path)
    optuna_db(tmp_path, trials=2)
    write_report(tmp_path, log=quiet)
    assert (tmp_path / "figures" / "search_dpsm.png").exists() and not (tmp_path / "figures" / "importance_dpsm.png").exists()


def test_a_grid_sweep_has_no_search_figures_and_says_so(tmp_path):
    write_report(fabricate(tmp_path, grid=True), log=quiet)
    report = (tmp_path / "report.md").read_text()
    assert "No search figures: a grid sweep" in report and not list((tmp_path / "figures").glob("search_*"))
    assert "| search | the paper's grid, every configuration |" in report
    assert "| search space: DPSM | batch_size {64}; epochs {30}; lr {0.001, 0.005, 0.01, 0.05, 0.1}" in report


# --- older files and single runs --------------------------------------------------------------


def test_a_report_of_older_files_leaves_out_the_figures_they_lack_columns_for(tmp_path):
    fabricate(tmp_path)
    for name in ("classes.parquet", "manifest.json", "trials.parquet", "sweep.json"):
        (tmp_path / name).unlink()
    old = pd.read_parquet(tmp_path / "epochs.parquet").drop(columns=["q_error_train", "upper_gap", "lower_gap", "train_set_size_q"])
    old.to_parquet(tmp_path / "epochs.parquet")
    write_report(tmp_path, log=quiet)
    report = (tmp_path / "report.md").read_text()
    assert {p.stem for p in (tmp_path / "figures").glob("*.png")} == {"coverage_box", "apss_box", "losses", "q_error"}
    assert "DPSM's q_0: not recorded in these files." in report and "No search figures: not a sweep's directory" in report
    assert "| dpsm_ray | not recorded |" in report


def test_a_single_runs_report_has_the_figures(tmp_path):
    import torch

    from dpsm_ray.storage import write_run
    from dpsm_ray.train import LocalEnv, TrainConfig, train

    config = TrainConfig(dataset="digits", method="dpsm", epochs=2, eval_splits=2, val_splits=2)
    write_run(tmp_path, train(config, LocalEnv(torch.device("cpu"), log=quiet)))
    write_report(tmp_path, log=quiet)
    assert FIGURES <= {p.stem for p in (tmp_path / "figures").glob("*.pdf")}
    assert "DPSM's q_0: dataset (Q_n of the starting model's D1 scores)" in (tmp_path / "report.md").read_text()  # from config.json


def test_the_searches_table_counts_each_method_s_trials_by_outcome_and_names_its_pick(tmp_path):
    """--trials-per-knob's report: each method's knobs and trials, feasible / infeasible / stopped / failed, the pick."""
    results = fabricate(tmp_path / "r")
    trials = pd.read_parquet(results / "trials.parquet")
    search = trials.stage == "search"
    trials.loc[search & (trials.method == "dpsm") & (trials.trial_index == 1), "feasible"] = False
    failed = trials[search & (trials.method == "cut") & (trials.trial_index == 1)].assign(
        trial_index=2, trial_id="s-cut-2", status="failed", error="diverged", feasible=None, val_coverage=None, val_set_size=None)
    stopped = failed.assign(trial_index=3, trial_id="s-cut-3", status="stopped", error=None)
    from dpsm_ray.storage.schema import TRIALS
    from dpsm_ray.storage.writers import write_parquet

    rows = pd.concat([trials, failed, stopped], ignore_index=True).astype(object).where(lambda f: f.notna(), None).to_dict("records")
    write_parquet(results / "trials.parquet", rows, TRIALS)
    sweep = json.loads((results / "sweep.json").read_text())
    (results / "sweep.json").write_text(json.dumps({**sweep, "trials_per_knob": 2}))
    write_report(results, log=quiet)
    report = (results / "report.md").read_text()
    section = report.split("## Searches")[1].split("##")[0]
    assert "| method | knobs | trials | feasible | infeasible | stopped early | failed | pick | lr tried |" in section
    lrs = ", ".join(f"{lr:.3g}" for lr in sorted(trials[search & (trials.method == "ce")].lr))
    assert f"| CE | 1 (lr) | 2 | 2 | 0 | 0 | 0 | trial 1 (validation set size 1.000) | {lrs} |" in section
    assert "| CUT | 2 (conformal_weight, lr) | 4 | 2 | 0 | 1 | 1 | trial 1 (validation set size 1.000) |" in section
    assert "| DPSM | 4 (conformal_weight, lr, quantile_lr, sigmoid_temperature) | 2 | 1 | 1 | 0 | 0 | trial 1" in section
    assert "| search | Optuna TPE, 2 trials per knob of each method (CE 2, CUT 4, DPSM 8) |" in report
    assert r"\label{tab:searches}" in (results / "report.tex").read_text()
    (results / "sweep.json").write_text(json.dumps({**sweep, "trials_per_knob": 2, "min_trials": 6, "sampler": "sobol"}))  # the floor
    write_report(results, log=quiet)
    assert "| search | Sobol-sequence, 2 trials per knob of each method, at least 6 each (CE 6, CUT 6, DPSM 8) |" in (
        results / "report.md").read_text()


def test_quantile_curves_follow_the_rows_not_a_list_of_method_names():
    """VR-ConfTr estimates a batch quantile as ConfTr does: its rows hold the quantile diagnostics,
    so its curves are drawn and labelled batch τ; DPSM's objective keeps q as state (learned q)."""
    from dpsm_ray.results.figures import epoch_curves, learns_quantile, q_error_figure

    rows = []
    for method, error in (("ce", math.nan), ("vr_conftr", 0.05), ("dpsm", 0.02)):
        for epoch in (1, 2):
            rows.append({"method": method, "run_id": f"{method}-0", "epoch": epoch, "upper_loss": 1.0, "q_error": error / epoch,
                         "q_error_train": error / epoch})
    curves = epoch_curves(pd.DataFrame(rows))
    assert curves.quantile_methods == ["dpsm", "vr_conftr"] or curves.quantile_methods == ["vr_conftr", "dpsm"]
    assert "ce" not in curves.quantile_methods
    assert learns_quantile("dpsm") and not learns_quantile("vr_conftr") and not learns_quantile("conftr")
    figure, _ = q_error_figure(curves, Context(0.1, q_init={"dpsm": ["random"]}))
    assert "VR-ConfTr (batch τ)" in figure.caption and "DPSM (learned q)" in figure.caption and "DPSM's q_0: random" in figure.caption


def test_the_details_table_shows_the_later_metrics_only_where_a_sweep_wrote_them():
    from dpsm_ray.results.report import details_table

    rows = [{"method": "dpsm", "score": "hps", "run_id": "r", "coverage": 0.9, "set_size": 1.5, "covgap": 2.0, "sscv": 0.1, "wsc": 0.8,
             "accuracy": 0.7, "empty_rate": e, "singleton_rate": 0.5, "classes_under": c, "ece": 0.04} for e, c in ((0.1, 3), (0.2, 5))]
    new = details_table(pd.DataFrame(rows))
    assert new[0][-5:] == ["empty sets", "singletons", "classes below 1 − α", "ECE", "models"]
    assert new[1][-5:] == ["0.150 ± 0.071", "0.500 ± 0.000", "4.0 ± 1.4", "0.040 ± 0.000", "1"]
    older = details_table(pd.DataFrame(rows).drop(columns=["empty_rate", "singleton_rate", "classes_under", "ece"]))
    assert older[0] == ["method", "score", "coverage", "set size", "CovGap %", "SSCV", "WSC", "accuracy", "models"]


def test_the_calibrations_heading_names_those_the_rows_hold():
    from dpsm_ray.results.report import calibrations_heading

    frame = pd.DataFrame({"calibration": ["marginal", "class", "cluster", "rc3p"]})
    assert calibrations_heading(frame) == "Marginal, class-conditional, clustered and RC3P calibration"
    assert calibrations_heading(frame.iloc[:2]) == "Marginal and class-conditional calibration"
    assert calibrations_heading(frame.iloc[[0, 3]]) == "Marginal and RC3P calibration"
