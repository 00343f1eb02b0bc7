"""The report's fate chart and rollout browser (dashboards.report_rollouts) on tiny synthetic
runs: fates stood in from groups or read from recorded decisions, the browser's compact encodings."""

from __future__ import annotations

import collections
import itertools

import pyarrow.parquet as pq
import pytest
from rlpipe.dashboards import report, report_rollouts
from rlpipe.storage.catalog import connect
from rlpipe.storage.queries import canned_sql, run_sql
from rlpipe.storage.writer import write_table

from tests.report_runs import (
    EPISODE,
    NASTY,
    RL_STEPS,
    SFT_STEPS,
    embedded_data,
    write_fated_run,
    write_run,
)
from tests.synthetic_runs import synthetic_step


@pytest.fixture(scope="module")
def sft(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("report") / "sft"
    write_run(run_dir, "demo/sft", SFT_STEPS, rl=False, seed=1)
    return run_dir


def decode_browser(section):
    """The browser's columnar data back into one dict per completion (what report_rollouts.js does)."""
    groups, rows = section["groups"], section["rows"]

    def nums(text):
        return [None if v == "" else float(v) for v in text.split(",")]

    def affix(enc):
        return [None if v is None else enc["prefix"] + v + enc["suffix"] for v in enc["values"]]

    def col(enc):
        return [enc["values"][k] for k in enc["index"]]

    g = list(itertools.accumulate(int(d) for d in nums(rows["g"])))
    group_id, step, version = affix(groups["group_id"]), nums(groups["step"]), nums(groups["policy_version"])
    prompts = affix(groups["prompt"]["values"])
    status, reason, finish = col(rows["status"]), col(rows["reason"]), col(rows["finish"])
    reward, advantage, tokens, trained = (nums(rows[c]) for c in ("reward", "advantage", "tokens", "trained_step"))
    out = []
    for i in range(section["n"]):
        sid = rows["sid"][i] if i in section["full_ids"] else group_id[g[i]] + rows["sid"][i]
        out.append({"sample_id": sid, "group_id": group_id[g[i]], "step": step[g[i]], "policy_version": version[g[i]],
                    "run_id": col(groups["run_id"])[g[i]], "env": col(groups["env"])[g[i]],
                    "example_id": affix(groups["example_id"])[g[i]], "status": status[i], "reason": reason[i],
                    "trained_step": trained[i], "reward": reward[i], "advantage": advantage[i], "tokens": tokens[i],
                    "finish_reason": finish[i], "prompt_text": prompts[groups["prompt"]["index"][g[i]]],
                    "completion_text": rows["completion"][i]})
    return out


@pytest.fixture(scope="module")
def fated(tmp_path_factory):
    """An RL run with every kind of group decision, a reward error, a multi-turn episode and a long completion."""
    run_dir = tmp_path_factory.mktemp("fated") / "rl"
    write_run(run_dir, "fated/rl", RL_STEPS, rl=True)
    rollouts = synthetic_step(2, run_id="fated/rl", n_groups=5, group_size=4, n_token_rows=2,
                              n_examples=6, zero_variance_share=0.4)["rollouts"].to_pylist()
    rollouts[0]["completion_text"] = NASTY
    rollouts[1] |= EPISODE
    rollouts[2]["completion_text"] = "y" * 9000
    write_table(run_dir, "rollouts", 2, rollouts, run_id="fated/rl", durable=False)
    # step 3: a group carried (then trained at step 4... never: the run ends) and one stale
    groups = pq.read_table(run_dir / "tables/groups/step=3/part-0.parquet").to_pylist()
    groups[0]["status"], groups[0]["kept"] = "carried", False
    groups[1]["status"], groups[1]["kept"] = "stale", False
    write_table(run_dir, "groups", 3, groups, run_id="fated/rl", durable=False)
    scores = pq.read_table(run_dir / "tables/scores/step=1/part-0.parquet").to_pylist()
    scores[5]["error"] = "ZeroDivisionError: division by zero"
    write_table(run_dir, "scores", 1, scores, run_id="fated/rl", durable=False)
    for step in RL_STEPS:  # reward - group mean for the trained groups' completions, as a grpo stage would
        advantages = run_sql([run_dir], f"""select s.sample_id, s.group_id, s.reward - g.reward_mean as advantage
            from scores s join groups g using (run_id, group_id) where g.step = {step} and g.status = 'trained' and s.error is null""")
        write_table(run_dir, "advantages", step, advantages.to_pylist(), run_id="fated/rl", durable=False)
    return run_dir


def _fates(run_dir):
    con = connect([run_dir])
    report_rollouts.ensure_fates(con)
    return con.sql("select * from fates").to_arrow_table().to_pylist()


def test_fates_stand_in_from_groups_gives_every_rollout_one_status(fated):
    fates = _fates(fated)
    rollouts = run_sql([fated], "select sample_id, group_id, step from rollouts").to_pylist()
    assert sorted(f["sample_id"] for f in fates) == sorted(r["sample_id"] for r in rollouts)
    scores = {r["sample_id"]: r for r in run_sql([fated], "select * from scores").to_pylist()}
    groups = {(r["group_id"]): r for r in run_sql([fated], "select * from groups").to_pylist()}
    for fate in fates:
        score, group = scores[fate["sample_id"]], groups[fate["group_id"]]
        expected = "reward_error" if score["error"] else group["status"]
        assert fate["status"] == expected, fate
        assert fate["trained_step"] == (group["step"] if expected == "trained" else None)
        assert fate["reward"] == (None if score["error"] else pytest.approx(score["reward"]))
        assert fate["reason"]
    assert {"carried", "stale", "zero_variance", "trained", "reward_error"} <= {f["status"] for f in fates}


def test_fates_by_step_counts_the_fates_rows(fated):
    con = connect([fated])
    report_rollouts.ensure_fates(con)
    by_step = con.sql(canned_sql("fates_by_step")).to_arrow_table().to_pylist()
    counted = collections.Counter((f["step"], f["status"]) for f in _fates(fated))
    assert {(r["step"], r["status"]): r["n"] for r in by_step} == counted

    data = report.report_data([fated])
    (run,) = data["fates"]["runs"]
    assert run["steps"] == list(RL_STEPS)
    assert run["totals"] == dict(collections.Counter(status for _, status in counted.elements()))
    assert run["total"] == len(_fates(fated)) == sum(sum(v) for v in run["counts"].values())
    for status, values in run["counts"].items():
        assert values == [counted[(step, status)] for step in RL_STEPS]
    names = [s["name"] for s in data["fates"]["statuses"]]
    assert names == [name for name, _ in report_rollouts.FATES if name in run["totals"]]  # stacking order
    assert data["fates"]["notes"] == [report_rollouts.STAND_IN_NOTE]


def test_browser_data_decodes_to_the_rollout_browser_rows(fated):
    data = report.report_data([fated])
    section = data["rollouts"]
    con = connect([fated])
    report_rollouts.ensure_fates(con)
    expected = con.sql(canned_sql("rollout_browser")).to_arrow_table().to_pylist()
    got = decode_browser(section)
    assert section["n"] == section["n_all"] == len(expected) == len(got)
    assert section["text_limit"] == report_rollouts.MAX_TEXT  # a small run: nothing needs cutting but the 9000
    for row, want in zip(got, expected, strict=True):
        for key in ("sample_id", "group_id", "run_id", "env", "example_id", "status", "reason", "finish_reason"):
            assert row[key] == want[key], key
        for key in ("step", "policy_version", "trained_step", "reward", "advantage"):
            assert row[key] == (None if want[key] is None else pytest.approx(want[key], rel=1e-4)), key
        assert row["tokens"] == want["n_completion_tokens"]
        assert row["prompt_text"] == want["prompt_text"]
        assert row["completion_text"] == report_rollouts.cut(want["completion_text"], section["text_limit"])
    assert NASTY in [row["completion_text"] for row in got]
    long = next(row["completion_text"] for row in got if row["completion_text"].startswith("yyy"))
    assert long == "y" * report_rollouts.MAX_TEXT + " … [5,000 more characters]"
    assert any("cut here" in note for note in section["notes"])
    trained = [row for row in got if row["status"] == "trained"]
    assert trained and all(row["advantage"] is not None for row in trained)
    assert all(row["advantage"] is None for row in got if row["status"] != "trained")


def test_multi_turn_episode_is_inlined_as_a_transcript(fated):
    section = report.report_data([fated])["rollouts"]
    ((index, episode),) = section["episodes"].items()
    row = decode_browser(section)[int(index)]
    assert row["completion_text"] == EPISODE["completion_text"]
    assert episode["n_turns"] == 2
    assert episode["messages"] == [["user", "51*92"], ["assistant", "calc 51*92"], ["tool", "4692"], ["assistant", "ans 4692"]]
    assert episode["spans"] == [[0, "model", 11, None], [0, "env", 24, 0.5], [1, "model", 9, None]]


def test_sft_run_has_no_fates_and_an_empty_browser(sft):
    data = report.report_data([sft])
    assert data["fates"]["runs"] == [] and "'rollouts'" in data["fates"]["notes"][0]
    assert data["rollouts"]["n"] == 0 and report_rollouts.STAND_IN_NOTE not in data["fates"]["notes"]


def test_browser_caps_rows_by_whole_steps_and_texts_by_a_budget():
    rows = [{"step": step, "i": i} for step in range(1, 11) for i in range(step)]  # step k has k rows
    kept, dropped = report_rollouts.cap_rows(rows, 30)
    steps = sorted({row["step"] for row in kept})
    assert len(kept) <= 30 and dropped == (len(steps), 10) and steps[0] == 1 and steps[-1] == 10
    assert all(sum(row["step"] == step for row in kept) == step for step in steps)  # whole steps
    assert report_rollouts.cap_rows(rows, 55) == (rows, None)

    assert report_rollouts.text_limit([10, 20, 30], 1000, low=1, high=100) == 100  # all fit: the ceiling
    assert report_rollouts.text_limit([10, 20, 500, 800], 300, low=1, high=10_000) == 135  # 10 + 20 + 2 * 135
    assert report_rollouts.text_limit([10**6] * 100, 1000) == report_rollouts.MIN_TEXT  # never below the floor
    assert report_rollouts.cut("abcdef", 4) == "abcd … [2 more characters]" and report_rollouts.cut("ab", 4) == "ab"


def test_compact_encodings_round_trip():
    values = ["<s>user 1+2</s>", "<s>user 30+4</s>", None, "<s>user 5+6</s>"]
    enc = report_rollouts.affix_encode(values)
    assert (enc["prefix"], enc["suffix"]) == ("<s>user ", "</s>")
    assert [None if v is None else enc["prefix"] + v + enc["suffix"] for v in enc["values"]] == values
    assert report_rollouts.affix_encode(["aa", "aa"])["values"] == ["", ""]  # the whole text as prefix
    enc = report_rollouts.dict_encode(["b", "a", "b", None])
    assert enc == {"values": ["b", "a", None], "index": [0, 1, 0, 2]}
    assert report_rollouts.numbers([1, None, 0.5, None]) == "1,,0.5,"
    assert report_rollouts.status_order(["zzz", "stale", "trained"]) == ["trained", "stale", "zzz"]


def test_report_of_a_demo_sized_run_stays_small(tmp_path):
    """~20k completions with chat-template prompts: the inlined browser costs well under 100 bytes each."""
    run_id = "demo/rl"
    for step in range(1, 41):
        tables = synthetic_step(step, run_id=run_id, n_groups=60, group_size=8, n_token_rows=0, n_examples=5000)
        rows = tables["rollouts"].to_pylist()
        for row in rows:
            row["prompt_text"] = f"<|im_start|>user\n{row['example_id']}+{step}=<|im_end|>\n<|im_start|>assistant\n"
        for name, table in (("rollouts", rows), ("scores", tables["scores"]), ("groups", tables["groups"])):
            write_table(tmp_path, name, step, table, run_id=run_id, durable=False)
    out = report.write_report([tmp_path])
    size = out.stat().st_size
    n = 40 * 60 * 8
    assert embedded_data(out.read_text())["rollouts"]["n"] == n
    assert size < 60 * n, f"{size:,} bytes for {n:,} completions"


@pytest.fixture(scope="module")
def decided(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("decided") / "rl"
    write_fated_run(run_dir, "decided/rl")
    return run_dir


def test_report_reads_the_recorded_fates(decided):
    data = report.report_data([decided])
    view = run_sql([decided], "select step, coalesce(status, 'pending') as status, count(*) as n from fates "
                              "group by all").to_pylist()
    (run,) = data["fates"]["runs"]
    assert data["fates"]["notes"] == [] and report_rollouts.STAND_IN_NOTE not in data["rollouts"]["notes"]
    counted = collections.Counter()
    for row in view:
        counted[row["status"]] += row["n"]
        assert run["counts"][row["status"]][run["steps"].index(row["step"])] == row["n"]
    assert run["totals"] == dict(counted)
    assert set(counted) == {"trained", "zero_variance", "reward_error", "stale", "truncated", "pending"}
    assert run["total"] == run_sql([decided], "select count(*) as n from rollouts").to_pylist()[0]["n"]

    got = {row["sample_id"]: row for row in decode_browser(data["rollouts"])}
    fates = run_sql([decided], "select * from fates").to_pylist()
    assert len(got) == len(fates)
    for fate in fates:
        row = got[fate["sample_id"]]
        assert (row["status"], row["reason"]) == (fate["status"] or "pending", fate["reason"])
        assert row["trained_step"] == fate["trained_step"]
    carried_then_trained = [row for row in got.values() if row["status"] == "trained" and row["trained_step"] == row["step"] + 1]
    assert carried_then_trained and all(row["advantage"] is not None for row in carried_then_trained)
    error = next(row for row in got.values() if row["status"] == "reward_error")
    assert error["reward"] is None and error["reason"] == "reward function raised: ZeroDivisionError: division by zero"
