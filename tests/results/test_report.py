"""The paper-style table from hand-made evaluation rows (no Ray)."""

import pandas as pd

from dpsm_ray.results.report import paper_table


def rows(method, score, sizes):
    return [{"method": method, "score": score, "set_size": size} for size in sizes]


def test_the_table_gives_mean_std_and_dpsms_change_against_the_best_baseline():
    evals = pd.DataFrame(rows("ce", "hps", [2.0, 4.0]) + rows("cut", "hps", [2.5, 2.5]) + rows("dpsm", "hps", [2.0, 2.0]))
    table = paper_table(evals)
    assert table[0] == ["method", "HPS"]
    assert table[1] == ["CE", "3.00 ± 1.41"]  # std with ddof 1: sqrt(2)
    assert table[3] == ["DPSM", "2.00 ± 0.00"]
    assert table[-1] == ["DPSM vs best baseline", "↓ 20.00%"]  # (2.0 - 2.5) / 2.5, CUT being the best baseline


def test_a_score_that_a_baseline_lacks_or_empty_sets_give_no_percentage():
    evals = pd.DataFrame(rows("ce", "hps", [1.0]) + rows("dpsm", "hps", [0.8]) + rows("dpsm", "aps", [1.0]) + rows("ce", "raps", [0.0]) + rows("dpsm", "raps", [0.0]))
    change = paper_table(evals)[-1]
    assert change == ["DPSM vs best baseline", "↓ 20.00%", "n/a", "n/a"]


# --- figures and report sections -------------------------------------------------------------

NEW_FIGURES = {"loss_gaps", "q_error", "set_size_gap", "class_coverage"}


def sweep_rows(tmp_path):
    """A sweep's three files by hand: DPSM and ConfTr, two final models each, plus a search row
    that the figures must leave out."""
    from dpsm_ray.results.schema import CLASSES, EPOCHS, EVALS
    from dpsm_ray.results.store import write_parquet

    epochs, evals, classes = [], [], []
    for method in ("dpsm", "conftr"):
        for seed, stage in ((0, "final"), (1, "final"), (2, "search")):
            key = {"sweep": "hand", "stage": stage, "trial_id": f"{method}{seed}", "run_id": f"{method}{seed}", "dataset": "digits", "model": "mlp", "method": method, "seed": seed}
            for epoch in (1, 2, 3):
                error = 0.5 / epoch if method == "dpsm" else 0.05
                epochs.append({**key, "epoch": epoch, "lr": 0.05, "upper_loss": 1.0 / epoch, "lower_loss": 0.1, "q": 0.2, "q_dataset": 0.2, "q_error": error,
                               "q_dataset_train": 0.2, "q_error_train": error, "upper_gap": error, "lower_gap": error / 10, "train_set_size_q": 1.0 + error, "val_set_size": 1.2})
            for split in (0, 1):
                evals.append({**key, "score": "hps", "split": split, "alpha": 0.1, "coverage": 0.9, "set_size": 1.1, "covgap": 3.0, "sscv": 0.05, "wsc": 0.85, "accuracy": 0.95})
                for label in range(3):
                    classes.append({**key, "score": "hps", "split": split, "label": label, "n_test": 10, "coverage": 0.8 + 0.05 * label, "set_size": 1.0 + label})
    write_parquet(tmp_path / "epochs.parquet", epochs, EPOCHS)
    write_parquet(tmp_path / "evals.parquet", evals, EVALS)
    write_parquet(tmp_path / "classes.parquet", classes, CLASSES)


def figure_sections(report: str) -> dict[str, str]:
    """figure file name -> the one line of its report section."""
    sections = {}
    for block in report.split("\n## ")[1:]:
        lines = [line for line in block.splitlines() if line]
        image = [line for line in lines if line.startswith("![")]
        if image:
            sections[image[0].split("figures/")[1].removesuffix(".png)")] = lines[1]
    return sections


def test_a_sweeps_report_has_every_figure_and_a_section_each(tmp_path):
    from dpsm_ray.results.report import write_report

    sweep_rows(tmp_path)
    write_report(tmp_path, log=lambda text: None)
    sections = figure_sections((tmp_path / "report.md").read_text())
    assert NEW_FIGURES | {"coverage_box", "apss_box", "losses"} == set(sections)
    for name, line in sections.items():
        assert (tmp_path / "figures" / f"{name}.png").stat().st_size > 1000
        assert "paper figure" in line and not line.startswith("!["), (name, line)  # the line on what to see


def test_a_report_of_older_files_leaves_out_the_figures_they_lack_columns_for(tmp_path):
    from dpsm_ray.results.report import write_report

    sweep_rows(tmp_path)
    (tmp_path / "classes.parquet").unlink()
    (tmp_path / "manifest.json").unlink()  # older versions recorded no checksums
    old = pd.read_parquet(tmp_path / "epochs.parquet").drop(columns=["q_error_train", "upper_gap", "lower_gap", "train_set_size_q"])
    old.to_parquet(tmp_path / "epochs.parquet")
    write_report(tmp_path, log=lambda text: None)
    sections = figure_sections((tmp_path / "report.md").read_text())
    assert set(sections) == {"coverage_box", "apss_box", "losses", "q_error"}


def test_a_single_runs_report_has_the_new_figures(tmp_path):
    import torch

    from dpsm_ray.results import write_run
    from dpsm_ray.results.report import write_report
    from dpsm_ray.train import LocalEnv, TrainConfig, train

    config = TrainConfig(dataset="digits", method="dpsm", epochs=2, eval_splits=2, val_splits=2)
    write_run(tmp_path, train(config, LocalEnv(torch.device("cpu"), log=lambda line: None)))
    classes = pd.read_parquet(tmp_path / "classes.parquet")
    assert len(classes) == 3 * 2 * 10 and classes.run_id.nunique() == 1
    write_report(tmp_path, log=lambda text: None)
    assert NEW_FIGURES <= set(figure_sections((tmp_path / "report.md").read_text()))


def test_the_base_model_row_and_dpsm_against_it():
    """The paper's CE column is the base model, not fine-tuned: its row comes first, the best
    baseline leaves it out (it was not trained by the same protocol), and DPSM is also compared
    with it, the paper's comparison."""
    evals = pd.DataFrame(rows("base", "hps", [3.0, 3.0]) + rows("ce", "hps", [2.0, 2.0]) + rows("cut", "hps", [2.5, 2.5]) + rows("dpsm", "hps", [2.2, 2.2]))
    table = paper_table(evals)
    assert [row[0] for row in table[1:5]] == ["CE (base model, as in the paper's table)", "CE", "CUT", "DPSM"]
    assert table[-2] == ["DPSM vs best baseline", "↑ 10.00%"]  # against CE fine-tuned, 2.0
    assert table[-1] == ["DPSM vs the CE base model", "↓ 26.67%"]  # (2.2 - 3.0) / 3.0
