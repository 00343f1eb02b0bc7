"""Thinking mode, consistent from SFT to RL: `model.chat_template_kwargs` in every rendering,
reasoning told apart from the answer, the thinking budget of the torch engine, and what a run
says when its budget ends every completion before an answer.

Qwen3's real chat template (tests/fixtures) on a byte-level BPE tokenizer (tests/bpe_tokenizer.py).
"""

from __future__ import annotations

import pytest
import torch
from rlpipe.core.config import ConfigError
from rlpipe.engines.base import SamplingParams
from rlpipe.engines.torch_engine import TorchEngine
from rlpipe.envs.base import Example
from rlpipe.envs.multiturn import env_tokens
from rlpipe.envs.registry import build_env
from rlpipe.envs.reward_models import JudgeReward
from rlpipe.models.chat import (
    ThinkTags,
    chat_segments,
    split_thinking,
    split_thinking_tokens,
    template_ids,
    think_tags,
)
from rlpipe.models.presets import build_model
from rlpipe.rollouts.fates import DropOptions, cut_in_thinking, sample_drop
from rlpipe.rollouts.generation import encode_messages, thinking_budget, thinking_fields
from rlpipe.rollouts.records import Score
from rlpipe.rollouts.scoring import ScoreOptions, score_rollouts
from rlpipe.rollouts.source import all_cut_message
from rlpipe.tasks.config import validate_config

from tests.bpe_tokenizer import build_qwen3_like_tokenizer
from tests.rollout_rows import rollout

OFF, ON = {"enable_thinking": False}, {"enable_thinking": True}
CHAT = [{"role": "user", "content": "12+30="}, {"role": "assistant", "content": "42"}]


@pytest.fixture(scope="module")
def tok():
    return build_qwen3_like_tokenizer()


def _split(tok, segment) -> tuple[str, str]:
    first = next(i for i, w in enumerate(segment.weights) if w)
    return tok.decode(segment.tokens[:first]), tok.decode(segment.tokens[first:])


def test_thinking_off_the_empty_block_is_prompt_and_the_rl_prompt_is_the_sft_context(tok):
    (segment,) = chat_segments(tok, CHAT, template_kwargs=OFF)
    context, trained = _split(tok, segment)
    assert context.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert trained == "42<|im_end|>\n"
    tags = think_tags(tok)
    assert not any(w for t, w in zip(segment.tokens, segment.weights, strict=True) if t in (tags.start, tags.end))
    prompt = encode_messages(tok, CHAT[:1], OFF)
    assert prompt == segment.tokens[: len(prompt)] and tok.decode(prompt) == context


def test_thinking_on_the_model_writes_its_block_and_without_kwargs_the_template_default_holds(tok):
    for kwargs in (ON, None):
        (segment,) = chat_segments(tok, CHAT, template_kwargs=kwargs)
        context, trained = _split(tok, segment)
        assert context.endswith("<|im_start|>assistant\n")
        assert trained == "<think>\n\n</think>\n\n42<|im_end|>\n"
        assert encode_messages(tok, CHAT[:1], kwargs) == segment.tokens[: len(encode_messages(tok, CHAT[:1]))]


def test_reasoning_in_data_with_thinking_off_is_refused_naming_the_kwargs(tok):
    chat = [CHAT[0], {"role": "assistant", "content": "<think>\nadd\n</think>\n\n42"}]
    with pytest.raises(ValueError, match="enable_thinking"):
        chat_segments(tok, chat, template_kwargs=OFF)


def test_judges_and_episodes_render_with_the_kwargs(tok):
    judge = JudgeReward(engine=None, tokenizer=tok, template_kwargs=OFF)
    (prompt,) = judge.judge_prompts([Example("e", "0", "1+1=", 2)], ["2"])
    assert tok.decode(prompt).endswith("assistant\n<think>\n\n</think>\n\n")
    messages = [CHAT[0], {"role": "assistant", "content": "let me check"}]
    reply = env_tokens(tok, messages, [{"role": "user", "content": "go on"}], OFF)
    assert tok.decode(reply).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not tok.decode(env_tokens(tok, messages, [{"role": "user", "content": "go on"}])).endswith("</think>\n\n")


def test_split_follows_qwen3s_parsing_after_the_last_end_tag():
    tags = ThinkTags(start=5, end=6)
    cases = {  # prompt, completion -> thinking, answer, cut
        ((1,), (7, 8)): (0, 2, False),  # no block: all answer
        ((1,), (5, 9, 6, 7, 8)): (3, 2, False),  # block in the completion
        ((1, 5), (9, 9, 6, 7)): (3, 1, False),  # block opened by the generation prompt
        ((1, 5), (9, 9, 9)): (3, 0, True),  # cut inside it
        ((1,), (5, 9, 9)): (3, 0, True),
        ((1,), (5, 6, 7, 6, 8)): (4, 1, False),  # a stray second </think>: the answer is after the last
        ((1, 5, 6), (7,)): (0, 1, False),  # thinking off: the prompt's block is closed
    }
    for (prompt, completion), (thinking, answer, cut) in cases.items():
        got = split_thinking_tokens(list(prompt), list(completion), tags)
        assert (got.thinking_tokens, got.answer_tokens, got.cut_in_thinking) == (thinking, answer, cut), completion
    assert split_thinking_tokens([5], [9, 9], None).answer_tokens == 2  # no tags in the vocabulary
    assert split_thinking("<think>\nadd\n</think>\n\n42") == ("add", "42")
    assert split_thinking("<think>\nadd the") == ("add the", "")
    assert split_thinking("42") == ("", "42")


