"""The multi-turn rollout loop: sampled tokens kept exactly, environment tokens weight 0, turns
recorded so SQL answers per-turn questions; the calculator tool environment."""

from __future__ import annotations

import random

import duckdb
import pytest
from rlpipe.engines.base import SamplingParams
from rlpipe.envs.base import Example, StepResult
from rlpipe.envs.calculator import CalculatorConfig, CalculatorEnv, run_tool
from rlpipe.envs.multiturn import (
    env_tokens,
    episode_fields,
    episode_reward,
    model_token_mask,
    run_episodes,
)
from rlpipe.models.chat import template_ids
from rlpipe.models.tokenizer import build_tokenizer
from rlpipe.storage.writer import conform
from rlpipe.tasks.pack import batch_rows, pack_rollouts, rollout_sequence, rollout_sequences

from tests.bpe_tokenizer import build_qwen3_like_tokenizer
from tests.rollout_rows import train_sample
from tests.scripted_engine import ScriptedEngine


def _calc_script(tok, turns_text):
    end = tok.convert_tokens_to_ids("<|im_end|>")
    header = tok.encode("<|im_start|>assistant\n", add_special_tokens=False)

    def play(prompt):
        # the turn index is the number of assistant headers after the first prompt's
        k = sum(prompt[i:i + len(header)] == header for i in range(len(prompt))) - 1
        return [tok.convert_tokens_to_ids(c) for c in turns_text[k]] + [end]

    return play


def test_calculator_episode_keeps_sampled_tokens_and_weights_env_tokens_zero():
    tok = build_tokenizer()
    env = CalculatorEnv(CalculatorConfig(eval_size=10))
    example = Example("calculator", "x", "12*34", 408)
    engine = ScriptedEngine(_calc_script(tok, ["calc 12*34", "ans 408"]), tok.convert_tokens_to_ids("<|im_end|>"))
    params = SamplingParams(n=2, max_new_tokens=16, seed=3)
    (group,) = run_episodes(engine, tok, env, [example], params, max_turns=3, max_tokens=512)
    episode = group[0]
    assert len(group) == 2 and episode.finish_reason == "stop" and episode.n_turns == 2
    # the whole stream is what the template renders for the transcript (our template is stable)
    full = template_ids(tok, episode.messages)
    assert episode.prompt_tokens + episode.completion_tokens == full[: len(episode.context())]
    assert episode.messages[2] == {"role": "tool", "content": "408"}
    spans = [(s.turn, s.producer) for s in episode.turns]
    assert spans == [(0, "model"), (0, "env"), (1, "model")]
    # turn 2 was sampled from prompt + turn 1 + the tool's tokens, n=1 per episode
    (second_prompts, second_params) = engine.calls[1]
    assert second_params.n == 1 and second_prompts[0] == episode.prompt_tokens + episode.completion_tokens[
        : episode.turns[2].start]
    assert engine.calls[0][1].seed != second_params.seed
    # packing trains the sampled tokens only, with the engine's log-probs
    row = episode_fields(episode, tok)
    seq = rollout_sequence(train_sample(2.0, **row))
    n_prompt = len(episode.prompt_tokens)
    trained = [t for t, w in zip(seq.tokens, seq.weights, strict=True) if w]
    assert tok.decode(trained) == "calc 12*34<|im_end|>ans 408<|im_end|>"
    assert sum(seq.loss_mask) == len(trained)
    env_span = episode.turns[1]
    assert tok.decode(seq.tokens[n_prompt + env_span.start: n_prompt + env_span.start + env_span.length]) == (
        "\n<|im_start|>tool\n408<|im_end|>\n<|im_start|>assistant\n")
    assert seq.logprobs[n_prompt + env_span.start] == 0.0 and seq.logprobs[n_prompt] == -0.5
    assert episode_reward(env, row, example).components == {"correct": 1.0, "answered": 1.0, "tool_calls": 1.0}


