"""The decisive experiment: the fidelity study's arms on CIFAR-100 with ResNet-110, on a GPU cluster.

    ray up cluster/gpu.yaml
    ray submit cluster/gpu.yaml sweeps/cifar100_fidelity.py -- --out /mnt/shared/results/cifar100-fidelity --data-root /mnt/shared/data

Eight seeds (``--seeds N`` for more) of: the CE base model (164 epochs, the official recipe) evaluated as it is -- the paper's
table's CE column --, CE fine-tuned, DPSM as its official code trains it, DPSM at this project's
defaults, DPSM as the tex's Algorithm 1 reads, ConfTr and CUT, each fine-tuned from that seed's base
model as the official code fine-tunes (40 epochs, batch 128, lr 0.1 divided by 10 at epoch 25),
evaluated with 10 calibration/test re-splits at alpha 0.1 (docs/fidelity.md says what each arm
is and how to read the result).  Prints its GPU-hour estimate before it starts; ``--quick`` is a
CPU dry run (ResNet-20, 128 training images, one epoch, 2 seeds) on whatever CIFAR-100 files
--data-root holds (the tests run it on a generated copy).
"""

import sys

from dpsm_ray.results.studies import Arm
from dpsm_ray.sweep.study import cli
from dpsm_ray.train.base_model import BASE_RECIPES
from dpsm_ray.train.presets import DPSM_CODE_SHARED, preset_values

# The fidelity study's arms, defined here because `ray submit` sends this one file to the cluster's head:
# sweeps/fidelity.py takes them from this file.
def fidelity_arms(published: bool = False) -> tuple[Arm, ...]:
    """The study's arms (docs/fidelity.md): the base model, CE fine-tuned, DPSM three ways (its
    official code's settings, this project's defaults, the tex's Algorithm 1 as this project read
    it before), ConfTr and CUT at their defaults, and, with ``published``, ConfTr as Stutz et al.
    published it (from scratch, their recipe: the Fashion-MNIST one)."""
    arms = [
        Arm("base", "CE base model, not fine-tuned (the paper's CE column)", {"method": "base", "epochs": 0}),
        Arm("ce", "CE fine-tuned", {"method": "ce"}),
        Arm(
            "dpsm_official", "DPSM as its official code trains it", {"method": "dpsm", **preset_values("official", "dpsm", schedule=False)}
        ),
        Arm("dpsm", "DPSM at this project's defaults", {"method": "dpsm"}),
        # the tex's Algorithm 1 as this project followed it before it trained as the official code does: CE on B1 only, T 0.1, lambda 0.5
        Arm(
            "dpsm_tex",
            "DPSM, CE on B1 only (the tex), T 0.1, lambda 0.5",
            {"method": "dpsm", "ce_batch": "half", "sigmoid_temperature": 0.1, "conformal_weight": 0.5},
        ),
        Arm("conftr", "ConfTr as the DPSM paper describes it", {"method": "conftr"}),
        Arm("cut", "CUT", {"method": "cut"}),
    ]
    if published:
        arms.append(Arm("conftr_published", "ConfTr as published (Stutz et al.), from scratch",
                        {"method": "conftr_published", **preset_values("official", "conftr_published")}))
    return tuple(arms)


# Four trials share a GPU (--trials-per-gpu auto for ResNet-110).  Four ResNet-110 DPSM trials of a
# sweep at batch 128 on the default fast path (graph, bf16, channels_last) trained 8722 images/s
# together on one H200, epochs timed with their diagnostics and validation
# (bench/results/h200-2026-11-26/gpu_check_packed.json; one trial alone 7700).  An H100's captured
# step ran 9301 images/s against the H200's 9715 (bench/README.md): about 4% fewer GPU-hours there.
TRIALS_PER_GPU = 4
IMAGES_PER_SECOND = 8700  # per GPU, the four trials together
TRAIN_IMAGES = 45000
EVALUATION_SHARE = 0.05  # the final evaluations and each trial's start (graph capture, cuDNN autotuning)

DATASETS = {
    "cifar100": {
        "common": {
            "dataset": "cifar100", "data_root": "/mnt/shared/data", "model": "resnet110", "alpha": 0.1, **DPSM_CODE_SHARED,
            "val_splits": 5, "eval_splits": 10, "workers": 0, "gpus_per_worker": 1 / TRIALS_PER_GPU, "cpus_per_worker": 2, "data_workers": 0, "seed": 0,
        },
        "arms": fidelity_arms(),
        "seeds": 8,  # the per-seed SD of a change is ~2% (Fashion-MNIST): 8 seeds detect ~2.3% (docs/fidelity.md)
        "concurrency": 8,
        # --quick: the study's plumbing at CPU size; ResNet-20, the same CIFAR ResNet at a sixth of
        # ResNet-110's depth (tests/test_cli.py trains ResNet-110 on generated CIFAR-100 files)
        "quick": {"common": {"device": "cpu", "model": "resnet20", "gpus_per_worker": 0.0, "cpus_per_worker": 1, "train_subset": 128, "batch_size": 32,
                             "base_epochs": 1, "base_milestones": (), "base_batch_size": 32, "eval_splits": 2, "val_splits": 2},
                  "seeds": 2, "epochs": 1, "milestones": ()},
    },
}


def gpu_hours(study) -> str:
    """What the study costs on GPUs, from the epochs it trains and the measured throughput (bench/README.md)."""
    base = BASE_RECIPES["resnet110"]["epochs"] if study.common.base_epochs is None else study.common.base_epochs
    epochs = len(study.seeds) * (base + sum(study.arm_config(arm).epochs for arm in study.arms))
    images = epochs * min(TRAIN_IMAGES, study.common.train_subset or TRAIN_IMAGES)
    hours = images / IMAGES_PER_SECOND / 3600 * (1 + EVALUATION_SHARE)
    return (f"this study trains {epochs} epochs ({len(study.seeds)} seeds x ({base} base-model epochs + "
            f"{' + '.join(str(study.arm_config(arm).epochs) for arm in study.arms)} for the arms)): about {hours:.1f} GPU-hours at "
            f"{IMAGES_PER_SECOND} images/s per GPU ({TRIALS_PER_GPU} ResNet-110 trials at batch 128 on the fast path sharing a GPU, measured on an H200), "
            f"{EVALUATION_SHARE:.0%} added for evaluation")


if __name__ == "__main__":
    sys.exit(cli("sweeps/cifar100_fidelity.py", __doc__.splitlines()[0], DATASETS, estimate=gpu_hours))
