"""SFT then RL with Qwen3's own chat template on a byte-level BPE tokenizer, thinking off and on.

The model folder holds a fresh tiny model and tests/bpe_tokenizer.py's tokenizer (Qwen3's
pre-tokenizer, `<think>` / `</think>` tokens, tests/fixtures/qwen3_chat_template.jinja);
`model.chat_template_kwargs = { enable_thinking = ... }` reaches every rendering. Checked:
- the SFT loss mask and the RL prompts agree token for token: every RL prompt is the context of
  an SFT sequence up to its first weighted token, and nothing the template writes into the
  generation prompt (the empty think block with thinking off) carries loss;
- RL completions carry answers: they stop, the reward sees the text after `</think>`, and some
  are right; the rollouts table tells reasoning and answer tokens apart.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from tests.bpe_tokenizer import build_qwen3_like_tokenizer

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def prefect_api(prefect_in_process):
    """The flows run in this process against the session's Prefect server (conftest.py)."""
    yield


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from rlpipe.models.presets import build_model

    folder = tmp_path_factory.mktemp("qwen3-bpe")
    tok = build_qwen3_like_tokenizer()
    model = build_model("tiny-dense", vocab_size=len(tok), seed=0, pad_token_id=tok.pad_token_id,
                        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"), bos_token_id=None)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def _config(tmp_path: Path, model_dir: Path, thinking: bool) -> dict:
    config = tomllib.loads((ROOT / "configs" / "tiny.toml").read_text())
    config["runs_root"] = str(tmp_path / "runs")
    config["model"].update(path=str(model_dir), chat_template_kwargs={"enable_thinking": thinking})
    config["sft"].update(steps=100, examples=1000)
    # the BPE tokenizer writes a one-digit answer in 1 token and the turn's end in 1 more;
    # with thinking on, the (empty) reasoning block `<think>`, `\n\n`, `</think>`, `\n\n` comes first
    config["rl"].update(steps=2, eval_every=0, checkpoint_every=0, sampling={"max_new_tokens": 12})
    return config


def _weighted_from(weights: list[float]) -> int:
    return next(i for i, w in enumerate(weights) if i >= 1 and w)


@pytest.mark.parametrize("thinking", [False, True], ids=["thinking_off", "thinking_on"])
def test_qwen3_template_sft_then_rl_agree_and_answer(prefect_api, tmp_path, monkeypatch, model_dir, thinking):
    from rlpipe.flows.pipeline import pipeline_flow
    from rlpipe.storage.writer import read_table
    from rlpipe.tasks import supervised_setup

    sft_sequences = []
    real_sft_data = supervised_setup.sft_data

    def recording_sft_data(*args, **kwargs):
        sft_sequences.extend(real_sft_data(*args, **kwargs))
        return sft_sequences

    monkeypatch.setattr(supervised_setup, "sft_data", recording_sft_data)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    result = pipeline_flow(config=_config(tmp_path, model_dir, thinking))

    tok = build_qwen3_like_tokenizer()
    think_start, think_end = tok.convert_tokens_to_ids("<think>"), tok.convert_tokens_to_ids("</think>")
    contexts = {tuple(s.tokens[:_weighted_from(s.weights)]) for s in sft_sequences}
    for seq in sft_sequences[:50]:
        trained = [t for t, w in zip(seq.tokens, seq.weights, strict=True) if w]
        # thinking off: the empty block is the generation prompt's, never loss
        assert (think_start in trained) == thinking and (think_end in trained) == thinking

    rollouts = read_table(Path(result["run_dir"]) / "rl", "rollouts").to_pylist()
    assert rollouts
    for row in rollouts:  # every RL prompt is an SFT context, token for token
        assert tuple(row["prompt_tokens"]) in contexts, tok.decode(row["prompt_tokens"])
        assert row["prompt_text"].endswith("<think>\n\n</think>\n\n" if not thinking else "assistant\n")
        assert row["thinking_tokens"] + row["answer_tokens"] == row["n_completion_tokens"]
        # the answer is what follows the last `</think>` (Qwen3's own parsing)
        answer = row["completion_tokens"][row["thinking_tokens"]:]
        assert row["answer_text"] == tok.decode(answer, skip_special_tokens=True).strip()
        assert think_end not in answer

    stopped = [r for r in rollouts if r["finish_reason"] == "stop"]
    answered = [r for r in stopped if r["answer_text"]]
    print(f"thinking={thinking}: {len(stopped)}/{len(rollouts)} stopped, {len(answered)} with an answer; without:",
          [r["completion_text"] for r in rollouts if not r["answer_text"]][:5])
    assert len(answered) >= 0.9 * len(rollouts)
    if thinking:  # the reasoning block comes first, and the answer after it
        reasoned = [r for r in answered if r["thinking_tokens"] >= 3 and r["completion_text"].startswith("<think>")]
        assert len(reasoned) >= 0.9 * len(answered)
    else:
        assert all(r["thinking_tokens"] == 0 for r in rollouts)
    # the reward judged the answer: right ones score 1, and some are right
    rewards = {r["sample_id"]: r["reward"] for r in read_table(Path(result["run_dir"]) / "rl", "scores").to_pylist()}
    right = [r for r in answered if rewards[r["sample_id"]] >= 1]
    assert right and all(r["answer_text"].isdigit() for r in right)
    first = sft_sequences[0]
    cut = _weighted_from(first.weights)
    print(f"thinking={thinking}: SFT sequence {tok.decode(first.tokens[:cut])!r} + loss on "
          f"{tok.decode([t for t, w in zip(first.tokens, first.weights, strict=True) if w])!r}; RL "
          f"{right[0]['prompt_text']!r} -> {right[0]['completion_text']!r} (answer {right[0]['answer_text']!r}, "
          f"{right[0]['thinking_tokens']} thinking + {right[0]['answer_tokens']} answer tokens); "
          f"{len(stopped)}/{len(rollouts)} stopped, {len(right)} right")


def test_a_budget_that_ends_every_completion_inside_the_block_says_so(prefect_api, tmp_path, monkeypatch, model_dir):
    """A character-tokenizer budget after SFT with thinking on: the completions are cut in (or
    right after) their reasoning block, and the run says that instead of 'make the task easier'."""
    from rlpipe.flows.pipeline import pipeline_flow
    from rlpipe.rollouts.group_buffer import BatchFillError

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    config = _config(tmp_path, model_dir, thinking=True)
    config["rl"]["sampling"] = {"max_new_tokens": 3}
    config["rl"]["buffer"] = {**config["rl"]["buffer"], "max_attempts": 2}
    with pytest.raises(BatchFillError) as error:
        pipeline_flow(config=config)
    message = str(error.value)
    assert "completions were cut at rl.sampling.max_new_tokens=3 tokens" in message, message
    assert "<think> block" in message and "easier" not in message
    print(message)