def test_sampled_tokens_are_never_re_encoded():
    tok = build_qwen3_like_tokenizer()
    end = tok.convert_tokens_to_ids("<|im_end|>")
    # "The answer" spelled byte by byte: decoding then encoding would merge them into fewer tokens
    odd = [tok.convert_tokens_to_ids(c) for c in ["T", "h", "e", "Ġ", "a", "n", "s", "w", "e", "r"]] + [end]
    assert len(tok.encode(tok.decode(odd[:-1]))) < len(odd) - 1

    class Echo:
        name, max_turns = "echo", 2

        def reset(self, example):
            return [{"role": "user", "content": "Hello there"}]

        def step(self, example, messages, text):
            return StepResult([{"role": "user", "content": "again"}], done=False, reward=0.25)

        def reward(self, example, transcript):
            from rlpipe.envs.base import RewardResult
            return RewardResult(1.0, {"correct": 1.0})

    engine = ScriptedEngine(lambda prompt: odd, end)
    (group,) = run_episodes(engine, tok, Echo(), [Example("echo", "0", "", None)],
                            SamplingParams(n=1, max_new_tokens=32), max_turns=2, max_tokens=400)
    (episode,) = group
    model_spans = [s for s in episode.turns if s.producer == "model"]
    for span in model_spans:
        assert episode.completion_tokens[span.start: span.start + span.length] == odd
    assert episode.finish_reason == "max_turns" and episode.n_turns == 2
    # per-turn rewards add to the episode's reward and show as a component
    result = episode_reward(Echo(), episode, episode.example)
    assert result.reward == pytest.approx(1.5) and result.components["turn_rewards"] == pytest.approx(0.5)


def test_env_tokens_follow_a_template_that_rewrites_earlier_turns():
    tok = build_qwen3_like_tokenizer()
    messages = [{"role": "user", "content": "1+1?"},
                {"role": "assistant", "content": "<think>\nadd\n</think>\n\ncalc 1+1"}]
    reply = [{"role": "user", "content": "use the tool"}]  # a new query: Qwen3 drops the <think>
    tokens = env_tokens(tok, messages, reply)
    assert tok.decode(tokens) == "\n<|im_start|>user\nuse the tool<|im_end|>\n<|im_start|>assistant\n"
    tool = env_tokens(tok, messages, [{"role": "tool", "content": "2"}])
    assert tok.decode(tool) == "\n<|im_start|>user\n<tool_response>\n2\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


def test_token_limit_and_length_end_episodes():
    tok = build_tokenizer()
    env = CalculatorEnv(CalculatorConfig(eval_size=10))
    example = Example("calculator", "x", "12*34", 408)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    loop = ScriptedEngine(_calc_script(tok, ["calc 12*34"] * 5), end)
    (group,) = run_episodes(loop, tok, env, [example], SamplingParams(max_new_tokens=16), max_turns=3,
                            max_tokens=512)
    assert group[0].finish_reason == "max_turns" and group[0].n_turns == 3
    assert env.reward(example, group[0].messages).reward == 0.0
    prompt = len(template_ids(tok, env.reset(example), add_generation_prompt=True))
    (group,) = run_episodes(loop, tok, env, [example], SamplingParams(max_new_tokens=16), max_turns=3,
                            max_tokens=prompt + 20)
    assert group[0].finish_reason == "length" and len(group[0].context()) <= prompt + 20
    long = ScriptedEngine(lambda p: [tok.convert_tokens_to_ids("1")] * 40, end)
    (group,) = run_episodes(long, tok, env, [example], SamplingParams(max_new_tokens=8), max_turns=3,
                            max_tokens=512)
    assert group[0].finish_reason == "length" and group[0].n_turns == 1 and len(group[0].completion_tokens) == 8


def test_turns_column_answers_per_turn_questions():
    tok = build_tokenizer()
    env = CalculatorEnv(CalculatorConfig(eval_size=10))
    examples = [Example("calculator", str(i), f"1{i}*2", (10 + i) * 2) for i in range(3)]
    engine = ScriptedEngine(_calc_script(tok, ["calc 11*2", "ans 22"]), tok.convert_tokens_to_ids("<|im_end|>"))
    groups = run_episodes(engine, tok, env, examples, SamplingParams(n=2), max_turns=3, max_tokens=512)
    rows = [{"run_id": "r", "step": 1, "policy_version": 0, "env": "calculator", "example_id": e.example.example_id,
             "group_id": "g", "sample_id": f"{e.example.example_id}/{j}", "attempt": 1, **episode_fields(e, tok)}
            for group in groups for j, e in enumerate(group)]
    rollouts = conform("rollouts", rows, run_id="r", step=1)  # noqa: F841 - scanned by DuckDB below
    per_turn = duckdb.sql("select t.turn, t.producer, sum(t.length) n from "
                          "(select unnest(turns) t from rollouts) group by all order by all").fetchall()
    model_tokens = len("calc 11*2") + 1
    assert per_turn[0] == (0, "env", 6 * len(env_tokens(tok, groups[0][0].messages[:2], groups[0][0].messages[2:3])))
    assert per_turn[1] == (0, "model", 6 * model_tokens)
    assert per_turn[2] == (1, "model", 6 * (len("ans 22") + 1))
    assert model_token_mask(rows[0]["turns"], rows[0]["n_completion_tokens"]).count(True) == model_tokens + 7


