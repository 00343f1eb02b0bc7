"""Environment mixtures (`[[task.envs]]`): the weighted, seeded, resumable draw of prompts, the
mixture environment that routes each example to its entry, the config's checks and the
per-environment metrics."""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest
from rlpipe.core.config import ConfigError
from rlpipe.envs.arithmetic import ArithmeticEnv
from rlpipe.envs.countdown import CountdownEnv
from rlpipe.envs.mixture import MixtureEnv, mixture_of, prompt_source
from rlpipe.envs.prompts import DRAW_BLOCK, MixturePromptSource, PromptSource, mixture_draws
from rlpipe.rollouts.env_metrics import env_metrics
from rlpipe.rollouts.records import Score
from rlpipe.tasks.config import validate_config
from rlpipe.tasks.setup import task_env

from tests.rollout_rows import rollout


def _mixture() -> MixtureEnv:
    return MixtureEnv({"add": ArithmeticEnv.from_options(max_digits=2, eval_size=30),
                       "cd": CountdownEnv.from_options(eval_size=10)}, {"add": 3.0, "cd": 1.0})


def test_draws_follow_the_weights_and_depend_only_on_seed_and_position():
    draws = mixture_draws(7, [3.0, 1.0], 0, 8000)
    share = Counter(draws)[0] / len(draws)
    assert 0.73 < share < 0.77  # 3:1
    assert draws == mixture_draws(7, [3.0, 1.0], 0, 8000)
    assert draws != mixture_draws(8, [3.0, 1.0], 0, 8000)
    # any window, across block boundaries, is the same slice of the one sequence
    start = DRAW_BLOCK - 5
    assert mixture_draws(7, [3.0, 1.0], start, 20) == draws[start : start + 20]
    with pytest.raises(ValueError, match="weights must be positive"):
        mixture_draws(0, [1.0, 0.0], 0, 1)


def _source(seed: int = 5) -> MixturePromptSource:
    return prompt_source(_mixture(), seed)  # type: ignore[return-value]


def test_mixture_prompts_resume_exactly_from_their_state():
    straight = _source()
    expected = [ex.example_id for k in (6, 7, 9, 5) for ex in straight.next_batch(k)]
    first = _source()
    before = [ex.example_id for k in (6, 7) for ex in first.next_batch(k)]
    state = json.loads(json.dumps(first.state_dict()))  # as data_state.json holds it
    resumed = _source()
    resumed.load_state_dict(state)
    after = [ex.example_id for k in (9, 5) for ex in resumed.next_batch(k)]
    assert before + after == expected
    assert {ex.split("/")[0] for ex in expected} == {"add", "cd"}
    assert _source(6).next_batch(27) != _source(5).next_batch(27)


def test_mixture_state_refuses_other_weights_and_a_single_source_state():
    state = _source().state_dict()
    other = MixturePromptSource(_source().sources, {"add": 1.0, "cd": 1.0}, seed=5)
    with pytest.raises(ValueError, match="task.envs changed since the checkpoint"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match="single environment"):
        _source().load_state_dict(PromptSource(["x"], seed=0).state_dict())  # type: ignore[list-item]
    with pytest.raises(ValueError, match="state is of a mixture"):
        PromptSource(["x"], seed=0).load_state_dict(state)  # type: ignore[list-item]


def test_mixture_examples_are_labelled_by_entry_and_scored_by_their_own_env():
    env = _mixture()
    draws = _source().next_batch(40)
    add = next(ex for ex in draws if ex.env == "add")
    countdown = next(ex for ex in draws if ex.env == "cd")
    assert add.example_id.startswith("add/train/") and countdown.example_id.startswith("cd/train/")
    inner, own = env.entry(add)
    assert isinstance(inner, ArithmeticEnv) and own.env == "arithmetic" and not own.example_id.startswith("add/")
    right = str(add.meta["target_text"])
    assert env.reward(add, right).reward == ArithmeticEnv.from_options(max_digits=2).reward(own, right).reward > 0
    assert env.reset(countdown) == [{"role": "user", "content": countdown.prompt}]
    assert env.demonstration(add, random.Random(0)) == right
    with pytest.raises(ValueError, match="not from this mixture"):
        env.reward(own, right)


def test_eval_split_mixes_entries_by_weight_in_every_prefix():
    evals = list(_mixture().examples("eval", seed=0))
    assert len(evals) == 40 and len({(e.env, e.example_id) for e in evals}) == 40
    head = Counter(e.env for e in evals[:16])
    assert head["add"] > head["cd"] > 0


def _config(**task):
    return {"flow": "rl", "task": task}


