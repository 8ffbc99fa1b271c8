"""The paper's Caltech-101 study on a GPU cluster: ResNet-50 (torchvision), 60 epochs, milestones
25/40 (paper table 5), fine-tuned from its CE base model.

    ray submit cluster/gpu.yaml sweeps/caltech101.py -- --results-dir /mnt/shared/results/caltech101 --data-root /mnt/shared/data --download
"""

import sys

if __name__ == "__main__":  # storage the service cannot use is refused at once, before torch and Ray load
    from dpsm_ray.sweep.options import refuse_unusable_storage

    refuse_unusable_storage("sweeps/caltech101.py", sys.argv[1:])

from dpsm_ray.sweep.cli import main  # noqa: E402

DEFAULTS = {
    "trials": 24,
    "final_seeds": 3,
    "concurrency": 4,
    "config": {
        "dataset": "caltech101",
        "data_root": "/mnt/shared/data",  # the cluster's shared file system (cluster/gpu.yaml)
        "model": "resnet50",
        "init": "base",
        "epochs": 60,
        "milestones": (25, 40),
        "lr_decay": 0.1,
        "batch_size": 128,
        # each trial trains in its own Tune trial process, holding its share of a GPU; a one-worker
        # Ray Train run adds only start-up (~16 s a trial on 2 CPU cores); --workers 2+ for DDP trials
        "workers": 0,
        "gpus_per_worker": 1,
        "cpus_per_worker": 8,
        "data_workers": 6,
    },
}

if __name__ == "__main__":
    sys.exit(main("caltech101", __doc__.splitlines()[0], DEFAULTS))
