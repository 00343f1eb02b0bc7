"""The keys of the flat `[rl]` of earlier versions: refused in a config with their new place in
one line (`rlpipe run` exits before it writes anything), read at their new place from a stored
run's config.json; a removed key refused in one line saying why, dropped from a stored
config.json; and `options_from`, which fills a component's options from its sections."""

from __future__ import annotations

import copy
import dataclasses
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from rlpipe.core.config import ConfigError, options_from
from rlpipe.engines.config import REMOVED
from rlpipe.rollouts.config import MOVED
from rlpipe.tasks.config import load_config, read_run_config, stored_config_data, validate_config
from rlpipe.training.config import LossConfig
from rlpipe.training.rl_loss import RLLossOptions

from tests import warm_cli

ROOT = Path(__file__).resolve().parents[2]

# a value for every moved key, not its default, valid at the new place on its own
# (rl.off_policy.partial_rollouts also needs rl.off_policy.max_steps >= 1: ALONGSIDE)
VALUES = {
    "rl.loss": "cispo", "rl.curriculum": "pass_rate",
    "rl.oversample_factor": 1.5, "rl.max_attempts": 3, "rl.partial_batches": True, "rl.max_staleness": 2,
    "rl.batch_maker": "my_makers:NewestFirst",
    "rl.drop_zero_variance": False, "rl.drop_truncated": True, "rl.sample_filter": "my_filters:keep",
    "rl.max_reward_error_fraction": 0.25, "rl.overlong_buffer": 2, "rl.overlong_penalty": 0.5,
    "rl.estimator": "rloo", "rl.normalize_std": True, "rl.positive_only": True,
    "rl.epsilon_low": 0.1, "rl.epsilon_high": 0.3, "rl.cispo_cap": 4.0, "rl.kl_coef": 0.05, "rl.kl_estimator": "k2",
    "rl.tis_cap": 1.5, "rl.ppo_epochs": 2,
    "rl.max_off_policy_steps": 1, "rl.partial_rollouts": True, "rl.off_policy_tis_cap": 3.0,
    "rl.off_policy_sequence_mask": 0.5,
    "rl.curriculum_window": 4, "rl.curriculum_retest": 0.5, "rl.curriculum_pass_reward": 0.5,
    "rl.curriculum_key": "class", "rl.curriculum_solved_rate": 0.9, "rl.curriculum_reads": 2.0,
}
ALONGSIDE = {"rl.partial_rollouts": {"rl": {"off_policy": {"max_steps": 1}}}}


def nested(dotted: str, value) -> dict:
    """{"a": {"b": value}} of "a.b"."""
    *parents, last = dotted.split(".")
    data = {last: value}
    for part in reversed(parents):
        data = {part: data}
    return data


def merged(base: dict, changes: dict) -> dict:
    out = dict(base)
    for key, value in changes.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def at(config, dotted: str):
    for part in dotted.split("."):
        config = getattr(config, part)
    return config


def test_every_moved_key_has_a_value_here():
    assert set(VALUES) == set(MOVED)


@pytest.mark.parametrize(("old", "new"), sorted(MOVED.items()), ids=sorted(MOVED))
def test_a_moved_key_is_refused_in_one_line_naming_its_new_place(old, new):
    value = VALUES[old]
    with pytest.raises(ConfigError) as error:
        validate_config(nested(old, value), "c.toml")
    message = str(error.value)
    section, _, key = new.rpartition(".")
    assert "\n" not in message, message
    assert message.startswith(f"invalid config c.toml: {old} moved to {new}: write {key} = "), message
    assert message.endswith(f" under [{section}]"), message
    # written where the message says, the value is taken
    config = validate_config(merged(ALONGSIDE.get(old, {}), nested(new, value)))
    assert at(config, new) == value


