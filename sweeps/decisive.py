"""Does DPSM's learned quantile make smaller sets than ConfTr and CUT?  The decisive test, offline:
Fashion-MNIST (real, 10 classes) and fonts (real typefaces, 141 classes); its criterion is in
docs/fidelity.md, written before any of its results.

    python sweeps/decisive.py --dataset fashion_mnist                    # the fixed arms, 10 seeds
    dpsm-ray sweep ... (docs/fidelity.md gives the command)              # each method's Optuna search
    python sweeps/decisive.py --dataset fashion_mnist --searched-from SWEEP_DIR --resume
                                                                         # + the searched arms, re-trained with the 10 seeds
    python sweeps/decisive.py --dataset fashion_mnist --report-from docs/results/decisive-fashion_mnist
                                                                         # the tables again, from the committed results
    python sweeps/decisive.py ... --quick --arms base,ce,dpsm_l05       # a smoke run

The arms (``decisive_arms`` below): the CE base model and CE fine-tuned; DPSM
with its size term on (CE on the whole batch, T 0.1) against ConfTr and CUT at lambda 0.5 and 0.1;
from DPSM at lambda 0.5 each of the tex's three changes alone; DPSM and ConfTr at batch 32 and 512
beside the batch-128 arms.  Every fine-tuning arm starts, for seed s, from seed s's CE base model,
fine-tuned as the official DPSM code fine-tunes (40 epochs, batch 128, lr restarted at 0.1 and
divided by 10 at epoch 25; on fonts the same schedule in 10 epochs, the lr divided at epoch 6).  The study writes ``fidelity.md`` (the tables and the criterion's
verdicts) and ``compact/`` (every model's evaluation and quantile diagnostics, small enough to
commit: ``--report-from`` regenerates the tables from it).
"""

import sys

from dpsm_ray.results.studies import Arm
from dpsm_ray.sweep.study import cli
from dpsm_ray.train.presets import DPSM_CODE_SHARED


def decisive_arms() -> tuple[Arm, ...]:
    """The decisive test's fixed arms (docs/fidelity.md, written before its results): the base
    model and CE fine-tuned; DPSM with its size term on (CE on the whole batch, T 0.1) against
    ConfTr and CUT (CUT has no T) at lambda 0.5 and 0.1; from DPSM at lambda 0.5 each of the tex's
    three changes alone (CE on B1 only; T 1; lambda 0.05); DPSM and ConfTr at lambda 0.5 with batch
    32 and 512 (the lambda 0.5 arms are batch 128, the study's schedule).  In the order they run:
    the lambda 0.1 arms last, as the criterion's budget rule cuts them first."""
    on = {"method": "dpsm", "ce_batch": "full", "sigmoid_temperature": 0.1}
    conftr = {"method": "conftr", "sigmoid_temperature": 0.1}
    def mechanism(weight: float, tag: str) -> list[Arm]:
        return [
            Arm(f"dpsm_{tag}", f"DPSM, size term on: CE on the whole batch, T 0.1, lambda {weight:g}", {**on, "conformal_weight": weight}),
            Arm(f"conftr_{tag}", f"ConfTr, T 0.1, lambda {weight:g}", {**conftr, "conformal_weight": weight}),
            Arm(f"cut_{tag}", f"CUT, lambda {weight:g}", {"method": "cut", "conformal_weight": weight}),
        ]

    arms = [
        Arm("base", "CE base model, not fine-tuned (the paper's CE column)", {"method": "base", "epochs": 0}),
        Arm("ce", "CE fine-tuned", {"method": "ce"}),
    ]
    arms += mechanism(0.5, "l05")
    arms += [
        Arm(
            "dpsm_l05_ceb1",
            "DPSM lambda 0.5 T 0.1, CE on B1 only (the tex's change alone)",
            {**on, "conformal_weight": 0.5, "ce_batch": "half"},
        ),
        Arm("dpsm_l05_t1", "DPSM lambda 0.5, T 1 (the tex's change alone)", {**on, "conformal_weight": 0.5, "sigmoid_temperature": 1.0}),
        Arm("dpsm_l005", "DPSM T 0.1, lambda 0.05 (the tex's change alone)", {**on, "conformal_weight": 0.05}),
    ]
    for batch in (32, 512):
        arms += [
            Arm(f"dpsm_l05_b{batch}", f"DPSM lambda 0.5 T 0.1, batch {batch}", {**on, "conformal_weight": 0.5, "batch_size": batch}),
            Arm(
                f"conftr_l05_b{batch}", f"ConfTr lambda 0.5 T 0.1, batch {batch}", {**conftr, "conformal_weight": 0.5, "batch_size": batch}
            ),
        ]
    # last: the criterion's budget rule cuts them first (docs/fidelity.md)
    return tuple(arms + mechanism(0.1, "l01"))


