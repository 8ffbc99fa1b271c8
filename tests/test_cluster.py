"""cluster/gpu.yaml against Ray's own cluster-launcher schema (offline: no cloud calls)."""

import copy
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


def validate(config: dict) -> None:
    from ray.autoscaler._private.util import prepare_config, validate_config

    validate_config(prepare_config(copy.deepcopy(config)))


@pytest.fixture
def config() -> dict:
    return yaml.safe_load((ROOT / "cluster" / "gpu.yaml").read_text())


def test_gpu_cluster_config_is_valid(config):
    validate(config)
    assert config["provider"]["type"] == "aws"
    gpu_nodes = [node for node in config["available_node_types"].values() if node["resources"].get("GPU", 0) >= 1]
    assert gpu_nodes and all(node["max_workers"] >= 1 for node in gpu_nodes)
    # the package reaches every node: synced by file_mounts, installed by setup_commands
    mounted = [remote for remote, local in config["file_mounts"].items() if local == "."]
    assert len(mounted) == 1 and any(f"pip install -q -e {mounted[0]}" in command for command in config["setup_commands"])


def test_gpu_cluster_config_holds_no_credentials(config):
    text = (ROOT / "cluster" / "gpu.yaml").read_text()
    for secret in ("aws_access_key_id", "aws_secret_access_key", "AKIA", "ssh_private_key", "BEGIN RSA"):
        assert secret not in text
    assert "ssh_private_key" not in config["auth"]


@pytest.mark.parametrize("misspell", [
    lambda c: c.__setitem__("setup_comands", c.pop("setup_commands")),
    lambda c: c["available_node_types"]["gpu_worker"].__setitem__("min_worker", c["available_node_types"]["gpu_worker"].pop("min_workers")),
    lambda c: c["available_node_types"]["head"].__setitem__("resorces", c["available_node_types"]["head"].pop("resources")),
])
def test_a_misspelled_key_fails_validation(config, misspell):
    import jsonschema

    misspell(config)
    with pytest.raises(jsonschema.exceptions.ValidationError, match="was unexpected|is a required property"):
        validate(config)


def test_head_node_type_must_exist(config):
    config["head_node_type"] = "haed"
    with pytest.raises(ValueError, match="head_node_type"):
        validate(config)
