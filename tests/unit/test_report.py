"""The run report's data assembly (dashboards.report) on tiny synthetic runs, and `rlpipe report`.
Its fate chart and rollout browser: test_report_fates.py."""

from __future__ import annotations

import json
import math
import re
import statistics

import pytest
from rlpipe.dashboards import report
from rlpipe.flows.cli import main as rlpipe
from rlpipe.storage.queries import canned_queries, run_canned
from rlpipe.storage.writer import write_table

from tests.report_runs import NASTY, RL_STEPS, SFT_STEPS, embedded_data, write_run
from tests.synthetic_runs import synthetic_step


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
    # ±1 std within the step's [min, max]: a 0/1 reward's band never leaves [0, 1]
    assert band["lo"] == pytest.approx([max(row["reward_mean"] - row["reward_std"], row["reward_min"]) for row in rows],
                                       rel=1e-4, abs=1e-6)
    assert band["hi"] == pytest.approx([min(row["reward_mean"] + row["reward_std"], row["reward_max"]) for row in rows],
                                       rel=1e-4, abs=1e-6)
    assert all(0 <= lo <= hi <= 1 for lo, hi in zip(band["lo"], band["hi"], strict=True))
    assert reward["reward_errors"]["y_range"] == (0, 1)  # a share: 0-100%, never below 0
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


def test_an_sft_and_an_rl_folder_get_a_step_axis_each_and_one_note(runs):
    """The README's `rlpipe report RUN/rl RUN/sft`: SFT step 2 is not RL step 2, so every plot both
    phases have is drawn once per phase on that phase's own axis; the SFT run's absence from the
    RL-only sections is said once, not as a banner in each."""
    rl, sft = runs
    data = report.report_data([rl, sft])
    assert [run["run_id"] for run in data["runs"]] == ["demo/rl", "demo/sft"]
    assert len({run["color"] for run in data["runs"]}) == 2
    _, optim = _plots(data, "optim")
    assert list(optim)[:4] == ["loss_sft", "loss_rl", "grad_norm_sft", "grad_norm_rl"]
    assert (optim["loss_sft"]["title"], optim["loss_sft"]["x_label"]) == ("Loss · SFT", "SFT step")
    assert (optim["loss_rl"]["title"], optim["loss_rl"]["x_label"]) == ("Loss · RL", "RL step")
    sft_loss, rl_loss = _solid(optim["loss_sft"]), _solid(optim["loss_rl"])
    assert set(sft_loss) == {"demo/sft"} and set(rl_loss) == {"demo/rl"}
    assert sft_loss["demo/sft"]["x"] == list(SFT_STEPS)
    assert sft_loss["demo/sft"]["y"] == pytest.approx([1.0 / (s + 1) + 1 for s in SFT_STEPS], rel=1e-5)
    assert rl_loss["demo/rl"]["x"] == list(RL_STEPS)
    _, evals = _plots(data, "eval")
    assert {"eval_all_sft", "eval_all_rl", "eval_arithmetic_sft", "eval_arithmetic_rl"} <= set(evals)
    section, reward = _plots(data, "reward")
    assert set(_solid(reward["reward"])) == {"demo/rl"}
    assert section["notes"] == []
    banners = [note for part in [*data["sections"], data["samples"], data["hardest"]] for note in part["notes"]]
    assert banners == [] and not any("demo/sft" in note for note in data["fates"]["notes"])
    assert data["notes"] == ["demo/sft is an SFT run: it samples no completions, so it is only in Optimisation, "
                             "Throughput and time, and Evaluation, on an SFT step axis of its own."]
    assert [row["run_id"] for row in data["overview"]] == ["demo/rl", "demo/sft"]


def test_two_runs_of_one_phase_overlay_on_one_axis(runs, tmp_path):
    rl, _ = runs
    write_run(tmp_path / "other", "demo2/rl", (0, 1), rl=True, seed=2)
    _, optim = _plots(report.report_data([rl, tmp_path / "other"]), "optim")
    assert set(_solid(optim["loss"])) == {"demo/rl", "demo2/rl"} and optim["loss"]["x_label"] == "step"


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


def test_write_report_is_one_self_contained_file(runs):
    rl, sft = runs
    out = report.write_report([rl, sft])
    assert out == rl / "report.html"
    text = out.read_text()
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", text)  # nothing fetched from the network
    assert text.count("</script>") == 3  # onerror hook, data, script: the nasty completion did not end one
    assert "{{" not in text.split('id="rlpipe-data"')[0]
    data = embedded_data(text)
    assert data["title"] == "rlpipe report: demo/rl, demo/sft"
    assert NASTY in [row["completion_text"] for row in data["samples"]["rows"]]
    assert [item for item in rl.iterdir() if item.name.endswith(".tmp")] == []


def test_main_writes_the_report_and_rejects_a_bad_run_dir(runs, tmp_path, capsys):
    rl, sft = runs
    out = tmp_path / "sub" / "cmp.html"
    assert rlpipe(["report", str(rl), str(sft), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert {run["run_id"] for run in embedded_data(out.read_text())["runs"]} == {"demo/rl", "demo/sft"}

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
    assert set(_solid(time["generate_tps_rl"])) == {"demo/rl"}
    assert "generate_tps_sft" not in time  # SFT generates nothing: no plot of it
    assert set(_solid(time["seconds_train_sft"])) == {"demo/sft"}
