"""The run report's data assembly (dashboards.report) on tiny synthetic runs, and `rlpipe report`."""

from __future__ import annotations

import collections
import itertools
import json
import math
import re
import statistics

import pyarrow.parquet as pq
import pytest

from dashboards import report, report_rollouts
from flows.cli import main as rlpipe
from storage.catalog import connect
from storage.queries import canned_queries, canned_sql, run_canned, run_sql
from storage.synthetic import synthetic_step
from storage.writer import write_table
from tests.report_runs import write_fated_run

RL_STEPS = (0, 1, 2, 3)
SFT_STEPS = (0, 1, 2)
NASTY = 'ends a script early? </script><script>document.title="pwned"</script> <!-- ünïcode'


def write_run(run_dir, run_id, steps, *, rl, seed=0):
    """A tiny run: RL runs get rollouts, scores and groups (storage.synthetic); both get train_steps, evals."""
    for step in steps:
        if rl:
            tables = synthetic_step(step, run_id=run_id, n_groups=5, group_size=4, n_token_rows=2, seed=seed,
                                    n_examples=6, zero_variance_share=0.4)
            rollouts = tables["rollouts"].to_pylist()
            rollouts[0]["completion_text"] = NASTY
            tables["rollouts"] = rollouts
            for name, data in tables.items():
                write_table(run_dir, name, step, data, run_id=run_id, durable=False)
        write_table(run_dir, "train_steps", step, [dict(
            mode="rl" if rl else "sft", loss=1.0 / (step + 1) + seed, grad_norm=0.5 + step, lr=1e-3 * (step + 1),
            tokens=100, tokens_per_second=200.0 + step, seconds_generate=1.5 if rl else None,
            seconds_train=2.0, seconds_total=4.0)], run_id=run_id, durable=False)
        write_table(run_dir, "evals", step, [dict(env=env, example_id=str(i), reward=float(i % 2),
                                                   correct=(i + step) % 3 == 0)
                                              for env in ("arithmetic", "countdown") for i in range(6)],
                    run_id=run_id, durable=False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("report")
    write_run(root / "rl", "demo/rl", RL_STEPS, rl=True)
    write_run(root / "sft", "demo/sft", SFT_STEPS, rl=False, seed=1)
    return root / "rl", root / "sft"


def _plots(data, section_id):
    section = next(section for section in data["sections"] if section["id"] == section_id)
    return section, {item["id"]: item for item in section["plots"]}


def _solid(item):
    return {line["run_id"]: line for line in item["series"] if line["style"] == "solid"}


def test_every_query_behind_the_report_is_a_canned_query():
    assert set(report.QUERIES) <= set(canned_queries())


def test_completion_length_by_step_query(runs):
    rl, _ = runs
    got = run_canned([rl], "completion_length_by_step").to_pylist()
    rollouts = [row for step in RL_STEPS
                for row in synthetic_step(step, run_id="demo/rl", n_groups=5, group_size=4, n_token_rows=2,
                                          n_examples=6, zero_variance_share=0.4)["rollouts"].to_pylist()]
    assert [row["step"] for row in got] == list(RL_STEPS)
    for row in got:
        lengths = [r["n_completion_tokens"] for r in rollouts if r["step"] == row["step"]]
        deciles = statistics.quantiles(lengths, n=10, method="inclusive")
        quartiles = statistics.quantiles(lengths, n=4, method="inclusive")
        assert row["n"] == len(lengths)
        assert row["tokens_mean"] == pytest.approx(statistics.fmean(lengths))
        assert (row["tokens_min"], row["tokens_max"]) == (min(lengths), max(lengths))
        assert row["tokens_p10"] == pytest.approx(deciles[0]) and row["tokens_p90"] == pytest.approx(deciles[-1])
        assert [row["tokens_p25"], row["tokens_p50"], row["tokens_p75"]] == pytest.approx(quartiles)
        truncated = [r["finish_reason"] == "length" for r in rollouts if r["step"] == row["step"]]
        assert row["truncated_fraction"] == pytest.approx(sum(truncated) / len(truncated))


def test_rl_run_plots_are_the_canned_query_results(runs):
    rl, _ = runs
    data = report.report_data([rl])
    assert [run["run_id"] for run in data["runs"]] == ["demo/rl"]
    assert all(not section["notes"] for section in data["sections"])

    _, reward = _plots(data, "reward")
    rows = run_canned([rl], "reward_by_step").to_pylist()
    line = _solid(reward["reward"])["demo/rl"]
    assert line["x"] == list(RL_STEPS)
    assert line["y"] == pytest.approx([row["reward_mean"] for row in rows], rel=1e-5)
    band = line["bands"][0]
    assert band["lo"] == pytest.approx([row["reward_mean"] - row["reward_std"] for row in rows], rel=1e-4, abs=1e-6)
    assert band["hi"] == pytest.approx([row["reward_mean"] + row["reward_std"] for row in rows], rel=1e-4)
    dotted = [line["y"] for line in reward["reward"]["series"] if line["style"] == "dotted"]
    assert dotted == [[row["reward_min"] for row in rows], [row["reward_max"] for row in rows]]

    _, groups = _plots(data, "groups")
    zero = run_canned([rl], "zero_variance_by_step").to_pylist()
    assert _solid(groups["zero_variance"])["demo/rl"]["y"] == pytest.approx([r["zero_variance_fraction"] for r in zero], rel=1e-5)
    assert _solid(groups["attempts"])["demo/rl"]["y"] == [r["attempts_total"] for r in zero]

    _, completions = _plots(data, "completions")
    assert {"completion_length", "truncated", "length_reward_corr"} <= set(completions)
    assert len(_solid(completions["completion_length"])["demo/rl"]["bands"]) == 2

    _, optim = _plots(data, "optim")
    assert _solid(optim["loss"])["demo/rl"]["y"] == pytest.approx([1.0 / (s + 1) for s in RL_STEPS], rel=1e-5)
    assert "clip_fraction" not in optim  # RL-only metric never logged here: left out silently

    _, time = _plots(data, "time")
    assert {"train_tps", "generate_tps", "seconds_total", "seconds_generate", "seconds_train"} <= set(time)
    assert "seconds_sync" not in time  # a phase that never ran

    _, evals = _plots(data, "eval")
    assert set(evals) == {"eval_all", "eval_arithmetic", "eval_countdown"}
    pooled = _solid(evals["eval_all"])["demo/rl"]["y"]
    assert pooled == pytest.approx([sum((i + s) % 3 == 0 for i in range(6)) / 6 for s in RL_STEPS], rel=1e-5)

    samples = data["samples"]["rows"]
    assert [(row["step"], row["kind"]) for row in samples] == [(s, k) for s in RL_STEPS for k in ("best", "worst")]
    assert all(row["reward"] == row["components"]["correct"] for row in samples)  # synthetic: reward = correct
    assert set(samples[0]["components"]) == {"correct", "format"}
    hardest = data["hardest"]["rows"]
    assert hardest and [row["rank"] for row in hardest] == list(range(1, len(hardest) + 1))

    (overview,) = data["overview"]
    assert (overview["steps"], overview["last_step"], overview["modes"]) == (len(RL_STEPS), RL_STEPS[-1], "rl")


def test_sft_only_run_leaves_rollout_plots_out_with_a_note(runs):
    _, sft = runs
    data = report.report_data([sft])
    for section_id, table in (("reward", "scores"), ("groups", "groups"), ("completions", "rollouts")):
        section, plots = _plots(data, section_id)
        assert plots == {}
        assert len(section["notes"]) == 1 and f"'{table}'" in section["notes"][0]
    assert data["samples"]["rows"] == [] and "'rollouts'" in data["samples"]["notes"][0]
    _, optim = _plots(data, "optim")
    assert {"loss", "grad_norm", "lr"} <= set(optim)
    assert _solid(optim["lr"])["demo/sft"]["y"] == pytest.approx([1e-3 * (s + 1) for s in SFT_STEPS])
    _, time = _plots(data, "time")
    assert "generate_tps" not in time and "seconds_train" in time
    assert data["overview"][0]["last_reward"] is None


def test_two_runs_overlay_with_one_colour_per_run(runs):
    rl, sft = runs
    data = report.report_data([rl, sft])
    assert [run["run_id"] for run in data["runs"]] == ["demo/rl", "demo/sft"]
    assert len({run["color"] for run in data["runs"]}) == 2
    _, optim = _plots(data, "optim")
    loss = _solid(optim["loss"])
    assert set(loss) == {"demo/rl", "demo/sft"}
    assert loss["demo/sft"]["x"] == list(SFT_STEPS)
    assert loss["demo/sft"]["y"] == pytest.approx([1.0 / (s + 1) + 1 for s in SFT_STEPS], rel=1e-5)
    section, reward = _plots(data, "reward")
    assert set(_solid(reward["reward"])) == {"demo/rl"}
    assert section["notes"] == ["demo/sft has no rows in 'scores', so it is absent here."]
    assert [row["run_id"] for row in data["overview"]] == ["demo/rl", "demo/sft"]


def test_same_run_id_in_two_folders_is_noted(runs, tmp_path):
    rl, _ = runs
    write_run(tmp_path / "again", "demo/rl", (0,), rl=False)
    data = report.report_data([rl, tmp_path / "again"])
    assert len({run["color"] for run in data["runs"]}) == 1
    assert any("several run folders" in note for note in data["notes"])


def test_plot_without_values_becomes_a_note(tmp_path):
    write_table(tmp_path / "run", "train_steps", 0, [dict(mode="sft", loss=float("nan"), lr=1e-3)], durable=False)
    data = report.report_data([tmp_path / "run"])
    _, optim = _plots(data, "optim")
    assert optim["loss"]["note"] and "series" not in optim["loss"]
    assert optim["grad_norm"]["note"]
    assert _solid(optim["lr"])["run"]["y"] == [1e-3]
    json.dumps(data, allow_nan=False)  # NaN became None


def test_sample_steps_are_spread_and_long_texts_cut():
    assert report._spread(list(range(10)), 20) == list(range(10))
    picked = report._spread(list(range(100)), 5)
    assert picked[0] == 0 and picked[-1] == 99 and len(picked) == 5 == len(set(picked))
    row = report._trim({"completion_text": "x" * (report.MAX_TEXT + 7), "reward": 1.0})
    assert row["completion_text"].startswith("x" * report.MAX_TEXT) and "7 more characters" in row["completion_text"]


def _embedded(html_text):
    match = re.search(r'<script type="application/json" id="rlpipe-data">(.*?)</script>', html_text, re.S)
    return json.loads(match.group(1))


def test_write_report_is_one_self_contained_file(runs):
    rl, sft = runs
    out = report.write_report([rl, sft])
    assert out == rl / "report.html"
    text = out.read_text()
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", text)  # nothing fetched from the network
    assert text.count("</script>") == 3  # onerror hook, data, script: the nasty completion did not end one
    assert "{{" not in text.split('id="rlpipe-data"')[0]
    data = _embedded(text)
    assert data["title"] == "rlpipe report: demo/rl, demo/sft"
    assert NASTY in [row["completion_text"] for row in data["samples"]["rows"]]
    assert [item for item in rl.iterdir() if item.name.endswith(".tmp")] == []


def test_main_writes_the_report_and_rejects_a_bad_run_dir(runs, tmp_path, capsys):
    rl, sft = runs
    out = tmp_path / "sub" / "cmp.html"
    assert rlpipe(["report", str(rl), str(sft), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert {run["run_id"] for run in _embedded(out.read_text())["runs"]} == {"demo/rl", "demo/sft"}

    assert report.main([str(rl), str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("rlpipe report: not a run directory") and "missing" in err
    (tmp_path / "empty").mkdir()
    assert report.main([str(tmp_path / "empty")]) == 2
    assert "no tables/ folder" in capsys.readouterr().err


def test_clean_makes_cells_json_ready():
    assert report._clean(float("inf")) is None and report._clean(float("nan")) is None
    assert report._clean(0.1234567891) == 0.123457
    assert report._clean(3) == 3 and report._clean("a") == "a"
    assert not math.isnan(report._clean(1e-12))


def test_a_run_without_values_of_a_column_has_no_line_there(runs):
    rl, sft = runs
    _, time = _plots(report.report_data([rl, sft]), "time")
    assert set(_solid(time["generate_tps"])) == {"demo/rl"}  # SFT generates nothing: not in the legend
    assert set(_solid(time["seconds_train"])) == {"demo/rl", "demo/sft"}


# ---------------------------------------------------------------- fates and the rollout browser

EPISODE = {"n_turns": 2, "completion_text": "calc 51*92<|im_end|>\n<|im_start|>tool\n4692<|im_end|>\nans 4692",
           "turns": [{"turn": 0, "producer": "model", "start": 0, "length": 11, "reward": None},
                     {"turn": 0, "producer": "env", "start": 11, "length": 24, "reward": 0.5},
                     {"turn": 1, "producer": "model", "start": 35, "length": 9, "reward": None}],
           "messages": json.dumps([{"role": "user", "content": "51*92"}, {"role": "assistant", "content": "calc 51*92"},
                                   {"role": "tool", "content": "4692"}, {"role": "assistant", "content": "ans 4692"}])}


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


def test_sft_run_has_no_fates_and_an_empty_browser(runs):
    _, sft = runs
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
    assert _embedded(out.read_text())["rollouts"]["n"] == n
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