def test_the_refusal_writes_the_value_as_toml_and_counts_the_other_moved_keys():
    with pytest.raises(ConfigError, match=r'^invalid config X: rl\.loss moved to rl\.loss\.type: write type = '
                                          r'"cispo" under \[rl\.loss\]$'):
        validate_config({"rl": {"loss": "cispo"}}, "X")
    with pytest.raises(ConfigError) as error:
        validate_config({"rl": {"drop_truncated": True, "max_off_policy_steps": 1, "kl_coef": 0.1}})
    message = str(error.value)
    assert "\n" not in message and message.endswith("(and 2 more moved key(s) of [rl])"), message
    assert "write drop_truncated = true under [rl.filter]" in message
    # the tables that took the names of old keys are the new layout, not a moved key
    assert validate_config({"rl": {"loss": {"type": "cispo"}, "curriculum": {"type": "pass_rate"}}}).rl.loss.type \
        == "cispo"


def test_rlpipe_run_refuses_a_moved_key_in_one_line_before_it_writes_anything(tmp_path):
    runs = tmp_path / "runs"
    done = warm_cli.run(
        [sys.executable, "-m", "rlpipe.flows.cli", "run", str(ROOT / "configs" / "tiny.toml"),
         "--set", "rl.max_off_policy_steps=1", "--set", f"runs_root={runs}"],
        capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    assert lines[0].endswith("rl.max_off_policy_steps moved to rl.off_policy.max_steps: write max_steps = 1 "
                             "under [rl.off_policy]"), lines[0]
    assert not runs.exists() and not any(tmp_path.iterdir())  # no run folder, no tracking database


# every key of the flat [rl] of earlier versions, as a run's config.json held them
OLD_RL = {
    "steps": 3, "sampling": {"max_new_tokens": 8},
    "loss": "cispo", "epsilon_low": 0.1, "epsilon_high": 0.3, "cispo_cap": 4.0, "kl_coef": 0.05,
    "kl_estimator": "k2", "tis_cap": 0.0, "ppo_epochs": 1,
    "max_off_policy_steps": 1, "partial_rollouts": True, "off_policy_tis_cap": 3.0, "off_policy_sequence_mask": 0.5,
    "oversample_factor": 1.5, "max_attempts": 3, "partial_batches": True, "max_staleness": 2, "batch_maker": "",
    "buffer": {"retention": "all"},  # a table that was there before: the moved buffer keys join it
    "drop_zero_variance": False, "drop_truncated": True, "sample_filter": "",
    "max_reward_error_fraction": 0.25, "overlong_buffer": 2, "overlong_penalty": 0.5,
    "estimator": "rloo", "normalize_std": True, "positive_only": True,
    "curriculum": "pass_rate", "curriculum_window": 4, "curriculum_retest": 0.5, "curriculum_pass_reward": 0.5,
    "curriculum_key": "class", "curriculum_solved_rate": 0.9, "curriculum_reads": 2.0,
}
NEW_RL = {
    "steps": 3, "sampling": {"max_new_tokens": 8},
    "loss": {"type": "cispo", "epsilon_low": 0.1, "epsilon_high": 0.3, "cispo_cap": 4.0, "kl_coef": 0.05,
             "kl_estimator": "k2", "tis_cap": 0.0, "ppo_epochs": 1},
    "off_policy": {"max_steps": 1, "partial_rollouts": True, "tis_cap": 3.0, "sequence_mask": 0.5},
    "buffer": {"oversample_factor": 1.5, "max_attempts": 3, "partial_batches": True, "max_staleness": 2,
               "batch_maker": "", "retention": "all"},
    "filter": {"drop_zero_variance": False, "drop_truncated": True, "sample_filter": ""},
    "scoring": {"max_reward_error_fraction": 0.25, "overlong_buffer": 2, "overlong_penalty": 0.5},
    "advantages": {"estimator": "rloo", "normalize_std": True, "positive_only": True},
    "curriculum": {"type": "pass_rate", "window": 4, "retest": 0.5, "pass_reward": 0.5, "key": "class",
                   "solved_rate": 0.9, "reads": 2.0},
}


def test_a_stored_config_with_the_old_keys_reads_as_the_new_layout():
    assert {f"rl.{key}" for key in OLD_RL} >= set(MOVED)  # every moved key is read back
    old = {"flow": "rl", "run_name": "r", "rl": OLD_RL}
    before = copy.deepcopy(old)
    new = validate_config({"flow": "rl", "run_name": "r", "rl": NEW_RL})
    assert read_run_config(old) == new
    assert stored_config_data(old) == {"flow": "rl", "run_name": "r", "rl": NEW_RL}
    assert old == before  # read from a copy: the stored dict is left as it was
    with pytest.raises(ConfigError, match="moved to"):
        validate_config(old)  # a config being written today must use the new layout
    # a config.json of today's layout reads as itself
    dumped = new.model_dump(mode="json")
    assert read_run_config(dumped) == new and stored_config_data(dumped) == dumped


def test_a_removed_key_is_refused_in_one_line_saying_why_and_a_stored_config_reads_without_it(tmp_path):
    with pytest.raises(ConfigError) as error:
        validate_config({"engine": {"type": "vllm", "zero_copy": True}}, "c.toml")
    message = str(error.value)
    assert "\n" not in message, message
    assert message.startswith("invalid config c.toml: engine.zero_copy was removed: "), message
    assert "CUDA graphs" in message and "delete the line" in message
    # the doc section the line names exists
    section = message.split('docs/DESIGN.md, "')[1].split('"')[0]
    assert f"### {section}\n" in (ROOT / "docs" / "DESIGN.md").read_text()
    # given by --set, the same line, said against the override
    path = tmp_path / "c.toml"
    path.write_text('[engine]\ntype = "vllm"\n')
    with pytest.raises(ConfigError, match=r"^invalid config \(--set engine\.zero_copy=false\): "
                                          r"engine\.zero_copy was removed: "):
        load_config(path, ["engine.zero_copy=false"])
    # a run's config.json written while the key existed (every field dumped) reads as today's config
    today = validate_config({"flow": "rl", "run_name": "r", "engine": {"type": "vllm"}})
    stored = today.model_dump(mode="json")
    stored["engine"]["zero_copy"] = False
    assert read_run_config(stored) == today
    assert stored_config_data(stored) == today.model_dump(mode="json")
    assert stored["engine"]["zero_copy"] is False  # read from a copy
    assert set(REMOVED) == {"engine.zero_copy"} and "zero_copy" not in type(today.engine).model_fields


@dataclasses.dataclass(frozen=True)
class Options:
    rate: float
    name: str = "plain"
    depth: int = 1
    derived: int = dataclasses.field(default=0, init=False)


def test_options_from_fills_fields_by_name_from_the_first_section_that_has_them():
    first = SimpleNamespace(rate=0.5, unrelated="x")
    second = SimpleNamespace(rate=9.0, name="second", derived=7)
    assert options_from(Options, first, second) == Options(rate=0.5, name="second")  # depth: its default
    assert options_from(Options, first, second, name="given", depth=3) == Options(rate=0.5, name="given", depth=3)
    assert options_from(Options, second, rate=0.1).rate == 0.1  # `given` wins over every section
    assert options_from(Options, second).derived == 0  # a field the constructor does not take is left alone
    with pytest.raises(TypeError, match="Options has no field colour, size"):
        options_from(Options, first, size=2, colour="red")
    with pytest.raises(TypeError, match="rate"):
        options_from(Options, SimpleNamespace())  # a required field no section has
    # the policy loss's options from [rl.loss], its `type` given as the options' `name`
    loss = options_from(RLLossOptions, LossConfig(type="cispo", cispo_cap=3.0), name="cispo")
    assert (loss.name, loss.cispo_cap, loss.kl_coef) == ("cispo", 3.0, 0.0)
