"""On-policy distillation: the teacher's per-token term in the advantages and the packed weights,
the config's and pre-flight's refusals."""

from __future__ import annotations

import pytest
from rlpipe.core.config import ConfigError
from rlpipe.rollouts.distill import DistillOptions, token_advantages
from rlpipe.rollouts.fates import distilled
from rlpipe.rollouts.records import Rollout, TrainSample
from rlpipe.tasks.config import RunConfig, validate_config
from rlpipe.tasks.pack import rollout_sequence


def _rollout(student, teacher) -> Rollout:
    return Rollout(run_id="r", step=1, policy_version=0, env="e", example_id="x", group_id="g", sample_id="s",
                   attempt=1, prompt_tokens=[1, 2], completion_tokens=[3, 4, 5], completion_logprobs=student,
                   finish_reason="stop", prompt_text="", completion_text="", n_prompt_tokens=2,
                   n_completion_tokens=3, teacher_logprobs=teacher)


def test_the_teacher_term_is_the_negative_reverse_kl_per_token():
    rollout = _rollout([-1.0, -2.0, -0.5], [-0.5, -3.0, -0.5])
    assert token_advantages(0.7, rollout, DistillOptions("none")) is None
    assert token_advantages(0.7, rollout, DistillOptions("advantage")) == pytest.approx([0.5, -1.0, 0.0])
    assert token_advantages(0.7, rollout, DistillOptions("reward", 0.1)) == pytest.approx([0.75, 0.6, 0.7])


def test_packing_puts_each_tokens_own_advantage_on_it():
    rollout = _rollout([-1.0, -2.0, -0.5], [-0.5, -3.0, -0.5])
    sample = distilled(TrainSample(rollout, 0.0, 0.0), DistillOptions("advantage"))
    assert sample.advantage == pytest.approx(-0.5 / 3)
    assert rollout_sequence(sample).weights == pytest.approx([0.0, 0.0, 0.5, -1.0, 0.0])
    plain = rollout_sequence(TrainSample(rollout, 1.0, 0.25))
    assert plain.weights == [0.0, 0.0, 0.25, 0.25, 0.25]


@pytest.mark.parametrize(("rl", "message"), [
    ({"teacher": "some/folder"}, "needs both a teacher"),
    ({"distill": {"type": "reward"}}, "needs both a teacher"),
    ({"teacher": "t", "distill": {"type": "advantage"}}, "drop_zero_variance = false"),
])
def test_config_refuses_half_a_distillation(rl, message):
    with pytest.raises(ConfigError, match=message):
        validate_config({"rl": rl})


def test_preflight_refuses_a_teacher_with_another_tokenizer_in_one_line(tmp_path):
    from rlpipe.models.presets import build_model
    from rlpipe.models.tokenizer import build_tokenizer
    from rlpipe.tasks.preflight import preflight

    tokenizer = build_tokenizer("0123456789+-*=")  # another alphabet: other tokens, other ids
    model = build_model("tiny-dense", vocab_size=len(tokenizer), seed=0)
    model.save_pretrained(tmp_path / "teacher")
    tokenizer.save_pretrained(tmp_path / "teacher")
    config = RunConfig(flow="rl", runs_root=str(tmp_path / "runs"),
                       rl={"teacher": str(tmp_path / "teacher"), "distill": {"type": "reward"}})
    with pytest.raises(ConfigError) as refused:
        preflight(config)
    message = str(refused.value)
    assert message.startswith("rl.teacher: the teacher's tokenizer is not the student's") and "\n" not in message
    assert not (tmp_path / "runs").exists()  # refused before anything is written


def test_an_in_process_teacher_names_itself_in_every_row_it_scores(tmp_path):
    from rlpipe.models.presets import build_model
    from rlpipe.models.tokenizer import build_tokenizer
    from rlpipe.rollouts.distill import with_teacher
    from rlpipe.tasks.teacher import load_teacher

    tokenizer = build_tokenizer()
    build_model("tiny-dense", vocab_size=len(tokenizer), seed=0).save_pretrained(tmp_path / "teacher")
    tokenizer.save_pretrained(tmp_path / "teacher")
    teacher = load_teacher(str(tmp_path / "teacher"), tmp_path, "cpu")
    [row] = with_teacher([_rollout([-1.0, -2.0, -0.5], None)], teacher)
    assert len(row.teacher_logprobs) == 3 and all(x < 0 for x in row.teacher_logprobs)
    assert (row.teacher, row.teacher_checkpoint, row.teacher_url) == \
        (str(tmp_path / "teacher"), str((tmp_path / "teacher").resolve()), None)
