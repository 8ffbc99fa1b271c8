"""cluster/gpu.yaml and cluster/local.yaml against Ray's own cluster-launcher schema (offline: no cloud calls)."""

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


def test_local_cluster_config_is_valid_and_installs_the_project_like_the_gpu_one(config):
    local = yaml.safe_load((ROOT / "cluster" / "local.yaml").read_text())
    validate(local)
    assert local["provider"]["type"] == "local" and {"head_ip", "worker_ips"} <= set(local["provider"])
    assert {"ssh_user", "ssh_private_key"} <= set(local["auth"])
    assert local["file_mounts"] == config["file_mounts"] == {"~/dpsm-ray": ".", "~/.ray/auth_token": "~/.ray/auth_token"}
    assert any("pip install -q -e ~/dpsm-ray" in command for command in local["setup_commands"])
    # `ray submit` runs the script from ~: a checkout at ~/dpsm_ray would shadow the installed
    # package as an empty namespace package (`from dpsm_ray import __version__` fails on the node)
    assert not any(Path(target).name.isidentifier() for target in local["file_mounts"] if target != "~/.ray/auth_token")
    # the launcher's login shells reset PATH: the environment must come from ~/.bashrc
    assert any("~/.bashrc" in command for command in local["setup_commands"])


@pytest.mark.parametrize("name", ["gpu.yaml", "local.yaml"])
def test_rsync_exclusions_keep_every_file_of_the_package(name):
    """rsync matches an unanchored pattern against any path's tail: "results" would drop
    dpsm_ray/results/ from every node (seen: `No module named 'dpsm_ray.results'` on the head)."""
    import subprocess

    def excluded(path: str, pattern: str) -> bool:
        if pattern.startswith("/"):
            return path == pattern[1:] or path.startswith(pattern[1:] + "/")
        return pattern.removeprefix("**/") in path.split("/")

    patterns = yaml.safe_load((ROOT / "cluster" / name).read_text())["rsync_exclude"]
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    package = [path for path in tracked if path.startswith(("dpsm_ray/", "sweeps/")) or path == "pyproject.toml"]
    assert package and not [path for path in package if any(excluded(path, p) for p in patterns)]
    assert excluded("results/digits/trials.parquet", "/results") and excluded("dpsm_ray/results/x.py", "results")


@pytest.mark.parametrize("name", ["gpu.yaml", "local.yaml"])
def test_every_node_starts_ray_with_token_authentication_and_the_dashboard_on_loopback(name):
    """Issue 21: gpu.yaml started Ray without token authentication and with
    --dashboard-host=0.0.0.0, opening the job API (arbitrary code) to the whole VPC."""
    cluster = yaml.safe_load((ROOT / "cluster" / name).read_text())
    starts = [c for c in cluster["head_start_ray_commands"] + cluster["worker_start_ray_commands"] if "ray start" in c]
    assert len(starts) == 2 and all("RAY_AUTH_MODE=token ray start" in c.replace("RAY_enable_autoscaler_v2=0 ", "") for c in starts), starts
    head = next(c for c in cluster["head_start_ray_commands"] if "--head" in c)
    assert "--dashboard-host=127.0.0.1" in head and "0.0.0.0" not in (ROOT / "cluster" / name).read_text()
    # the token reaches every node, and every Ray command there (the sweep driver too) uses it
    assert cluster["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    assert any("export RAY_AUTH_MODE=token" in c and "~/.bashrc" in c for c in cluster["setup_commands"])


def test_gpu_nodes_run_in_a_security_group_of_their_own(config):
    """The launcher's default group has SSH open to 0.0.0.0/0 (ray/autoscaler/_private/aws/config.py
    adds it to any group it creates): every node type names a group made by the script instead."""
    groups = {name: node["node_config"].get("SecurityGroupIds") for name, node in config["available_node_types"].items()}
    assert all(groups.values()) and len({tuple(g) for g in groups.values()}) == 1, groups


@pytest.mark.parametrize("cidr, message", [("0.0.0.0/0", "refusing 0.0.0.0/0"), ("::/0", "refusing ::/0"), ("203.0.113.7", "is not a CIDR range")])
def test_the_security_group_script_refuses_ssh_from_anywhere(cidr, message):
    import subprocess

    script = ROOT / "cluster" / "aws-security-group.sh"
    run = subprocess.run(["bash", str(script), cidr], capture_output=True, text=True)  # refused before any AWS call
    assert run.returncode == 2 and message in run.stderr
    text = script.read_text()
    assert "FromPort=22,ToPort=22,IpRanges=[{CidrIp=$cidr" in text and "UserIdGroupPairs=[{GroupId=$group" in text