def test_calculator_env_tool_and_teacher():
    env = CalculatorEnv(CalculatorConfig(eval_size=50, teacher_tool_rate=0.5))
    assert run_tool(" 12*34") == "408" and run_tool("__import__('os')") == "error" and run_tool("1/0") == "error"
    train, evals = env.examples("train", seed=0), env.examples("eval")
    assert len(evals) == 50 and not {e.prompt for e in evals} & {train[i].prompt for i in range(500)}
    rng = random.Random(0)
    demos = [env.demonstration_messages(train[i], rng) for i in range(200)]
    with_tool = [d for d in demos if len(d) == 4]
    assert 70 < len(with_tool) < 130
    assert all(env.reward(train[i], d).reward == 1.0 for i, d in enumerate(demos))
    step = env.step(train[0], demos[0], "calc 2*3")
    assert step == StepResult([{"role": "tool", "content": "6"}], done=False)
    assert env.step(train[0], demos[0], "ans 6").done


class Feedback:
    """Answers every assistant turn with a new user query (Qwen3 then drops earlier thinking)."""

    name, max_turns = "feedback", 2

    def reset(self, example):
        return [{"role": "user", "content": "What is 12+30?"}]

    def step(self, example, messages, text):
        return StepResult([{"role": "user", "content": "Hello there"}], done=False)

    def reward(self, example, transcript):
        from rlpipe.envs.base import RewardResult
        return RewardResult(1.0)


def _thinking_engine(tok):
    end = tok.convert_tokens_to_ids("<|im_end|>")
    first = tok.encode("<think>\nadd\n</think>\n\n42", add_special_tokens=False) + [end]
    second = tok.encode("<think>\nagain\n</think>\n\nhi", add_special_tokens=False) + [end]
    seen = []

    def play(prompt):
        seen.append(list(prompt))
        return first if len(seen) == 1 else second

    return ScriptedEngine(play, end), seen, first, second


def test_template_context_trains_each_turn_in_the_context_the_template_renders():
    tok = build_qwen3_like_tokenizer()
    engine, seen, first, second = _thinking_engine(tok)
    (group,) = run_episodes(engine, tok, Feedback(), [Example("feedback", "0", "", None)],
                            SamplingParams(max_new_tokens=32), max_turns=2, max_tokens=400, context="template")
    (episode,) = group
    assert [s.producer for s in episode.turns] == ["model", "context", "model"]
    # turn 2 was sampled after the template's rendering, where turn 1 lost its thinking
    rendered = template_ids(tok, episode.messages[:3], add_generation_prompt=True)
    assert seen[1] == rendered and "add" not in tok.decode(rendered)
    row = episode_fields(episode, tok)
    sample = train_sample(1.0, **row)
    one, two = rollout_sequences(sample)
    assert one.tokens == episode.prompt_tokens + first and two.tokens == rendered + second
    assert [t for t, w in zip(one.tokens, one.weights, strict=True) if w] == first
    assert [t for t, w in zip(two.tokens, two.weights, strict=True) if w] == second
    assert (one.sample_id, two.sample_id, two.prefix_len) == ("s", "s#1", len(rendered))
    with pytest.raises(ValueError, match="2 segments"):
        rollout_sequence(sample)
    rows = batch_rows(pack_rollouts([sample], token_budget=400), run_id="r", step=1)
    assert sorted(rows[0]["sample_ids"]) == ["s", "s#1"]
    # the token-append context keeps turn 1's thinking in turn 2's context, in one sequence
    engine, seen, _, _ = _thinking_engine(tok)
    (group,) = run_episodes(engine, tok, Feedback(), [Example("feedback", "0", "", None)],
                            SamplingParams(max_new_tokens=32), max_turns=2, max_tokens=400)
    assert "add" in tok.decode(seen[1]) and len(rollout_sequences(train_sample(1.0, **episode_fields(group[0], tok)))) == 1


