"""Model rewards: a sequence-classification reward model (a tiny one built here) and an LLM judge
through an engine, batched, composed with the env's reward, recorded as scores components."""

from __future__ import annotations

import pytest
import torch
from rlpipe.engines.base import Completion
from rlpipe.engines.torch_engine import TorchEngine
from rlpipe.envs.arithmetic import ArithmeticConfig, ArithmeticEnv
from rlpipe.envs.base import Example
from rlpipe.envs.config import RewardModelConfig
from rlpipe.envs.reward_models import ClassifierReward, JudgeReward, WithModelRewards, build_scorer
from rlpipe.models.presets import build_model
from rlpipe.models.tokenizer import build_tokenizer
from rlpipe.rollouts.scoring import ScoreOptions, score_rollouts
from rlpipe.tasks.setup import make_env
from transformers import Qwen3Config, Qwen3ForSequenceClassification

from tests.rollout_rows import rollout

EXAMPLES = [Example("arithmetic", f"e{i}", f"{i}+{i}=", 2 * i) for i in range(5)]
COMPLETIONS = ["0", "2", "5", "6", "a much longer wrong answer"]


def _rm_dir(tmp_path, num_labels=1):
    tok = build_tokenizer()
    config = Qwen3Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_labels=num_labels,
                         pad_token_id=tok.pad_token_id, id2label={i: f"l{i}" for i in range(num_labels)},
                         label2id={f"l{i}": i for i in range(num_labels)})
    torch.manual_seed(0)
    Qwen3ForSequenceClassification(config).save_pretrained(tmp_path / "rm")
    tok.save_pretrained(tmp_path / "rm")
    return tmp_path / "rm"


def test_classifier_scores_are_batched_and_equal_single_forwards(tmp_path):
    scorer = ClassifierReward.from_dir(_rm_dir(tmp_path), batch_size=3)
    batched = scorer.score(EXAMPLES, COMPLETIONS)
    texts = scorer.texts(EXAMPLES, COMPLETIONS)
    assert "<|im_start|>assistant\n5<|im_end|>" in texts[2]
    with torch.no_grad():
        single = [float(scorer.model(**scorer.tokenizer(t, return_tensors="pt", add_special_tokens=False)).logits[0, 0])
                  for t in texts]
    assert batched == pytest.approx(single, abs=1e-5)
    assert len(set(round(s, 6) for s in batched)) == 5  # the scores do depend on the text


def test_classifier_label_probability(tmp_path):
    scorer = ClassifierReward.from_dir(_rm_dir(tmp_path, num_labels=2), label="l0")
    p0 = scorer.score(EXAMPLES, COMPLETIONS)
    scorer.label = 1
    p1 = scorer.score(EXAMPLES, COMPLETIONS)
    assert all(0 < a < 1 for a in p0) and [a + b for a, b in zip(p0, p1, strict=True)] == pytest.approx([1.0] * 5)
    scorer.label = "nope"
    with pytest.raises(ValueError, match="no label 'nope'"):
        scorer.score(EXAMPLES, COMPLETIONS)
    with pytest.raises(ValueError, match="has no config.json"):
        ClassifierReward.from_dir(tmp_path)


class ScriptedJudge:
    policy_version = 0

    def __init__(self, replies):
        self.replies, self.calls = replies, []
        self.tok = build_tokenizer()

    def generate(self, prompts, params):
        self.calls.append(prompts)
        ids = [self.tok.encode(self.replies[i % len(self.replies)], add_special_tokens=False) for i in range(len(prompts))]
        return [[Completion(t, [0.0] * len(t), "stop")] for t in ids]


def test_judge_parses_scores_in_one_generate_call():
    tok = build_tokenizer()
    engine = ScriptedJudge(["7", "10 of 10", "no idea", "12", "3.5"])
    judge = JudgeReward(engine, tok)
    assert judge.score(EXAMPLES, COMPLETIONS) == [0.7, 1.0, 0.0, 0.0, 0.35]
    (prompts,) = engine.calls
    assert "assistant: 5" in tok.decode(prompts[2]) and "user: 2+2=" in tok.decode(prompts[2])


def test_judge_through_a_real_engine():
    tok = build_tokenizer()
    model = build_model("tiny-dense", len(tok), seed=0, eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"))
    scores = JudgeReward(TorchEngine(model.eval()), tok, max_new_tokens=4).score(EXAMPLES, COMPLETIONS)
    assert len(scores) == 5 and all(0.0 <= s <= 1.0 for s in scores)


class Counting:
    def __init__(self):
        self.batches = []

    def score(self, examples, transcripts):
        self.batches.append(len(examples))
        return [len(t) / 10 for t in transcripts]


def test_composed_reward_recorded_as_components_in_one_batch():
    env = ArithmeticEnv(ArithmeticConfig(max_digits=1, eval_size=5))
    counting = Counting()
    composed = WithModelRewards(env, {"len": (counting, 0.5)}, env_weight=2.0)
    assert composed.name == "arithmetic" and composed.examples("eval") is env.examples("eval")
    rollouts = [rollout(sample_id=f"s{i}", example_id=e.example_id, completion_text=c)
                for i, (e, c) in enumerate(zip(EXAMPLES, COMPLETIONS, strict=True))]
    rows = score_rollouts(composed, {e.example_id: e for e in EXAMPLES}, rollouts, ScoreOptions(max_error_fraction=0.0))
    assert counting.batches == [5]  # one call for the whole round
    assert rows[1].components == {"format": 1.0, "correct": 1.0, "env": 1.0, "len": 0.1}
    assert rows[1].reward == pytest.approx(2.0 * 1.0 + 0.5 * 0.1)
    assert rows[4].reward == pytest.approx(0.5 * len(COMPLETIONS[4]) / 10)


def test_failing_model_reward_marks_its_rows():
    class Broken:
        def score(self, examples, transcripts):
            raise RuntimeError("out of memory")

    env = WithModelRewards(ArithmeticEnv(ArithmeticConfig(max_digits=1, eval_size=5)), {"rm": (Broken(), 1.0)})
    results = env.reward_batch(EXAMPLES, COMPLETIONS)
    assert all(r.reward == 0.0 and "model reward 'rm' raised" in r.error and "out of memory" in r.error
               for r in results)


def test_reward_models_from_config(tmp_path):
    rm = RewardModelConfig(name="rm", type="classifier", path=str(_rm_dir(tmp_path)), weight=0.25)
    assert isinstance(build_scorer(rm), ClassifierReward)
    env = make_env("arithmetic", {"max_digits": 1, "eval_size": 5}, [rm], env_reward_weight=1.0)
    (result,) = env.reward_batch(EXAMPLES[1:2], ["2"])
    assert set(result.components) == {"format", "correct", "env", "rm"}
    assert result.reward == pytest.approx(1.0 + 0.25 * result.components["rm"])
    with pytest.raises(ValueError, match="judge model: model folder .* does not exist"):
        build_scorer(RewardModelConfig(name="j", type="judge", path=str(tmp_path / "missing")))