# the decisive test's analysis: its comparisons, the batch-size prediction's pairs, the mechanism's triples
DECISIVE_ANALYSIS = {
    "comparisons": (("dpsm_l05", "conftr_l05"), ("dpsm_l05", "cut_l05"), ("dpsm_l01", "conftr_l01"), ("dpsm_l01", "cut_l01"),
                    ("dpsm_l05_ceb1", "dpsm_l05"), ("dpsm_l05_t1", "dpsm_l05"), ("dpsm_l005", "dpsm_l05"),
                    ("searched_dpsm", "searched_ce"), ("searched_dpsm", "searched_conftr"), ("searched_dpsm", "searched_cut")),
    # the claim: searched DPSM against the best of searched CE, ConfTr and CUT
    "claim": ("searched_dpsm", "searched_ce", "searched_conftr", "searched_cut"),
    "batch_pairs": ((32, "dpsm_l05_b32", "conftr_l05_b32"), (128, "dpsm_l05", "conftr_l05"), (512, "dpsm_l05_b512", "conftr_l05_b512")),
    "mechanism": (("dpsm_l05", "conftr_l05", "cut_l05"), ("dpsm_l01", "conftr_l01", "cut_l01")),
}



# diagnostics over the whole training split: the batch-size prediction reads |q - Q_n|
EVALUATION = {"val_splits": 5, "eval_splits": 10, "diagnostic_examples": 0, "workers": 0, "cpus_per_worker": 1, "data_workers": 0, "seed": 0}
QUICK = {"seeds": 2, "epochs": 2, "milestones": (1,)}
DATASETS = {
    "fashion_mnist": {
        # ConfTr's protocol at its alpha: their MLP and CE baseline recipe (the model's defaults)
        "common": {"dataset": "fashion_mnist", "data_root": "/usr/share/datasets/fashion-mnist", "alpha": 0.01, **DPSM_CODE_SHARED, **EVALUATION},
        "quick": {"common": {"train_subset": 2000, "base_epochs": 2, "base_milestones": (1,), "eval_splits": 3, "val_splits": 2}, **QUICK},
    },
    "fonts": {
        # the paper's alpha; sized to the budget before any of its runs (docs/fidelity.md): one render of each class
        # per training face (13536 images), LeNet's base model 20 epochs with the lr divided by 10 at 1/2 and 3/4, and
        # the official code's fine-tuning schedule in 10 epochs instead of 40 (the lr divided by 10 at epoch 6 of 10, as at 25 of 40)
        "common": {"dataset": "fonts:train=1", "alpha": 0.1, "base_epochs": 20, "base_milestones": (10, 15), **DPSM_CODE_SHARED, "epochs": 10,
                   "milestones": (6,), **EVALUATION},
        "quick": {"common": {"dataset": "fonts:classes=20,train=1", "base_epochs": 2, "base_milestones": (1,), "eval_splits": 3, "val_splits": 2}, **QUICK},
    },
}
for definition in DATASETS.values():
    definition.update(arms=decisive_arms(), seeds=10, concurrency=2, prefix="decisive", **DECISIVE_ANALYSIS)

if __name__ == "__main__":
    sys.exit(cli("sweeps/decisive.py", __doc__.splitlines()[0], DATASETS))
