"""Config validation: typed sections, dotted names in errors, overrides, shipped configs valid."""

import json
import re
from pathlib import Path

import pytest
from rlpipe.core.config import ConfigError, apply_overrides, describe_fields
from rlpipe.tasks.config import RunConfig, load_config, validate_config
from rlpipe.training.rl_loss import LOSS_NAMES, LOSSES

ROOT = Path(__file__).resolve().parents[2]


def write(tmp_path, text: str) -> Path:
    path = tmp_path / "c.toml"
    path.write_text(text)
    return path


def test_unknown_key_is_named_with_its_dotted_path(tmp_path):
    with pytest.raises(ConfigError, match=r"rl\.sampling\.temprature: unknown key"):
        load_config(write(tmp_path, "[rl.sampling]\ntemprature = 0.7\n"))


def test_bad_value_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"rl\.group_size"):
        load_config(write(tmp_path, "[rl]\ngroup_size = 0\n"))
    with pytest.raises(ConfigError, match=r"flow"):
        load_config(write(tmp_path, 'flow = "dpo"\n'))
    with pytest.raises(ConfigError, match=r"^invalid config .*: checkpoint\.keep_last: must be >= 0, got -1$"):
        load_config(write(tmp_path, "[checkpoint]\nkeep_last = -1\n"))
    assert load_config(write(tmp_path, "[checkpoint]\nkeep_last = 3\n")).checkpoint.keep_last == 3


def test_missing_file_and_bad_toml(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path, "[rl\n"))


def test_set_overrides_parse_toml_literals(tmp_path):
    config = load_config(write(tmp_path, "[rl]\nsteps = 5\n"),
                         ["rl.steps=7", "rl.sampling.temperature=0.5", "run_name=x", "task.options={digits=2}"])
    assert config.rl.steps == 7
    assert config.rl.sampling.temperature == 0.5
    assert config.run_name == "x"
    assert config.task.options == {"digits": 2}
    with pytest.raises(ConfigError, match="key=value"):
        apply_overrides({}, ["rl.steps"])


def test_http_engine_needs_urls():
    with pytest.raises(Exception, match="engine.urls"):
        RunConfig.model_validate({"engine": {"type": "http"}})


def test_every_field_has_a_docstring():
    lines = describe_fields(RunConfig)
    assert len(lines) > 40
    assert all(not line.rstrip().endswith("#") for line in lines if " = " in line), \
        [line for line in lines if line.rstrip().endswith("#")]


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "configs").glob("*.toml")))
def test_shipped_configs_validate(name):
    config = load_config(ROOT / "configs" / name)
    assert config.run_name


@pytest.mark.parametrize("name", ["..", ".", "", " x", "a/b", "a\\b", "../up", "x\ny"])
def test_run_name_must_be_a_plain_folder_name(name):
    # '..' would put the run dir (and --overwrite's rmtree) outside runs_root
    with pytest.raises(ConfigError, match="run_name must be a plain folder name"):
        load_config(ROOT / "configs" / "tiny.toml", [f"run_name={name!r}".replace("'", '"')])


@pytest.mark.parametrize("key", ["rl.optim.lr", "rl.optim.max_grad_norm", "rl.buffer.oversample_factor",
                                 "sft.optim.min_lr_ratio", "rl.sampling.temperature", "task.options.x"])
@pytest.mark.parametrize("value", ["inf", "nan", "-inf"])
def test_non_finite_numbers_are_refused_by_name(key, value):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.") + ".*finite"):
        load_config(ROOT / "configs" / "tiny.toml", [f"{key}={value}"])


def test_non_finite_strings_are_refused_too():
    # config.json read back by `rlpipe resume` could carry "inf" as a string
    with pytest.raises(ConfigError, match=r"rl\.optim\.lr: must be a finite number"):
        validate_config({"rl": {"optim": {"lr": "inf"}}})


def test_epsilon_low_must_stay_below_one():
    with pytest.raises(ConfigError, match=r"rl\.loss\.epsilon_low"):
        load_config(ROOT / "configs" / "tiny.toml", ["rl.loss.epsilon_low=1.0"])
    assert load_config(ROOT / "configs" / "tiny.toml", ["rl.loss.epsilon_low=0.99"]).rl.loss.epsilon_low == 0.99


