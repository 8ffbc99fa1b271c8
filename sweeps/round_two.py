"""Round two of the decisive test (docs/fidelity.md, "Round two": its criterion, written before any
of its runs): the regime behind the paper's headline -- small data on pretrained features,
``fonts_transfer`` -- and the sharp size proxy on it and on ``fonts``.

    dpsm-ray train --dataset fonts:noise=20,eval=5 --method ce --model lenet --epochs 20 --milestones 10 15 \\
        --batch-size 64 --lr 0.05 --seed 0 --data-workers 0 --out runs/fonts-backbone     # the backbone, once
    python sweeps/round_two.py --dataset fonts_transfer                                    # base, CE, the sharp arms, 10 seeds
    dpsm-ray sweep --config sweeps/round_two-fonts_transfer-search.yaml --results-dir results/round_two-fonts_transfer-search
    python sweeps/round_two.py --dataset fonts_transfer --searched-from results/round_two-fonts_transfer-search --resume
    python sweeps/round_two.py --dataset fonts                                             # the sharp arms on fonts
    python sweeps/round_two.py --dataset fonts_transfer --report-from docs/results/round_two-fonts_transfer
    python sweeps/round_two.py --dataset fashion_mnist --report-from docs/results/league-fashion_mnist  # the league's searches
    python sweeps/round_two.py --dataset fonts --report-from docs/results/round_two-fonts docs/results/league-fonts  # both, as one

The backbone is read from ``runs/fonts-backbone/model.pt`` (``DPSM_RAY_BACKBONE`` names another
file).  The arms (``sharp_arms``): the CE base model and CE fine-tuned; DPSM (CE on the whole batch)
and ConfTr at T 0.01 and 0.03, each at lambda 0.5 and 0.1, and CUT at lambda 0.5 and 0.1, every one
at the one fine-tuning lr the criterion's ConfTr pilot fixed in each regime (``SHARP_LR``), in the order they run:
the arms the criterion's budget rule cuts first run last.  On fonts and Fashion-MNIST every search is the
league's (docs/league.md), read under round two's criterion: ``--report-from`` a league's compact folder
takes each method's re-trained pick as the arm ``searched_<method>``; on fonts, beside the study's own
compact results (the base model both hold is read once, and only if its rows are the same in both).
"""

import os
import sys

from dpsm_ray.results.studies import Arm
from dpsm_ray.sweep.study import cli
from dpsm_ray.train.presets import DPSM_CODE_SHARED

# The fine-tuning lr of each regime's sharp arms, fixed by the criterion's pilot before any of them ran
# (bench/results/round_two-pilot-2026-11-27/): ConfTr at T 0.01, lambda 0.5, seed 0, at 0.01 (the schedule's
# lr scaled by 0.1), or 0.001 if it did not train there. fonts_transfer: it trained at 0.01 (test accuracy 0.277);
# fonts: at 0.01 it was at chance (accuracy 0.007 = 1/141, sets of 127.4 classes: (1 - alpha) x 141, all a
# calibrated model at chance gives -- the rule's "all classes", docs/fidelity.md), so 0.001.
SHARP_LR = {"fonts_transfer": 0.01, "fonts": 0.001}
BACKBONE = os.environ.get("DPSM_RAY_BACKBONE", "runs/fonts-backbone/model.pt")


def sharp_arms(lr: float) -> tuple[Arm, ...]:
    """Round two's fixed arms (docs/fidelity.md): the references, then the sharp proxy -- DPSM and
    ConfTr at T in {0.01, 0.03} and CUT, at lambda 0.5 and then 0.1 -- all at ``lr``.  Cut first
    by the budget rule, so run last: the lambda 0.1 arms; before them, the T 0.03 arms."""
    def at(temperature: float, weight: float) -> list[Arm]:
        tag = f"t{temperature:g}".replace(".", "")[:4] + f"_l{weight:g}".replace(".", "")
        return [
            Arm(f"dpsm_{tag}", f"DPSM, CE on the whole batch, T {temperature:g}, lambda {weight:g}, lr {lr:g}",
                {"method": "dpsm", "ce_batch": "full", "sigmoid_temperature": temperature, "conformal_weight": weight, "lr": lr}),
            Arm(f"conftr_{tag}", f"ConfTr, T {temperature:g}, lambda {weight:g}, lr {lr:g}",
                {"method": "conftr", "sigmoid_temperature": temperature, "conformal_weight": weight, "lr": lr}),
        ]

    def cut(weight: float) -> Arm:
        return Arm(f"cut_l{weight:g}".replace(".", ""), f"CUT, lambda {weight:g}, lr {lr:g}",
                   {"method": "cut", "conformal_weight": weight, "lr": lr})

    return (
        Arm("base", "CE base model, not fine-tuned (the paper's CE column)", {"method": "base", "epochs": 0}),
        Arm("ce", "CE fine-tuned", {"method": "ce"}),
        *at(0.01, 0.5), cut(0.5), *at(0.03, 0.5),
        cut(0.1), *at(0.01, 0.1), *at(0.03, 0.1),
    )