def test_template_context_equals_token_context_on_a_stable_template():
    tok = build_tokenizer()
    env = CalculatorEnv(CalculatorConfig(eval_size=10))
    example = Example("calculator", "x", "12*34", 408)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    episodes = [run_episodes(ScriptedEngine(_calc_script(tok, ["calc 12*34", "ans 408"]), end), tok, env,
                             [example], SamplingParams(), max_turns=3, max_tokens=512, context=c)[0][0]
                for c in ("tokens", "template")]
    assert episodes[0].completion_tokens == episodes[1].completion_tokens
    assert [vars(s) for s in episodes[0].turns] == [vars(s) for s in episodes[1].turns]


def test_generate_stage_spreads_episodes_over_engines():
    from rlpipe.rollouts.generation import GenerateOptions, SampleRound, generate_rollouts

    tok = build_tokenizer()
    env = CalculatorEnv(CalculatorConfig(eval_size=10))
    end = tok.convert_tokens_to_ids("<|im_end|>")
    engines = [ScriptedEngine(_calc_script(tok, ["calc 12*34", "ans 408"]), end) for _ in range(2)]
    examples = [Example("calculator", str(i), "12*34", 408) for i in range(4)]
    rows = generate_rollouts(engines, tok, env, examples, GenerateOptions(SamplingParams(n=2), max_context=512),
                             SampleRound(run_id="r", step=1, attempt=1, policy_version=0))
    assert len(rows) == 8 and all(len(e.calls) == 2 for e in engines)  # two turns each, two examples each
    assert [r.example_id for r in rows] == ["0", "0", "1", "1", "2", "2", "3", "3"]
    assert {r.n_turns for r in rows} == {2} and len({r.sample_id for r in rows}) == 8


def test_turns_by_step_canned_query(tmp_path):
    from rlpipe.storage.queries import run_canned
    from rlpipe.storage.writer import write_table

    tok = build_tokenizer()
    env = CalculatorEnv(CalculatorConfig(eval_size=10))
    end = tok.convert_tokens_to_ids("<|im_end|>")
    # example "0" answers directly (one turn, wrong); the others call the tool first (two turns, right)
    script = {"0*2": ["ans 5"], "1*2": ["calc 1*2", "ans 2"], "2*2": ["calc 2*2", "ans 4"]}

    def play(prompt):
        text = tok.decode(prompt)
        key = next(k for k in script if k + "<|im_end|>" in text)
        turn = text.count("<|im_start|>assistant") - 1
        return [tok.convert_tokens_to_ids(c) for c in script[key][turn]] + [end]

    examples = [Example("calculator", str(i), f"{i}*2", 2 * i) for i in range(3)]
    groups = run_episodes(ScriptedEngine(play, end), tok, env, examples, SamplingParams(), max_turns=3,
                          max_tokens=512)
    rows = [{"run_id": "r", "step": 1, "policy_version": 0, "env": "calculator", "example_id": e.example.example_id,
             "group_id": "g", "sample_id": f"s{i}", "attempt": 1, **episode_fields(e, tok)}
            for i, (e,) in enumerate(groups)]
    scores = [{"run_id": "r", "step": 1, "sample_id": f"s{i}", "group_id": "g",
               "reward": episode_reward(env, e, e.example).reward} for i, (e,) in enumerate(groups)]
    write_table(tmp_path, "rollouts", 1, rows, run_id="r")
    write_table(tmp_path, "scores", 1, scores, run_id="r")
    got = run_canned([tmp_path], "turns_by_step").to_pylist()
    assert [(r["turn"], r["episodes"], r["model_tokens"], r["reward_mean"]) for r in got] == [
        (0, 3, len("ans 5") + 2 * len("calc 1*2") + 3, pytest.approx(2 / 3)),
        (1, 2, 2 * len("ans 2") + 2, pytest.approx(1.0)),
    ]
    assert got[0]["env_tokens"] == sum(s.length for (e,) in groups for s in e.turns if s.producer == "env")
