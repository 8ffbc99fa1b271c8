"""The paper's iNaturalist study (Fungi, 341 species) on a GPU cluster: ResNet-50, 60 epochs,
milestone 3, decay 0.97 (paper table 5), fine-tuned from its CE base model.

    ray submit cluster/gpu.yaml sweeps/inaturalist.py -- --results-dir /mnt/shared/results/inaturalist --data-root /mnt/shared/data --download

The paper's split sizes (341 species, 50 + 10 images each) are exactly the Fungi of iNaturalist
2021 (``train_mini`` + ``valid``), the default; ``--dataset inaturalist2018`` uses the Fungi
super-category of iNaturalist 2018 instead (321 species, one pool cut into the four splits).
"""

import sys

if __name__ == "__main__":  # storage the service cannot use is refused at once, before torch and Ray load
    from dpsm_ray.sweep.options import refuse_unusable_storage

    refuse_unusable_storage("sweeps/inaturalist.py", sys.argv[1:])

from dpsm_ray.sweep.cli import main  # noqa: E402

DEFAULTS = {
    "trials": 24,
    "final_seeds": 3,
    "concurrency": 4,
    "config": {
        "dataset": "inaturalist",
        "data_root": "/mnt/shared/data",  # the cluster's shared file system (cluster/gpu.yaml)
        "model": "resnet50",
        "init": "base",
        "epochs": 60,
        "milestones": (3,),
        "lr_decay": 0.97,
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
    sys.exit(main("inaturalist", __doc__.splitlines()[0], DEFAULTS))