CLAIM = ("searched_dpsm", "searched_ce", "searched_conftr", "searched_cut")  # searched DPSM against the best of the others
ANALYSIS = {
    "claim": CLAIM,
    "comparisons": (
        ("dpsm_t001_l05", "conftr_t001_l05"), ("dpsm_t001_l05", "cut_l05"), ("dpsm_t003_l05", "conftr_t003_l05"),
        ("dpsm_t003_l05", "cut_l05"), ("dpsm_t001_l01", "conftr_t001_l01"), ("dpsm_t001_l01", "cut_l01"),
        ("dpsm_t003_l01", "conftr_t003_l01"), ("dpsm_t003_l01", "cut_l01"),
        ("dpsm_t001_l05", "ce"), ("dpsm_t003_l05", "ce"), ("dpsm_t001_l01", "ce"), ("dpsm_t003_l01", "ce"),
        # the criterion reports whether the sharp DPSM arms beat searched CE, with no criterion set
        ("dpsm_t001_l05", "searched_ce"), ("dpsm_t003_l05", "searched_ce"), ("dpsm_t001_l01", "searched_ce"), ("dpsm_t003_l01", "searched_ce"),
        ("searched_dpsm", "searched_ce"), ("searched_dpsm", "searched_conftr"), ("searched_dpsm", "searched_cut"),
    ),
    "mechanism": (
        ("dpsm_t001_l05", "conftr_t001_l05", "cut_l05"), ("dpsm_t003_l05", "conftr_t003_l05", "cut_l05"),
        ("dpsm_t001_l01", "conftr_t001_l01", "cut_l01"), ("dpsm_t003_l01", "conftr_t003_l01", "cut_l01"),
    ),
}
# one thread a trial, no data workers, diagnostics over the whole training split (the repeatability settings)
EVALUATION = {"val_splits": 5, "eval_splits": 10, "diagnostic_examples": 0, "workers": 0, "cpus_per_worker": 1, "data_workers": 0, "seed": 0}
QUICK = {"seeds": 2, "epochs": 2, "milestones": (1,)}
DATASETS = {
    "fonts_transfer": {
        # 100 classes, 40 images a class of the held-out typefaces, on the backbone; each seed's base model a new seeded head
        # trained 30 epochs (lr 0.01, divided by 10 at 15 and 25, batch 64); the official fine-tuning schedule, 40 epochs
        "common": {"dataset": "fonts_transfer", "pretrained_path": BACKBONE, "model": "lenet", "alpha": 0.1, "base_epochs": 30,
                   "base_milestones": (15, 25), "base_lr": 0.01, "base_batch_size": 64, **DPSM_CODE_SHARED, **EVALUATION},
        "quick": {"common": {"dataset": "fonts_transfer:classes=10,backbone_classes=141", "base_epochs": 2, "base_milestones": (1,),
                             "eval_splits": 3, "val_splits": 2}, **QUICK},
    },
    "fonts": {
        # the decisive test's fonts recipe (sweeps/decisive.py), unchanged
        "common": {"dataset": "fonts:train=1", "alpha": 0.1, "base_epochs": 20, "base_milestones": (10, 15), **DPSM_CODE_SHARED, "epochs": 10,
                   "milestones": (6,), **EVALUATION},
        "quick": {"common": {"dataset": "fonts:classes=20,train=1", "base_epochs": 2, "base_milestones": (1,), "eval_splits": 3, "val_splits": 2},
                  **QUICK},
    },
}
for name, definition in DATASETS.items():
    definition.update(arms=sharp_arms(SHARP_LR[name]), seeds=10, concurrency=2, prefix="round_two", **ANALYSIS)
# Fashion-MNIST: the fair searches only, which are the league's (docs/league.md); read, never run here
DATASETS["fashion_mnist"] = {
    "common": {"dataset": "fashion_mnist", "alpha": 0.01, **DPSM_CODE_SHARED, **EVALUATION},  # the decisive test's recipe
    "quick": {"common": {}, **QUICK},
    "arms": (), "seeds": 10, "prefix": "round_two", "claim": CLAIM,
    "comparisons": (("searched_dpsm", "searched_ce"), ("searched_dpsm", "searched_conftr"), ("searched_dpsm", "searched_cut")),
    "report_only": "round two reads its searches from the league's results: python sweeps/league.py --dataset fashion_mnist, then "
                   "python sweeps/round_two.py --dataset fashion_mnist --report-from results/league-fashion_mnist/compact",
}

if __name__ == "__main__":
    sys.exit(cli("sweeps/round_two.py", __doc__.splitlines()[0], DATASETS))
