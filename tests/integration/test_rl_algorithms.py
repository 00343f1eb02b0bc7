"""The pipeline with LoRA, a non-default loss, a KL penalty and DAPO's overlong penalty: what the
run tables record (entropy, KL, the penalty as a reward component), the canned query reading them,
and the checkpoints' merged weights plus PEFT adapter folders."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.test_flows import prefect_api, tiny_config  # noqa: F401 - fixture

pytestmark = pytest.mark.slow


def test_lora_cispo_with_kl_and_overlong_penalty(prefect_api, tmp_path):  # noqa: F811
    pytest.importorskip("peft")
    from rlpipe.flows.pipeline import pipeline_flow
    from rlpipe.storage.queries import run_canned
    from rlpipe.storage.writer import read_table

    config = tiny_config(tmp_path, tracking__enabled=False, sft__steps=20, rl__steps=2, rl__eval_every=0,
                         rl__checkpoint_every=0, rl__loss__type="cispo", rl__loss__kl_coef=0.05,
                         rl__loss__kl_estimator="k3", rl__scoring__overlong_buffer=2,
                         rl__scoring__overlong_penalty=0.5, model__lora={"rank": 4})
    result = pipeline_flow(config=config)
    rl_dir = Path(result["run_dir"]) / "rl"

    steps = read_table(rl_dir, "train_steps").to_pylist()
    assert [s["step"] for s in steps] == [1, 2]
    for row in steps:
        assert 0 < row["entropy"] < 10  # nats, below log(vocab)
        assert row["kl"] is not None and row["kl"] >= 0  # k3 is non-negative
    assert steps[0]["kl"] < 1e-4  # step 1 trains the reference's own weights

    rollouts = {r["sample_id"]: r for r in read_table(rl_dir, "rollouts").to_pylist()}
    for score in read_table(rl_dir, "scores").to_pylist():
        n = rollouts[score["sample_id"]]["n_completion_tokens"]
        # max_new_tokens 4, buffer 2: 0 up to 2 tokens, then −0.25 per token down to −0.5 at 4
        want = {0: 0.0, 1: 0.0, 2: 0.0, 3: -0.25, 4: -0.5}[n]
        assert dict(score["components"])["overlong_penalty"] == pytest.approx(want)

    query = run_canned([rl_dir], "loss_by_step").to_pylist()
    assert [row["entropy"] for row in query] == [row["entropy"] for row in steps]

    # LoRA in both phases: each checkpoint is merged HF weights plus a PEFT adapter folder
    for phase in ("sft", "rl"):
        checkpoint = Path(result[phase]["checkpoint"])
        assert (checkpoint / "model.safetensors").is_file(), phase
        assert (checkpoint / "adapter" / "adapter_model.safetensors").is_file(), phase