def test_the_reward_sees_the_answer_after_the_block(tok):
    env = build_env("arithmetic", min_digits=1, max_digits=1, operators="+", eval_size=20)
    example = env.examples("train", seed=0)[0]
    prompt = encode_messages(tok, env.reset(example), ON)
    answer = str(example.answer)
    rows = []
    for i, text in enumerate([f"<think>\nadd them\n</think>\n\n{answer}", "<think>\nadd them", answer]):
        completion = tok.encode(text, add_special_tokens=False)
        fields = thinking_fields(tok, prompt, completion, think_tags(tok))
        rows.append(rollout(sample_id=f"s{i}", example_id=example.example_id, prompt_tokens=prompt,
                            completion_tokens=completion, completion_text=text, n_completion_tokens=len(completion),
                            finish_reason="length" if i == 1 else "stop", **fields))
    assert [r.answer_text for r in rows] == [answer, "", answer]
    assert rows[0].thinking_tokens > 0 and rows[2].thinking_tokens == 0 and rows[1].answer_tokens == 0
    scores = score_rollouts(env, {example.example_id: example}, rows, ScoreOptions())
    assert [s.reward for s in scores] == [1.0, 0.0, 1.0]
    assert [cut_in_thinking(r) for r in rows] == [False, True, False]
    drops = DropOptions(drop_truncated=True, max_new_tokens=4, sample_filter="")
    ok = Score(run_id="r", step=1, sample_id="s", group_id="g", reward=0.0, components={}, error=None)
    assert sample_drop(rows[1], ok, drops)[0] == "cut_in_thinking"
    assert sample_drop(rollout(finish_reason="length", n_completion_tokens=2, thinking_tokens=0,
                               completion_tokens=[1, 2]), ok, drops)[0] == "truncated"


def test_a_run_whose_completions_are_all_cut_says_so(tok):
    cut = [rollout(finish_reason="length", thinking_tokens=4, answer_tokens=0, answer_text="") for _ in range(3)]
    message = all_cut_message(cut, max_new_tokens=4)
    assert message.startswith("3 of 3 completions were cut at rl.sampling.max_new_tokens=4 tokens (3 of them "
                              "after spending tokens on a <think> block); 0 finished with an answer")
    assert "enable_thinking = false" in message
    answered = rollout(finish_reason="stop", completion_text="12")
    assert all_cut_message(cut + [answered], max_new_tokens=4).startswith("3 of 4 completions")
    assert all_cut_message(cut[:1] + [answered] * 2, max_new_tokens=4) is None  # most ended: not the budget
    assert all_cut_message([answered], max_new_tokens=4) is None