def test_config_builds_a_mixture_and_the_single_form_stays_one_env():
    entries = [{"name": "add", "weight": 3, "env": "arithmetic", "options": {"max_digits": 2}},
               {"name": "cd", "env": "countdown"}]
    config = validate_config(_config(envs=entries))
    env = task_env(config.task)
    assert isinstance(mixture_of(env), MixtureEnv) and mixture_of(env).weights == {"add": 3.0, "cd": 1.0}
    assert validate_config(json.loads(config.model_dump_json())).task.envs == config.task.envs  # config.json
    single = validate_config(_config(env="countdown"))
    assert [e.name for e in single.task.entries()] == ["countdown"]
    assert isinstance(task_env(single.task), CountdownEnv)
    assert isinstance(prompt_source(task_env(single.task), 0), PromptSource)


@pytest.mark.parametrize(("task", "message"), [
    ({"envs": [{"name": "a"}, {"name": "a"}]}, "names must be unique, a given more than once"),
    ({"envs": [{"name": "a/b"}]}, r"task\.envs\[0\]\.name"),
    ({"envs": [{"name": "a", "weight": 0}]}, r"task\.envs\[0\]\.weight"),
    ({"env": "countdown", "envs": [{"name": "a"}]}, "leave task.env unset"),
])
def test_bad_mixtures_are_one_line_naming_the_field(task, message):
    with pytest.raises(ConfigError, match=message) as error:
        validate_config(_config(**task))
    assert "\n" not in str(error.value)


def test_env_metrics_per_environment():
    rows = [rollout(sample_id=f"s{i}", group_id=f"g{i // 2}", env=env)
            for i, env in enumerate(["a", "a", "a", "a", "b", "b"])]
    rewards = [1.0, 0.0, 1.0, 1.0, 0.0, 0.0]
    scores = [Score(run_id="r", step=1, sample_id=r.sample_id, group_id=r.group_id, reward=w,
                    components={"correct": w}, error=None) for r, w in zip(rows, rewards, strict=True)]
    out = env_metrics(rows, scores)
    assert out["rollout/a/reward_mean"] == 0.75 and out["rollout/a/accuracy"] == 0.75
    assert out["rollout/a/zero_var_fraction"] == 0.5  # g1 flat, g0 not
    assert out["rollout/b/zero_var_fraction"] == 1.0 and out["rollout/b/samples"] == 2.0


def _round_rows(attempt: int, envs: list[str]) -> list[dict]:
    """Rollout rows of one sampling round, in the order generate writes them (group, completion)."""
    return [rollout(run_id="r", step=3, env=env, example_id=f"{env}/train/0/{g}", attempt=attempt,
                    group_id=f"r:s000003:a{attempt}:g{g:04d}", sample_id=f"r:s000003:a{attempt}:g{g:04d}:{j:03d}").row()
            for g, env in enumerate(envs) for j in range(2)]


def test_a_mixture_writes_one_file_per_env_inside_the_step_and_reads_them_back_in_write_order(tmp_path):
    from rlpipe.storage.catalog import connect
    from rlpipe.storage.compaction import fresh_files
    from rlpipe.storage.layout import mark_env_partitioned
    from rlpipe.storage.stage_tables import load_rows_beyond
    from rlpipe.storage.writer import compact_run, is_complete, read_table, step_files, write_table

    mark_env_partitioned(tmp_path)
    first = _round_rows(1, ["b", "a", "b"])
    write_table(tmp_path, "rollouts", 3, first)
    rows = first + _round_rows(2, ["a", "c", "b"])  # the step's partition holds every round so far
    write_table(tmp_path, "rollouts", 3, rows)
    step = tmp_path / "tables" / "rollouts" / "step=3"
    assert sorted(p.relative_to(step).as_posix() for p in step.rglob("*.parquet")) == [
        "env=a/part-0.parquet", "env=b/part-0.parquet", "env=c/part-0.parquet"]
    assert step_files(tmp_path, "rollouts", 3) == sorted(step.glob("env=*/part-0.parquet"))
    assert is_complete(tmp_path, "rollouts", 3) and [s for s, _ in fresh_files(tmp_path, "rollouts")] == [3] * 3
    assert read_table(tmp_path, "rollouts", 3).column("sample_id").to_pylist() == [r["sample_id"] for r in rows]
    assert read_table(tmp_path, "rollouts").num_rows == len(rows)
    assert load_rows_beyond(tmp_path, "rollouts", 3, known=len(first)) is not None
    assert load_rows_beyond(tmp_path, "rollouts", 3, known=len(rows)) is None
    con = connect([tmp_path])
    assert dict(con.sql("select env, count(*) from rollouts group by env").fetchall()) == {"a": 4, "b": 6, "c": 2}
    # a rewrite with fewer environments, and an empty one, leave no file of the old write behind
    # (once a pass has deleted the files retired from the table's snapshot)
    write_table(tmp_path, "rollouts", 3, _round_rows(1, ["a"]))
    assert [p.parent.name for p in step_files(tmp_path, "rollouts", 3)] == ["env=a"]
    assert read_table(tmp_path, "rollouts").num_rows == 2
    compact_run(tmp_path, closed=0, grace=0)
    assert not (step / "env=b").exists()
    write_table(tmp_path, "rollouts", 3, [])
    assert step_files(tmp_path, "rollouts", 3) == [step / "part-0.parquet"]
    compact_run(tmp_path, closed=0, grace=0)
    assert not list(step.glob("env=*/*.parquet"))
    # the other tables, and runs that are no mixture, keep one file per step
    write_table(tmp_path, "groups", 3, [])
    assert step_files(tmp_path, "groups", 3) == [tmp_path / "tables" / "groups" / "step=3" / "part-0.parquet"]


