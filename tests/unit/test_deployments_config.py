"""Every deployment in prefect.yaml names an entrypoint that exists and a config that validates
and selects that entrypoint's flow, so each runs with its defaults."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from rlpipe.tasks.config import load_config

ROOT = Path(__file__).resolve().parents[2]
DEPLOYMENTS = yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"]


@pytest.mark.parametrize("deployment", DEPLOYMENTS, ids=[d["name"] for d in DEPLOYMENTS])
def test_deployment_defaults_point_at_a_valid_config_for_its_flow(deployment):
    path, function = deployment["entrypoint"].split(":")
    source = (ROOT / path).read_text()
    assert f"def {function}(" in source
    flow_name = source.split(f"def {function}(")[0].rsplit('@flow(name="', 1)[1].split('"')[0]
    config = load_config(ROOT / deployment["parameters"]["config_path"], deployment["parameters"]["overrides"])
    assert config.flow == flow_name, (deployment["name"], config.flow, flow_name)


def test_the_tiny_pipeline_deployment_exists():
    assert {"tiny", "pipeline", "pretrain", "sft", "rl"} <= {d["name"] for d in DEPLOYMENTS}


def test_no_deployment_writes_the_folder_make_demo_uses():
    demo = load_config(ROOT / "configs" / "demo.toml").run_dir
    for deployment in DEPLOYMENTS:
        config = load_config(ROOT / deployment["parameters"]["config_path"], deployment["parameters"]["overrides"])
        assert config.run_dir != demo, deployment["name"]  # not even with resume or overwrite


@pytest.mark.parametrize("name", ["pipeline", "tiny"])
def test_the_pipeline_deployments_show_their_stages_as_task_runs(name):
    (deployment,) = [d for d in DEPLOYMENTS if d["name"] == name]
    config = load_config(ROOT / deployment["parameters"]["config_path"], deployment["parameters"]["overrides"])
    assert config.tracking.prefect_task_runs


def test_prefect_yaml_pins_the_installed_prefect_or_none():
    import prefect

    pinned = yaml.safe_load((ROOT / "prefect.yaml").read_text()).get("prefect-version")
    assert pinned in (None, prefect.__version__), f"prefect.yaml pins {pinned}, {prefect.__version__} is installed"