def test_an_inline_api_token_is_refused_with_where_to_put_it():
    with pytest.raises(ConfigError, match="RLPIPE_API_TOKEN"):
        load_config(ROOT / "configs" / "tiny.toml", ['engine.api_token="s3cret"'])


@pytest.mark.parametrize(("rl", "message"), [
    ({"loss": {"type": "ppo_clip", "tis_cap": 2.0}}, "rl.loss.tis_cap with rl.loss.type = 'ppo_clip' is not supported"),
    ({"loss": {"type": "gspo", "tis_cap": 2.0}}, "rl.loss.tis_cap is for reinforce and ppo_clip; rl.loss.type = 'gspo'"),
    ({"loss": {"type": "dr_grpo"}, "advantages": {"normalize_std": True}}, "rl.loss.type = 'dr_grpo' removes the std normalisation"),
    ({"loss": {"type": "gspo"}, "optim": {"normaliser": "token"}},
     "rl.loss.type = 'gspo' is normalised per sequence; rl.optim.normaliser = 'token' contradicts it"),
])
def test_a_loss_combination_is_refused_at_validation(rl, message):
    # the loss registry (training/rl_loss.py) decides; the config refuses before a run starts
    with pytest.raises(ConfigError, match=r"^invalid config: " + re.escape(message)):
        validate_config({"rl": rl})


def test_a_loss_option_set_to_its_own_value_is_accepted():
    assert validate_config({"rl": {"loss": {"type": "gspo"}, "optim": {"normaliser": "sequence"}}}).rl.loss.type == "gspo"
    assert validate_config({"rl": {"loss": {"type": "dr_grpo"}}}).rl.loss_normaliser() == ("constant", 16.0 * 16 * 8)


def test_async_rl_gives_truncated_is_to_the_losses_that_weight_by_the_engine():
    async_rl = {"off_policy": {"max_steps": 1, "tis_cap": 3.0}}
    assert validate_config({"rl": async_rl}).rl.loss_options().tis_cap == 3.0
    assert validate_config({"rl": async_rl | {"loss": {"tis_cap": 1.5}}}).rl.loss_options().tis_cap == 1.5
    assert validate_config({"rl": async_rl | {"loss": {"type": "ppo_clip"}}}).rl.loss_options().tis_cap == 0.0
    assert validate_config({"rl": async_rl | {"loss": {"type": "gspo"}}}).rl.loss_options().tis_cap == 0.0
    assert validate_config({}).rl.loss_options().tis_cap == 0.0


def test_the_lora_section_builds_the_adapters_options():
    from rlpipe.training.lora import DEFAULT_TARGETS, LoraOptions

    assert validate_config({}).model.lora.options() is None  # rank 0: LoRA off
    options = validate_config({"model": {"lora": {"rank": 4, "alpha": 8.0}}}).model.lora.options()
    assert options == LoraOptions(rank=4, alpha=8.0, dropout=0.0, targets=DEFAULT_TARGETS)


@pytest.mark.parametrize("loss", LOSS_NAMES)
def test_validate_dump_load_validate_is_the_identity_for_every_loss(loss):
    # flows receive the config as a dict (config.json, Prefect parameters, a rank's copy) and
    # validate it again: a default must never come back as a setting that contradicts the loss
    config = load_config(ROOT / "configs" / "tiny.toml", [f'rl.loss.type="{loss}"'])
    dumped = config.model_dump(mode="json")
    again = validate_config(json.loads(json.dumps(dumped)))
    assert again == config and again.model_dump(mode="json") == dumped
    assert again.rl.loss_normaliser() == config.rl.loss_normaliser()
    assert config.rl.loss_normaliser()[0] == (LOSSES[loss].normaliser or "token")


