"""Which device a process Ray started trains on (``ray_train.trial_device``): the GPU Ray gave it,
never the CPU in its place.  The GPU shares are set here by hand; tests/test_gpu_shaped.py gives
them through a real (GPU-shaped) Ray."""

import pytest
import torch

from dpsm_ray.train import ray_train
from dpsm_ray.train.ray_train import GpuUnavailable, trial_device


@pytest.fixture
def share(monkeypatch):
    """Sets the GPUs Ray assigned, CUDA_VISIBLE_DEVICES and whether torch sees CUDA."""
    def set_share(gpus, visible, cuda):
        monkeypatch.setattr(ray_train, "assigned_gpus", lambda: list(gpus))
        if visible is None:
            monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        else:
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    return set_share


def test_a_gpu_share_without_cuda_stops_naming_the_node_and_the_visible_devices(share):
    share(["1"], "1", cuda=False)
    for name in ("auto", "cuda"):
        with pytest.raises(GpuUnavailable, match=r"node \S+: this trial holds GPU 1 \(CUDA_VISIBLE_DEVICES='1'\) but torch sees no CUDA device"):
            trial_device(name)


def test_cpu_trains_on_the_cpu_whatever_the_share(share):
    share(["0"], "0", cuda=False)
    assert trial_device("cpu") == torch.device("cpu")


def test_without_a_share_auto_is_the_cpu_even_where_gpus_are_visible(share):
    share([], "0,1", cuda=True)  # Ray leaves CUDA_VISIBLE_DEVICES alone in a GPU-less process
    assert trial_device("auto") == torch.device("cpu")


def test_a_share_is_the_assigned_gpu_s_position_among_the_visible_ones(share):
    share(["3"], "2,3", cuda=True)  # a Ray Train worker sees its node's workers' GPUs
    assert trial_device("auto") == torch.device("cuda", 1)
    share(["0"], "0", cuda=True)  # a packed Tune trial sees its own GPU only
    assert trial_device("cuda") == torch.device("cuda", 0)
    assert trial_device("cuda:0") == torch.device("cuda", 0)
