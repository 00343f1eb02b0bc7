"""Canned queries against numbers computed in plain Python, and the `rlpipe sql` command."""

from __future__ import annotations

import csv
import io
import json
import math
import statistics
from collections import defaultdict

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from rlpipe.flows.cli import main as rlpipe
from rlpipe.storage.queries import canned_queries, run_canned, run_sql
from rlpipe.storage.sqlcli import main as sql_main
from rlpipe.storage.writer import write_table

from tests import warm_cli
from tests.synthetic_runs import synthetic_step

RUNS = ("run-a", "run-b")
STEPS = (1, 2, 3)
REQUIRED = {
    "reward_by_step",
    "zero_variance_by_step",
    "length_vs_reward",
    "hardest_prompts",
    "throughput_by_step",
    "eval_by_step",
    "loss_by_step",
    "samples_by_step",
    "pass_rate_by_prompt",
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two runs of three steps; returns (run dirs, the written tables per name, concatenated)."""
    root = tmp_path_factory.mktemp("runs")
    written = defaultdict(list)
    for seed, run_id in enumerate(RUNS):
        for step in STEPS:
            tables = synthetic_step(
                step,
                run_id=run_id,
                n_groups=7,
                group_size=4,
                n_token_rows=5,
                seed=seed,
                n_examples=6,
                zero_variance_share=0.5,
            )
            tables["train_steps"] = pa.Table.from_pylist(
                [
                    dict(
                        run_id=run_id,
                        step=step,
                        mode="rl",
                        loss=1.0 / step + seed,
                        grad_norm=0.5 * step,
                        lr=1e-3,
                        tokens=100 * step,
                        tokens_per_second=50.0,
                        seconds_generate=2.0 * step,
                        seconds_total=5.0,
                    )
                ]
            )
            tables["evals"] = pa.Table.from_pylist(
                [
                    dict(
                        run_id=run_id,
                        step=step,
                        env=env,
                        example_id=str(i),
                        reward=float((i + step + seed) % 3) / 2,
                        correct=(i + step) % 2 == 0,
                    )
                    for env in ("arithmetic", "countdown")
                    for i in range(5)
                ]
            )
            for name, table in tables.items():
                write_table(
                    root / run_id, name, step, table.drop_columns(["run_id", "step"]), run_id=run_id
                )
                written[name].append(table)
    tables = {
        name: pa.concat_tables(parts, promote_options="default") for name, parts in written.items()
    }
    return [root / run_id for run_id in RUNS], {name: t.to_pylist() for name, t in tables.items()}


def _by(rows, *keys):
    out = defaultdict(list)
    for row in rows:
        out[tuple(row[key] for key in keys)].append(row)
    return out


def test_required_canned_queries_exist_with_a_description():
    queries = canned_queries()
    assert REQUIRED <= set(queries)
    for query in queries.values():
        assert query.description and "columns:" in query.sql()


def test_reward_by_step(runs):
    run_dirs, tables = runs
    got = run_canned(run_dirs, "reward_by_step").to_pylist()
    expected = []
    for (run_id, step), rows in sorted(_by(tables["scores"], "run_id", "step").items()):
        rewards = [row["reward"] for row in rows]
        expected.append(
            dict(
                run_id=run_id,
                step=step,
                n=len(rows),
                n_errors=sum(row["error"] is not None for row in rows),
                reward_mean=statistics.fmean(rewards),
                reward_std=statistics.pstdev(rewards),
                reward_min=min(rewards),
                reward_max=max(rewards),
            )
        )
    assert [row.keys() for row in got] == [row.keys() for row in expected]
    for row, want in zip(got, expected, strict=True):
        assert row == pytest.approx(want)


def test_zero_variance_by_step_counts_groups_from_the_rewards(runs):
    run_dirs, tables = runs
    got = run_canned(run_dirs, "zero_variance_by_step").to_pylist()
    groups = _by(tables["groups"], "run_id", "step")
    expected = []
    for (run_id, step), rows in sorted(_by(tables["scores"], "run_id", "step").items()):
        rewards = defaultdict(list)
        for row in rows:
            rewards[row["group_id"]].append(row["reward"])
        zero = sum(len(set(values)) == 1 for values in rewards.values())
        attempts = [group["attempts"] for group in groups[(run_id, step)]]
        expected.append(
            dict(
                run_id=run_id,
                step=step,
                n_groups=len(rewards),
                n_zero_variance=zero,
                zero_variance_fraction=zero / len(rewards),
                n_kept=len(rewards) - zero,
                attempts_total=sum(attempts),
                attempts_max=max(attempts),
            )
        )
    assert len(got) == len(expected)
    for row, want in zip(got, expected, strict=True):
        assert row == pytest.approx(want)
    assert (
        sum(row["n_zero_variance"] for row in got) > 0
    )  # the data has zero-variance groups to count


def test_length_vs_reward(runs):
    run_dirs, tables = runs
    got = {
        (row["run_id"], row["step"]): row
        for row in run_canned(run_dirs, "length_vs_reward").to_pylist()
    }
    rewards = {(row["run_id"], row["sample_id"]): row["reward"] for row in tables["scores"]}
    for key, rows in _by(tables["rollouts"], "run_id", "step").items():
        lengths = [row["n_completion_tokens"] for row in rows]
        values = [rewards[(row["run_id"], row["sample_id"])] for row in rows]
        row = got[key]
        assert row["n"] == len(rows)
        assert row["completion_tokens_mean"] == pytest.approx(statistics.fmean(lengths))
        assert row["completion_tokens_max"] == max(lengths)
        assert row["reward_mean"] == pytest.approx(statistics.fmean(values))
        assert row["length_reward_corr"] == pytest.approx(statistics.correlation(lengths, values))
        assert row["truncated_fraction"] == pytest.approx(
            sum(r["finish_reason"] == "length" for r in rows) / len(rows)
        )


def test_hardest_prompts(runs):
    run_dirs, tables = runs
    got = run_canned(run_dirs, "hardest_prompts").to_pylist()
    rewards = {(row["run_id"], row["sample_id"]): row["reward"] for row in tables["scores"]}
    for run_id in RUNS:
        per_prompt = []
        for (env, example_id), rows in _by(
            [r for r in tables["rollouts"] if r["run_id"] == run_id], "env", "example_id"
        ).items():
            values = [rewards[(run_id, row["sample_id"])] for row in rows]
            per_prompt.append((statistics.fmean(values), -len(values), env, example_id))
        expected = sorted(per_prompt)[:20]
        mine = [row for row in got if row["run_id"] == run_id]
        assert [row["rank"] for row in mine] == list(range(1, len(expected) + 1))
        assert [(row["env"], row["example_id"]) for row in mine] == [
            (e, x) for _, _, e, x in expected
        ]
        assert [row["reward_mean"] for row in mine] == pytest.approx(
            [mean for mean, _, _, _ in expected]
        )


def test_pass_rate_by_prompt_follows_each_prompt_step_by_step(runs):
    run_dirs, tables = runs
    got = run_canned(run_dirs, "pass_rate_by_prompt").to_pylist()
    scores = {(row["run_id"], row["sample_id"]): row for row in tables["scores"]}
    expected = []
    for (run_id, env, example_id), rows in sorted(_by(tables["rollouts"], "run_id", "env", "example_id").items()):
        total = passed_total = 0
        for (step,), at_step in sorted(_by(rows, "step").items()):
            rewards = [scores[(run_id, r["sample_id"])]["reward"] for r in at_step
                       if scores[(run_id, r["sample_id"])]["error"] is None]
            if not rewards:
                continue
            passed = sum(reward >= 1 for reward in rewards)
            total, passed_total = total + len(rewards), passed_total + passed
            expected.append((run_id, env, example_id, step, len(rewards), passed, passed / len(rewards), total,
                             passed_total / total))
    assert any(0 < row[6] < 1 for row in expected) and any(row[6] in (0, 1) for row in expected)
    keys = ("run_id", "env", "example_id", "step", "n_samples", "n_passed", "pass_rate", "cumulative_samples",
            "cumulative_pass_rate")
    assert [tuple(row[k] for k in keys[:6] + keys[7:8]) for row in got] == [e[:6] + e[7:8] for e in expected]
    assert [x for row in got for x in (row["pass_rate"], row["cumulative_pass_rate"])] == pytest.approx(
        [x for e in expected for x in (e[6], e[8])])


def test_samples_by_step_gives_best_and_worst(runs):
    run_dirs, tables = runs
    got = run_canned(run_dirs, "samples_by_step").to_pylist()
    assert len(got) == 2 * len(RUNS) * len(STEPS)
    for (run_id, step), rows in _by(tables["scores"], "run_id", "step").items():
        best = min(rows, key=lambda r: (-r["reward"], r["sample_id"]))
        worst = min(rows, key=lambda r: (r["reward"], r["sample_id"]))
        mine = {row["kind"]: row for row in got if (row["run_id"], row["step"]) == (run_id, step)}
        assert (
            mine["best"]["sample_id"] == best["sample_id"]
            and mine["worst"]["sample_id"] == worst["sample_id"]
        )
        assert mine["best"]["reward"] == pytest.approx(best["reward"])
        assert json.loads(mine["best"]["components"]) == pytest.approx(dict(best["components"]))
        assert mine["best"]["prompt_text"].startswith("problem ")


def test_eval_loss_and_throughput_by_step(runs):
    run_dirs, tables = runs
    evals = run_canned(run_dirs, "eval_by_step").to_pylist()
    for row in evals:
        rows = [
            r
            for r in tables["evals"]
            if (r["run_id"], r["step"], r["env"]) == (row["run_id"], row["step"], row["env"])
        ]
        assert row["n"] == len(rows) == 5
        assert row["reward_mean"] == pytest.approx(statistics.fmean(r["reward"] for r in rows))
        assert row["accuracy"] == pytest.approx(statistics.fmean(r["correct"] for r in rows))
    assert len(evals) == len(RUNS) * len(STEPS) * 2
    loss = run_canned(run_dirs, "loss_by_step").to_pylist()
    assert [(r["run_id"], r["step"], r["loss"]) for r in loss] == [
        (r["run_id"], r["step"], r["loss"])
        for r in sorted(tables["train_steps"], key=lambda r: (r["run_id"], r["step"]))
    ]
    assert loss[0]["clip_fraction"] is None
    throughput = run_canned(run_dirs, "throughput_by_step").to_pylist()
    for row in throughput:
        rows = [
            r
            for r in tables["rollouts"]
            if (r["run_id"], r["step"]) == (row["run_id"], row["step"])
        ]
        tokens = sum(r["n_completion_tokens"] for r in rows)
        assert row["n_completions"] == len(rows) and row["completion_tokens"] == tokens
        assert row["generate_tokens_per_second"] == pytest.approx(tokens / (2.0 * row["step"]))


def test_cross_run_query_and_single_run(runs):
    run_dirs, tables = runs
    both = run_sql(
        run_dirs, "select run_id, count(*) as n from rollouts group by 1 order by 1"
    ).to_pylist()
    assert both == [{"run_id": run_id, "n": len(STEPS) * 28} for run_id in RUNS]
    one = run_canned(run_dirs[:1], "reward_by_step").column("run_id").to_pylist()
    assert set(one) == {"run-a"}


def test_cli_formats(runs, capsys, tmp_path):
    run_dirs, _ = runs
    dirs = [str(run) for run in run_dirs]
    assert rlpipe(["sql", *dirs, "--query", "reward_by_step", "--format", "csv"]) == 0
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert len(rows) == len(RUNS) * len(STEPS) and rows[0]["run_id"] == "run-a"
    assert (
        sql_main(
            [
                *dirs,
                "select sample_id, completion_tokens, step from rollouts where completion_tokens is not null order by all limit 2",
                "--format",
                "json",
            ]
        )
        == 0
    )
    data = json.loads(capsys.readouterr().out)
    assert isinstance(data[0]["completion_tokens"], list) and len(data) == 2
    out = tmp_path / "r.parquet"
    assert (
        sql_main([*dirs, "--query", "samples_by_step", "--format", "parquet", "--out", str(out)])
        == 0
    )
    assert pq.read_table(out).num_rows == 2 * len(RUNS) * len(STEPS)
    assert sql_main([dirs[0], "select step, count(*) as n from scores group by 1 order by 1"]) == 0
    assert "step" in capsys.readouterr().out
    # options between the run folder and the SQL, as people type them
    assert sql_main([dirs[0], "--format", "csv", "select count(*) as n from scores"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == '"n"'
    assert sql_main(["--list"]) == 0
    listing = capsys.readouterr().out
    assert all(name in listing for name in REQUIRED)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["{missing}", "select 1"], "not a run directory"),
        (["{run}", "select * from rollout"], "Table with name rollout does not exist"),
        (["{run}", "--query", "no_such_query"], "unknown query 'no_such_query'"),
        (["{run}", "selec 1"], "Parser Error"),
        (["{run}", "select 1/'a'"], "Error"),
        (
            ["{run}", "--query", "reward_by_step", "--format", "parquet"],
            "--format parquet needs --out",
        ),
        (["{run}"], "give RUN_DIR"),
    ],
)
def test_cli_errors_exit_2_with_one_line(runs, capsys, tmp_path, args, message):
    run_dirs, _ = runs
    argv = [arg.format(run=run_dirs[0], missing=tmp_path / "nope") for arg in args]
    assert sql_main(argv) == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1 and err.startswith("rlpipe sql: ")


def test_cli_notes_tables_without_data(tmp_path, capsys):
    write_table(tmp_path / "r", "scores", 1, [dict(sample_id="s", group_id="g", reward=1.0)])
    assert sql_main([str(tmp_path / "r"), "--query", "eval_by_step", "--format", "csv"]) == 0
    captured = capsys.readouterr()
    assert "table 'evals' has no data yet" in captured.err
    assert captured.out.startswith('"run_id","step","env","n","reward_mean","accuracy"')
    assert math.isclose(
        run_canned([tmp_path / "r"], "reward_by_step").column("reward_mean")[0].as_py(), 1.0
    )


def test_canned_queries_are_found_from_any_working_folder(tmp_path):
    # the installed package's *.sql, not a `dashboards` folder that only the checkout's root has
    import sys

    out = warm_cli.run([sys.executable, "-m", "rlpipe.flows.cli", "sql", "--list"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "reward_by_step" in out.stdout and "rescore_compare" in out.stdout, out.stderr


def test_as_of_step_reads_every_table_and_view_as_the_run_stood_after_that_step(runs, capsys):
    run_dirs, _ = runs
    first, last = STEPS[0], STEPS[-1]
    dirs = [str(run) for run in run_dirs]
    assert sql_main([*dirs, "--as-of-step", str(first), "--format", "json",
                     "select (select max(step) from rollouts) r, (select max(step) from scores) s, "
                     "(select max(step) from fates) f, (select count(distinct step) from groups) g"]) == 0
    assert json.loads(capsys.readouterr().out) == [{"r": first, "s": first, "f": first, "g": 1}]
    assert sql_main([*dirs, "--as-of-step", str(last), "--query", "reward_by_step", "--format", "csv"]) == 0
    whole = capsys.readouterr().out
    assert sql_main([*dirs, "--query", "reward_by_step", "--format", "csv"]) == 0
    assert capsys.readouterr().out == whole  # as of the last step: the same answer, byte for byte
    assert sql_main([*dirs, "--as-of-step", "-1", "select 1"]) == 2
    assert "--as-of-step must be >= 0" in capsys.readouterr().err


def test_a_wide_table_is_printed_whole_not_cut_at_80_columns(runs, capsys):
    run_dirs, _ = runs
    columns = ", ".join(f"'value_of_column_{i}_in_full' as column_name_number_{i}" for i in range(6))
    assert sql_main([str(run_dirs[0]), f"select {columns} from scores limit 1"]) == 0
    out = capsys.readouterr().out
    assert "…" not in out
    assert all(f"column_name_number_{i}" in out and f"value_of_column_{i}_in_full" in out for i in range(6))
