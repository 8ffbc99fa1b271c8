"""The whole service on a laptop: scikit-learn's bundled digits (offline), embedded local Ray, CPU.

Trains the CE base model, searches each of CE, CUT, ConfTr and DPSM with Optuna (validation set
size subject to validation coverage >= 1 - alpha - 0.02), re-trains each method's best
configuration with two seeds, and prints the paper-style table.

    python sweeps/digits.py [--results-dir results/digits] [--trials 4] [--resume] [--seed 0]
"""

import sys

if __name__ == "__main__":  # storage the service cannot use is refused at once, before torch and Ray load
    from dpsm_ray.sweep.options import refuse_unusable_storage

    refuse_unusable_storage("sweeps/digits.py", sys.argv[1:])

from dpsm_ray.sweep.cli import main  # noqa: E402

DEFAULTS = {
    "trials": 4,
    "final_seeds": 2,
    # split conformal inside a ~150-point validation split: its coverage has a standard error of
    # about 0.025, so a calibrated model misses 0.9 half the time without some slack
    "coverage_slack": 0.02,
    "config": {
        "dataset": "digits",
        "init": "base",  # the paper's protocol: fine-tune every method from one CE model
        "base_epochs": 20,
        "epochs": 10,
        "batch_size": 64,
        # each trial trains inside its Tune trial process: on 2 CPU cores a one-worker Ray Train run
        # adds ~16 s of start-up to a ~4 s trial (measured: 21 s against 4-5 s a trial, the whole
        # sweep 12.4 min against ~4); --workers 1 runs every trial as a TorchTrainer, as the GPU
        # sweeps do
        "workers": 0,
        "cpus_per_worker": 1,
        "val_splits": 5,
        "eval_splits": 10,
    },
}

if __name__ == "__main__":
    sys.exit(main("digits", __doc__.splitlines()[0], DEFAULTS))
