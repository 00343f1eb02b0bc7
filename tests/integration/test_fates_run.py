"""Every sampled completion's fate, and the tokens view, after a tiny RL run that exercises most
fates: carried surplus (over-sampling x2), zero-variance groups, a reward function that raises for
some samples, truncation at max_new_tokens with rl.filter.drop_truncated, a user filter. One `fates` row
per `rollouts` row, and the logged rollout/fate_* counters equal the counts of those rows."""

from __future__ import annotations

import zlib

import pytest

from tests.integration.test_rl_loop_regression import config_dict, sft_checkpoint  # noqa: F401 - fixture

pytestmark = pytest.mark.slow


def flaky_score(original):
    """The arithmetic reward, raising for about one completion in five (deterministically)."""
    def score(self, example, completion_text):
        if zlib.crc32(f"{example.example_id}|{completion_text}".encode()) % 5 == 0:
            raise ValueError(f"flaky reward on {completion_text!r}")
        return original(self, example, completion_text)
    return score


def no_nines(rollout, score):
    """The run's user filter (rl.filter.sample_filter): completions with a 9 in them are dropped."""
    return "9" not in rollout.completion_text or "has a 9"


def test_every_rollout_has_one_fate_and_the_counters_match(sft_checkpoint, tmp_path, monkeypatch):  # noqa: F811
    import rlpipe.flows.rl
    from rlpipe.envs.arithmetic import ArithmeticEnv
    from rlpipe.storage.catalog import connect
    from rlpipe.storage.tracking import NullTracker
    from rlpipe.tasks.config import validate_config

    tracker = NullTracker()
    monkeypatch.setattr(rlpipe.flows.rl, "make_tracker", lambda *args, **kwargs: tracker)
    monkeypatch.setattr(ArithmeticEnv, "score", flaky_score(ArithmeticEnv.score))
    config = validate_config(config_dict(tmp_path, "fates", {
        "steps": 4, "scoring": {"max_reward_error_fraction": 1.0}, "buffer": {"max_attempts": 20},
        "sampling": {"max_new_tokens": 2},
        "filter": {"drop_truncated": True, "sample_filter": "tests.integration.test_fates_run:no_nines"}}))
    rlpipe.flows.rl.run_rl(config, start_checkpoint=sft_checkpoint)
    con = connect(config.run_dir / "rl")

    def one(sql: str):
        return con.sql(sql).fetchall()[0][0]

    assert one("select count(*) from rollouts") == one("select count(*) from fates") > 0
    assert one("select count(*) - count(distinct sample_id) from fates") == 0
    assert one("select count(*) from fates where status is null or reason is null") == 0
    counts = dict(con.sql("select status, count(*) from fates group by 1").fetchall())
    for status in ("trained", "carried", "zero_variance", "reward_error", "truncated", "filtered"):
        assert counts.get(status, 0) > 0, (status, counts)
    # trained fates are exactly the advantages rows, at their step
    assert one("""select count(*) from fates f full join advantages a using (run_id, sample_id)
                  where (f.status = 'trained' or a.step is not null) and f.trained_step is distinct from a.step""") == 0
    assert one("select count(*) from fates where status = 'reward_error' and reward is not null") == 0
    assert one("""select count(*) from fates f join scores s using (run_id, sample_id)
                  where (s.error is not null) <> (f.status = 'reward_error')""") == 0

    # the tokens view: every completion token of every trained sample, once, as the rollout has it
    assert one("select count(*) from tokens") == one(
        "select sum(n_completion_tokens) from fates where status = 'trained'") > 0
    assert one("select count(*) - count(distinct (sample_id, position)) from tokens") == 0
    assert one("""select count(*) from tokens t join rollouts r using (run_id, sample_id) join fates f using (sample_id)
                  where t.step <> f.trained_step or t.token_id <> r.completion_tokens[t.position + 1]
                     or t.generator_logprob <> r.completion_logprobs[t.position + 1]
                     or t.weight <> t.advantage or t.trainer_logprob is null or t.trainer_logprob > 0""") == 0

    logged = [metrics for step, metrics in tracker.metrics if step >= 1 and "rollout/fate_trained" in metrics]
    assert len(logged) == 4
    for status in ("trained", "zero_variance", "stale", "reward_error", "truncated", "filtered", "over_cap"):
        assert sum(m[f"rollout/fate_{status}"] for m in logged) == counts.get(status, 0), status
    assert logged[-1]["rollout/fate_carried"] == counts["carried"]
    assert sum(m["rollout/reward_errors"] for m in logged) == counts["reward_error"]