def _tiny_engine(tok, seed: int = 0) -> TorchEngine:
    model = build_model("tiny-dense", vocab_size=len(tok), seed=seed,
                        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"))
    return TorchEngine(model.eval())


def test_the_thinking_budget_forces_the_end_tag_with_the_policys_logprob(tok):
    engine = _tiny_engine(tok)
    tags = think_tags(tok)
    prompt = template_ids(tok, CHAT[:1], add_generation_prompt=True) + [tags.start]  # the block is open
    free = SamplingParams(n=6, max_new_tokens=12, seed=3)
    budget = SamplingParams(n=6, max_new_tokens=12, seed=3, **thinking_budget(tok, 4))
    (unbounded,) = engine.generate([prompt], free)
    (bounded,) = engine.generate([prompt], budget)
    forced = 0
    for a, b in zip(unbounded, bounded, strict=True):
        limit = a.tokens.index(tags.end) if tags.end in a.tokens[:5] else 4
        assert b.tokens[:limit] == a.tokens[:limit]  # the same draws until the budget is spent
        assert tags.end in b.tokens[:5]  # at most 4 reasoning tokens, then </think>
        if limit == 4:
            forced += 1
            assert b.tokens[4] == tags.end
            with torch.no_grad():
                logits = engine.model(torch.tensor([prompt + b.tokens[:4]])).logits[0, -1].float()
            assert b.logprobs[4] == pytest.approx(torch.log_softmax(logits, -1)[tags.end].item(), abs=1e-4)
        assert split_thinking_tokens(prompt, b.tokens, tags).cut_in_thinking is False
    assert forced >= 3  # an untrained model rarely closes its block on its own


def test_a_budget_needs_think_tags_and_the_torch_engine(tok):
    from rlpipe.models.tokenizer import build_tokenizer

    with pytest.raises(ValueError, match="max_thinking_tokens needs think_ids"):
        SamplingParams(max_thinking_tokens=3)
    with pytest.raises(ValueError, match="<think> and </think>"):
        thinking_budget(build_tokenizer(), 3)
    assert thinking_budget(build_tokenizer(), 0) == {}
    with pytest.raises(ConfigError, match="max_thinking_tokens needs engine.type = 'torch'"):
        validate_config({"rl": {"sampling": {"max_thinking_tokens": 8}},
                         "engine": {"type": "http", "urls": ["http://127.0.0.1:1"]}})
    config = validate_config({"model": {"chat_template_kwargs": {"enable_thinking": False}},
                              "rl": {"sampling": {"max_thinking_tokens": 8}}})
    assert config.model.chat_template_kwargs == OFF and config.rl.sampling.max_thinking_tokens == 8


class CutStages:
    """Every completion is the empty block `<think>\\n\\n</think>\\n\\n` cut at the token limit
    (reward 0): the issue of a thinking template under a character-tokenizer budget."""

    def generate(self, examples, *, step, attempt, policy_version, previous):
        return [rollout(step=step, policy_version=policy_version, env=e.env, example_id=e.example_id,
                        group_id=f"s{step}a{attempt}g{i}", sample_id=f"s{step}a{attempt}g{i}:{j}", attempt=attempt,
                        prompt_tokens=[1], completion_tokens=[5, 9, 6, 9], completion_logprobs=[-1.0] * 4,
                        finish_reason="length", n_completion_tokens=4, thinking_tokens=3, answer_tokens=1,
                        answer_text="")
                for i, e in enumerate(examples) for j in range(4)]

    def score(self, examples, rollouts, *, step, previous):
        return [Score("r", step, r.sample_id, r.group_id, 0.0, {}, None) for r in rollouts]

    def select(self, fill, rows, options, *, step, empty):
        from rlpipe.rollouts.fates import select_step

        return select_step(fill, rows, options, step=step)


def test_a_source_whose_completions_are_all_cut_fails_naming_the_token_budget():
    from rlpipe.envs.prompts import PromptSource
    from rlpipe.rollouts.config import RLConfig
    from rlpipe.rollouts.group_buffer import BatchFillError, GroupBuffer
    from rlpipe.rollouts.options import rollout_options
    from rlpipe.rollouts.source import RolloutSource

    options = rollout_options(RLConfig(steps=1, prompts_per_step=2, buffer={"max_attempts": 2}))
    examples = [Example("e", str(i), f"q{i}", None) for i in range(20)]
    src = RolloutSource(options, PromptSource(examples, seed=0), GroupBuffer(options.buffer), CutStages(),
                        start_step=0, published_version=0)
    with src, pytest.raises(BatchFillError) as error:
        src.batch(1)
    message = str(error.value)
    sampled = int(error.value.metrics["rollout/fate_zero_variance"])  # every group: all rewards 0
    assert sampled >= 16
    assert message.startswith(f"step 1 could not fill its batch: {sampled} of {sampled} completions were cut "
                              "at rl.sampling.max_new_tokens=16 tokens")
    assert "easier" not in message


def test_the_report_plots_reasoning_and_answer_lengths_of_thinking_runs(tmp_path):
    import pyarrow.parquet as pq
    from rlpipe.dashboards import report
    from rlpipe.storage.writer import write_table

    from tests.synthetic_runs import synthetic_step

    def run(folder, run_id, thinking: bool):
        for step in (1, 2):
            tables = synthetic_step(step, run_id=run_id, n_groups=2, group_size=4, n_token_rows=1, n_examples=4)
            rows = tables["rollouts"].to_pylist()
            for i, row in enumerate(rows):
                think = (3 + step + i % 2) if thinking else 0
                row.update(thinking_tokens=think, answer_tokens=row["n_completion_tokens"] - think)
            for name, data in (tables | {"rollouts": rows}).items():
                write_table(folder, name, step, data, run_id=run_id, durable=False)

    run(tmp_path / "think", "t/rl", thinking=True)
    run(tmp_path / "plain", "p/rl", thinking=False)
    data = report.report_data([tmp_path / "think", tmp_path / "plain"])
    section = next(s for s in data["sections"] if s["id"] == "completions")
    (plot,) = [p for p in section["plots"] if p["id"] == "thinking"]
    solid = [line for line in plot["series"] if line["style"] == "solid"]
    assert [line["run_id"] for line in solid] == ["t/rl"]  # runs without reasoning draw no line
    assert solid[0]["y"] == pytest.approx([4.5, 5.5])
    only_plain = report.report_data([tmp_path / "plain"])
    section = next(s for s in only_plain["sections"] if s["id"] == "completions")
    assert "thinking" not in {p["id"] for p in section["plots"]}
    # a run written before these columns existed still gets its report
    old = tmp_path / "old"
    run(old, "o/rl", thinking=False)
    for path in (old / "tables" / "rollouts").rglob("*.parquet"):
        table = pq.read_table(path)
        pq.write_table(table.drop_columns(["thinking_tokens", "answer_tokens", "answer_text"]).replace_schema_metadata(
            table.schema.metadata), path)
    assert report.query_results([old])["thinking_by_step"] == []