@pytest.mark.parametrize("loss", LOSS_NAMES)
def test_a_resolved_config_takes_another_loss_as_an_override(loss):
    # a deployment's `config` parameter is often a dumped config.json with `overrides` on top
    dumped = load_config(ROOT / "configs" / "tiny.toml").model_dump(mode="json")
    assert dumped["rl"]["optim"]["normaliser"] is None  # unset stays unset in the dump
    config = validate_config(apply_overrides(dumped, [f"rl.loss.type={loss}"]))
    assert config.rl.loss.type == loss and config.rl.loss_normaliser()[0] == (LOSSES[loss].normaliser or "token")


def test_the_normaliser_left_unset_is_token_for_supervised_phases_and_reinforce():
    config = validate_config({})
    assert config.sft.optim.normaliser is None and config.rl.loss_normaliser()[0] == "token"
    assert validate_config({"rl": {"optim": {"normaliser": "sequence"}}}).rl.loss_normaliser()[0] == "sequence"


@pytest.mark.parametrize("phase", ["sft", "pretrain"])
def test_a_supervised_phase_refuses_the_constant_normaliser_it_has_no_divisor_for(phase):
    with pytest.raises(ConfigError, match=rf"{phase}: .*optim.normaliser = 'constant'.*use 'token' or 'sequence'"):
        validate_config({phase: {"optim": {"normaliser": "constant"}}})
    assert validate_config({"rl": {"optim": {"normaliser": "constant"}}}).rl.optim.normaliser == "constant"


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.toml")), ids=lambda p: p.name)
def test_every_shipped_config_validates_again_to_itself_under_every_loss(path):
    for loss in LOSS_NAMES:
        config = load_config(path, [f"rl.loss.type={loss}", "rl.advantages.normalize_std=false"])
        dumped = json.loads(json.dumps(config.model_dump(mode="json")))
        assert validate_config(dumped) == config, (path.name, loss)
        assert validate_config(config.model_dump()) == config  # the python-mode dump a rank's copy takes
@pytest.mark.parametrize("parallel", ["ddp", "fsdp2"])
def test_lora_and_kl_are_accepted_under_data_parallelism(parallel):
    """The README's promise; tests/integration/test_distributed_extras.py checks that such a step
    equals one process's."""
    config = load_config(ROOT / "configs" / "tiny.toml",
                         [f"train.parallel={parallel}", "model.lora.rank=4", "rl.loss.kl_coef=0.05"])
    assert (config.train.parallel, config.model.lora.rank, config.rl.loss.kl_coef) == (parallel, 4, 0.05)


@pytest.mark.parametrize("data, says", [
    ({"rl": {"buffer": {"max_atempts": 3}}}, "rl.buffer.max_atempts: unknown key; did you mean rl.buffer.max_attempts?"),
    ({"task": {"envs": [{"env": "arithmetic", "name": "a", "wieght": 2}]}},
     "task.envs[0].wieght: unknown key; did you mean task.envs[0].weight?"),
    ({"rl": {"scoring": {"overlong_buffer": 99}, "sampling": {"max_new_tokens": 4}}},
     "rl.scoring.overlong_buffer (99) exceeds rl.sampling.max_new_tokens (4)"),
    ({"rl": {"steps": -1}}, "rl.steps: must be >= 0, got -1"),
    ({"task": {"envs": [{"env": "arithmetic"}]}}, "task.envs[0].name: required, but not given"),
])
def test_config_errors_are_in_our_words(data, says):
    with pytest.raises(ConfigError) as error:
        validate_config(data)
    message = str(error.value)
    assert message == f"invalid config: {says}"
    for pydantic in ("Extra inputs", "Value error", "(root)", "Input should", "Field required"):
        assert pydantic not in message


def test_a_set_typo_is_said_against_the_set_and_a_file_typo_against_the_file(tmp_path):
    with pytest.raises(ConfigError) as typo:
        load_config(ROOT / "configs" / "tiny.toml", ["rl.stepz=3"])
    assert str(typo.value) == "invalid config (--set rl.stepz=3): rl.stepz: unknown key; did you mean rl.steps?"
    bad = tmp_path / "bad.toml"
    bad.write_text('[rl]\nstepz = 3\n')
    with pytest.raises(ConfigError, match=rf"^invalid config {re.escape(str(bad))}: rl\.stepz: unknown key"):
        load_config(bad, ["rl.steps=3"])
