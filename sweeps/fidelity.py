"""Is conformal training, as the paper trained it, better than CE?  The fidelity study offline:
Fashion-MNIST (real, from Debian's dataset-fashion-mnist) and the glyphs (docs/fidelity.md).

    python sweeps/fidelity.py --dataset fashion_mnist [--data-root /usr/share/datasets/fashion-mnist]
    python sweeps/fidelity.py --dataset glyphs
    python sweeps/fidelity.py ... --quick            # a smoke run: small subset, 2 epochs, 2 seeds
    python sweeps/fidelity.py ... --out DIR --resume --seeds N --arms base,ce,dpsm_official

Every arm (a method and its settings, no search: ``fidelity_arms`` in sweeps/cifar100_fidelity.py) runs with every seed;
each fine-tuning arm starts from that seed's CE base model, fine-tuned as the official DPSM code
fine-tunes (40 epochs, batch 128, lr restarted at 0.1 and divided by 10 at epoch 25).  The ``base``
arm is those base models, evaluated as they are: the paper's table's CE column.

- Fashion-MNIST at alpha 0.01, ConfTr's protocol (Stutz et al. 2022): their MLP (2 x 64 units,
  BatchNorm), the base model their CE baseline (150 epochs, batch 100, lr 0.05 divided by 10 at
  epochs 60, 90 and 120, Nesterov momentum, weight decay 5e-4 * sum of squares), 55000 / 5000 /
  5000 / 5000 images, 10 calibration/test re-splits; plus ConfTr as they published it, from
  scratch with their recipe.  Their Table 1 (THR 2.05 and APS 2.36 for the baseline, 1.69 and 1.82
  for ConfTr) is beside ours in docs/fidelity.md.
- glyphs (100 procedural classes, 20 training images each; dpsm_ray/data/glyphs.py) at alpha 0.1:
  the paper's regime, a LeNet that memorises its training set.
"""

import sys

from cifar100_fidelity import fidelity_arms  # the arms, defined once beside the cluster study (sweeps/)
from dpsm_ray.sweep.study import cli
from dpsm_ray.train.presets import DPSM_CODE_SHARED

# diagnostics over the whole training split (the paper's Q_n; the default samples 10000 examples)
EVALUATION = {"val_splits": 5, "eval_splits": 10, "diagnostic_examples": 0, "workers": 0, "cpus_per_worker": 1, "data_workers": 0, "seed": 0}
DATASETS = {
    "fashion_mnist": {
        "common": {"dataset": "fashion_mnist", "data_root": "/usr/share/datasets/fashion-mnist", "alpha": 0.01, **DPSM_CODE_SHARED, **EVALUATION},
        "arms": fidelity_arms(published=True),
        "seeds": 5,
        "concurrency": 2,  # one trial per core, each with one thread
        "quick": {"common": {"train_subset": 2000, "base_epochs": 2, "base_milestones": (1,), "eval_splits": 3, "val_splits": 2}, "seeds": 2, "epochs": 2, "milestones": (1,)},
    },
    "glyphs": {
        # the paper's schedules scaled down for the base model: 60 epochs, lr divided by 10 at 1/2 and 3/4
        "common": {"dataset": "glyphs", "alpha": 0.1, "base_epochs": 60, "base_milestones": (30, 45), **DPSM_CODE_SHARED, **EVALUATION},
        "arms": fidelity_arms(),
        "seeds": 5,
        "concurrency": 2,
        "quick": {"common": {"dataset": "glyphs:classes=20", "base_epochs": 2, "base_milestones": (1,), "eval_splits": 3, "val_splits": 2}, "seeds": 2, "epochs": 2, "milestones": (1,)},
    },
}

if __name__ == "__main__":
    sys.exit(cli("sweeps/fidelity.py", __doc__.splitlines()[0], DATASETS))