def test_a_stored_round_missing_some_prompts_is_sampled_again():
    from rlpipe.envs.base import Example
    from rlpipe.rollouts.generation import _stored_round

    rows = _round_rows(1, ["a", "b"])
    examples = [Example(row["env"], row["example_id"], "p", 0) for row in rows[::2]]
    assert [r.sample_id for r in _stored_round(rows, {"attempt": 1, "examples": examples})] == \
        [row["sample_id"] for row in rows]
    assert _stored_round(rows[:2], {"attempt": 1, "examples": examples}) is None  # env b's file lost in a kill
    assert _stored_round(rows, {"attempt": 2, "examples": examples}) is None


@pytest.mark.parametrize(("first", "says"), [
    ('env = "arithmetic"\noptions = { max_digits = 0 }', "task.envs[0].options: "),
    ('env = "calculator"', "task.envs: entry 'add' is multi-turn (calculator)"),
])
def test_preflight_refuses_a_bad_entry_in_one_line_naming_it(first, says, tmp_path, monkeypatch, capsys):
    from rlpipe.flows.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'tracking.db'}")
    (tmp_path / "mix.toml").write_text(f'flow = "rl"\nruns_root = "runs"\n[task]\n[[task.envs]]\nname = "add"\n{first}\n'
                                       '[[task.envs]]\nname = "cd"\nenv = "countdown"\n')
    code = main(["run", "mix.toml"])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and says in lines[0], lines
    assert not (tmp_path / "runs").exists()


def test_env_by_step_equals_the_numbers_computed_from_the_rows(tmp_path):
    from rlpipe.storage.queries import run_canned
    from rlpipe.storage.writer import write_table

    from tests.synthetic_runs import synthetic_step

    expected: dict[tuple, dict] = {}
    run_dirs = []
    for run_id in ("run-a", "run-b"):
        run_dir = tmp_path / run_id
        run_dirs.append(run_dir)
        for step in (1, 2):
            tables = synthetic_step(step, run_id=run_id, n_groups=9, group_size=4, n_token_rows=0,
                                    seed=len(run_dirs), zero_variance_share=0.4)
            rollouts, scores, groups = (tables[t].to_pylist() for t in ("rollouts", "scores", "groups"))
            trained = [r for r in rollouts if r["sample_id"].endswith("-0")]  # one per group
            for name, rows in (("rollouts", rollouts), ("scores", scores), ("groups", groups)):
                write_table(run_dir, name, step, rows)
            write_table(run_dir, "advantages", step, [{"run_id": run_id, "step": step, "sample_id": r["sample_id"],
                                                       "group_id": r["group_id"], "advantage": 1.0} for r in trained])
            score = {s["sample_id"]: s for s in scores}
            for env in {r["env"] for r in rollouts}:
                mine = [score[r["sample_id"]] for r in rollouts if r["env"] == env]
                flat = [g["zero_variance"] for g in groups if g["env"] == env]
                expected[(run_id, env, step)] = {
                    "n_samples": len(mine), "reward_mean": sum(s["reward"] for s in mine) / len(mine),
                    "accuracy": sum(dict(s["components"])["correct"] == 1 for s in mine) / len(mine),
                    "n_groups": len(flat), "zero_variance_fraction": sum(flat) / len(flat),
                    "n_trained": sum(r["env"] == env for r in trained)}
    got = {(r["run_id"], r["env"], r["step"]): r for r in run_canned(run_dirs, "env_by_step").to_pylist()}
    assert set(got) == set(expected) and len({key[1] for key in got}) == 2
    for key, want in expected.items():
        for column, value in want.items():
            assert got[key][column] == pytest.approx(value), (key, column)


def test_the_run_summary_lists_each_environments_accuracy_and_the_env_query():
    from rlpipe.flows.runner import summary_lines

    config = validate_config(_config(envs=[{"name": "add", "env": "arithmetic", "options": {"max_digits": 2}},
                                           {"name": "cd", "env": "countdown"}]))
    lines = summary_lines(config, {"eval": {"eval/accuracy": 0.5, "eval/add/accuracy": 0.625,
                                            "eval/cd/accuracy": 0.25}}, 1.0)
    assert [line.split() for line in lines if line.strip().startswith(("add", "cd"))] == [["add", "62.5%"],
                                                                                        ["cd", "25.0%"]]
    assert any("--query env_by_step" in line for line in lines)
    single = summary_lines(validate_config(_config()), {"eval": {"eval/accuracy": 0.5}}, 1.0)
    assert not any("env_by_step" in line for line in single)
