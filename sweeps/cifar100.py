"""The paper's CIFAR-100 study on a GPU cluster (its section 5 and appendix D).

ResNet-110 fine-tuned from its CE base model (164 epochs, lr 0.1, milestones 81/122); each method
searched with Optuna on the validation split, then its best configuration re-trained with three
seeds and evaluated with 10 calibration/test re-splits for HPS, APS and RAPS.

    ray up cluster/gpu.yaml
    ray submit cluster/gpu.yaml sweeps/cifar100.py -- --results-dir /mnt/shared/results/cifar100 --data-root /mnt/shared/data --download --trials 32

The paper's exhaustive grid instead of Optuna: add ``--grid paper`` (optionally ``--fix batch_size=128``).
"""

import sys

from dpsm_ray.sweep.cli import main

DEFAULTS = {
    "trials": 32,
    "final_seeds": 3,
    "concurrency": 8,
    "config": {
        "dataset": "cifar100",
        "data_root": "/mnt/shared/data",  # the cluster's shared file system (cluster/gpu.yaml)
        "model": "resnet110",
        "init": "base",
        "epochs": 40,  # paper table 5: 40 epochs, milestone 25, decay 0.1
        "milestones": (25,),
        "lr_decay": 0.1,
        "batch_size": 128,
        # each trial trains in its own Tune trial process, holding its share of a GPU; a one-worker
        # Ray Train run adds only start-up (~16 s a trial on 2 CPU cores); --workers 2+ for DDP trials
        "workers": 0,
        "gpus_per_worker": 1,  # divided by --trials-per-gpu (auto: 4 for ResNet-110 / DenseNet-BC-100)
        "cpus_per_worker": 2,
        "data_workers": 0,  # CIFAR-100 is held in memory; no loader processes
    },
}

if __name__ == "__main__":
    sys.exit(main("cifar100", __doc__.splitlines()[0], DEFAULTS))
