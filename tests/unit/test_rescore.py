"""`rlpipe rescore`: stored rollouts re-scored with another reward, group decisions replayed,
advantages recomputed, and the comparison query over the rescore folder."""

from __future__ import annotations

import json
import sys
import time
import tomllib
from pathlib import Path

import pytest
from rlpipe.envs.registry import build_env
from rlpipe.rollouts.options import rollout_options
from rlpipe.storage.catalog import connect
from rlpipe.storage.queries import canned_sql
from rlpipe.storage.writer import read_table, write_table
from rlpipe.tasks.config import RunConfig, validate_config
from rlpipe.tasks.rescoring import find_examples, load_reward, prepare_out, rescore_run, scoring_env

ROOT = Path(__file__).resolve().parents[2]
RUN_ID = "r"
OPTIONS = {"min_digits": 1, "max_digits": 1, "operators": "+", "eval_size": 20}
# (step, group index, example index, correct?) per completion; the run's decisions below
PLAN = {
    1: {"g1": (0, [True, False]), "g2": (1, [False, False]), "g3": (2, [True, False])},
    2: {"g4": (3, [False, True])},
}
DECISIONS = [(1, "g1", "trained"), (1, "g2", "zero_variance"), (1, "g3", "carried"),
             (2, "g3", "trained"), (2, "g4", "trained")]


def config():
    data = tomllib.loads((ROOT / "configs" / "tiny.toml").read_text())
    data["task"]["options"] = OPTIONS
    return validate_config(data)


def env():
    return build_env("arithmetic", **OPTIONS)


def _gid(step: int, name: str) -> str:
    return f"{RUN_ID}:s{step:06d}:a1:{name}"


def make_run(run_dir: Path) -> Path:
    """A two-step RL run's rollouts, scores, groups and advantages (rewards from the env)."""
    arithmetic, cfg = env(), config()
    train = arithmetic.examples("train", seed=cfg.seed)
    rewards: dict[str, list[float]] = {}
    for step, groups in PLAN.items():
        rollouts, scores = [], []
        for name, (index, correct) in groups.items():
            example = train[index]
            for i, ok in enumerate(correct):
                text = str(example.answer) if ok else str(example.answer + 1) + "x" * i
                sid = f"{_gid(step, name)}:{i:03d}"
                rollouts.append(dict(run_id=RUN_ID, step=step, policy_version=step - 1, env="arithmetic",
                                     example_id=example.example_id, group_id=_gid(step, name), sample_id=sid,
                                     attempt=1, completion_text=text, prompt_text=example.prompt,
                                     n_prompt_tokens=3, n_completion_tokens=len(text)))
                result = arithmetic.reward(example, text)
                reward = result.reward
                assert reward == float(ok)
                scores.append(dict(run_id=RUN_ID, step=step, sample_id=sid, group_id=_gid(step, name),
                                   reward=reward, components=result.components))
                rewards.setdefault(name, []).append(reward)
        write_table(run_dir, "rollouts", step, rollouts, run_id=RUN_ID)
        write_table(run_dir, "scores", step, scores, run_id=RUN_ID)
    for step in PLAN:
        rows, advantages = [], []
        for decided, name, status in DECISIONS:
            if decided != step:
                continue
            sampled = next(s for s, groups in PLAN.items() if name in groups)
            r = rewards[name]
            mean = sum(r) / len(r)
            std = (sum((x - mean) ** 2 for x in r) / len(r)) ** 0.5
            rows.append(dict(run_id=RUN_ID, step=step, group_id=_gid(sampled, name), env="arithmetic",
                             example_id=f"train/0/{PLAN[sampled][name][0]}", policy_version=sampled - 1,
                             n=len(r), reward_mean=mean, reward_std=std, zero_variance=std <= 1e-6,
                             kept=status == "trained", attempts=1, status=status))
            if status == "trained":
                advantages += [dict(run_id=RUN_ID, step=step, sample_id=f"{_gid(sampled, name)}:{i:03d}",
                                    group_id=_gid(sampled, name), advantage=x - mean) for i, x in enumerate(r)]
        write_table(run_dir, "groups", step, rows, run_id=RUN_ID)
        write_table(run_dir, "advantages", step, advantages, run_id=RUN_ID)
    (run_dir / "config.json").write_text(json.dumps(config().model_dump(mode="json")))
    (run_dir / "run.json").write_text(json.dumps({"run_id": RUN_ID}))
    return run_dir


def wrong_is_right(text, answer, example):
    return float(text.strip() != str(answer))


def always_one(text, answer, example):
    return 1.0


def by_length(text, answer, example):
    return float(len(text))


def odd_raises(text, answer, example):
    if len(text) % 2:
        raise RuntimeError("odd length")
    return float(text.strip() == str(answer))


def rescore(run_dir: Path, fn, name: str, timeout_s: float = 0.0) -> Path:
    cfg, arithmetic = config(), env()
    out = run_dir / "rescore" / name
    rescore_run(run_dir, out, reward=name, env=arithmetic, scorer=scoring_env(arithmetic, fn, timeout_s),
                options=rollout_options(cfg.rl), seed=cfg.seed)
    return out


def compare(out: Path) -> dict[int, dict]:
    rows = connect([out]).sql(canned_sql("rescore_compare")).to_arrow_table().to_pylist()
    return {row["step"]: row for row in rows}


def _cmp(table):
    return sorted(json.dumps(row, sort_keys=True, default=str) for row in table.to_pylist())


def test_rescoring_with_the_runs_own_reward_reproduces_its_tables(tmp_path):
    run_dir = make_run(tmp_path / "run")
    cfg, arithmetic = config(), env()
    out = tmp_path / "same"
    counts = rescore_run(run_dir, out, reward="env", env=arithmetic, scorer=arithmetic,
                         options=rollout_options(cfg.rl), seed=cfg.seed)
    assert counts == {"rollouts": 8, "errors": 0}
    for table in ("scores", "groups", "advantages"):
        assert _cmp(read_table(out, table)) == _cmp(read_table(run_dir, table)), table
    row = compare(out)
    assert [row[s]["groups_kept"] for s in (1, 2)] == [1, 2]
    assert sum(r["samples_flipped"] + r["samples_dropped"] + r["groups_gained"] for r in row.values()) == 0


def test_a_reversed_reward_flips_every_trained_advantage(tmp_path):
    out = rescore(make_run(tmp_path / "run"), wrong_is_right, "reversed")
    rows = compare(out)
    assert rows[1]["samples_trained"] == 2 and rows[1]["samples_flipped"] == 2
    assert rows[2]["samples_trained"] == 4 and rows[2]["samples_flipped"] == 4
    assert rows[1]["reward_mean"] == pytest.approx(2 / 6) and rows[1]["reward_mean_rescored"] == pytest.approx(4 / 6)
    assert sum(r["groups_dropped"] for r in rows.values()) == 0
    # the rescore folder reads as a run: its rollouts are the source run's
    assert connect([out]).sql("select count(*) from rollouts").fetchall() == [(8,)]


def test_a_constant_reward_drops_every_group_and_a_carried_group_leaves_no_later_row(tmp_path):
    out = rescore(make_run(tmp_path / "run"), always_one, "constant")
    groups = {(r["step"], r["group_id"]): r["status"] for r in read_table(out, "groups").to_pylist()}
    assert groups == {(1, _gid(1, "g1")): "zero_variance", (1, _gid(1, "g2")): "zero_variance",
                      (1, _gid(1, "g3")): "zero_variance", (2, _gid(2, "g4")): "zero_variance"}
    assert read_table(out, "advantages").num_rows == 0
    rows = compare(out)
    assert (rows[1]["groups_dropped"], rows[2]["groups_dropped"]) == (1, 2)
    assert (rows[1]["samples_dropped"], rows[2]["samples_dropped"]) == (2, 4)
    # the folder's fates view is the counterfactual's: every completion dropped for zero variance
    assert connect([out]).sql("select status, count(*) from fates group by 1").fetchall() == [("zero_variance", 8)]


def test_a_group_that_gains_variance_becomes_carried_not_trained(tmp_path):
    out = rescore(make_run(tmp_path / "run"), by_length, "length")
    status = {r["group_id"]: r["status"] for r in read_table(out, "groups", 1).to_pylist()}
    assert status[_gid(1, "g2")] == "carried"
    assert compare(out)[1]["groups_gained"] == 1


def test_a_reward_that_raises_or_hangs_is_recorded_not_fatal(tmp_path):
    run_dir = make_run(tmp_path / "run")
    out = rescore(run_dir, odd_raises, "raises")
    scores = read_table(out, "scores").to_pylist()
    errors = [s for s in scores if s["error"]]
    assert errors and all("RuntimeError: odd length" in s["error"] and s["reward"] == 0 for s in errors)
    assert compare(out)[1]["reward_errors_rescored"] == sum(s["step"] == 1 for s in errors)
    # as in training, a completion whose reward raised leaves its group: its fate is reward_error
    con = connect([out])
    fates = dict(con.sql("select sample_id, status from fates").fetchall())
    assert {sid for sid, status in fates.items() if status == "reward_error"} == {s["sample_id"] for s in errors}
    sizes = dict(con.sql("select group_id, max(n) from groups group by 1").fetchall())
    for group_id, n in sizes.items():
        assert n == sum(s["group_id"] == group_id and not s["error"] for s in scores)

    def slow(text, answer, example):
        if text.endswith("x"):
            time.sleep(1.0)
        return 1.0

    out = rescore(run_dir, slow, "slow", timeout_s=0.2)
    timed_out = [s for s in read_table(out, "scores").to_pylist() if s["error"]]
    assert len(timed_out) == 3 and all("reward_timeout_s" in s["error"] for s in timed_out)


def test_load_reward_names_what_is_wrong(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text("def ok(text, answer, example):\n    return 1.0\nNOT_A_FN = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_reward("my_rewards:ok")("x", 1, None) == 1.0
    assert load_reward("exact_match")("1", 1, None) == 1.0  # a registered name
    with pytest.raises(ValueError, match="cannot import module 'no_such_module'"):
        load_reward("no_such_module:fn")
    with pytest.raises(ValueError, match="has no function 'NOT_A_FN'"):
        load_reward("my_rewards:NOT_A_FN")
    with pytest.raises(ValueError, match="unknown reward"):
        load_reward("no_such_reward")


def test_find_examples_by_index_and_by_scan():
    train = env().examples("train", seed=0)
    known: dict = {}
    find_examples(train, ["train/0/5", "train/0/7"], known)
    assert known["train/0/5"] == train[5]
    with pytest.raises(ValueError, match="not in the env's train examples"):
        find_examples(train[:20], ["elsewhere/3"], known)


def test_an_output_folder_keeps_its_reward(tmp_path):
    run_dir = make_run(tmp_path / "run")
    rescore(run_dir, always_one, "mine")
    prepare_out(run_dir.resolve(), (run_dir / "rescore" / "mine").resolve(), "mine")  # same: fine
    with pytest.raises(ValueError, match="already holds a rescore"):
        prepare_out(run_dir.resolve(), (run_dir / "rescore" / "mine").resolve(), "other")
    with pytest.raises(ValueError, match="tables of its own"):
        prepare_out(run_dir.resolve(), run_dir.resolve(), "mine")


def test_cli_rescores_and_prints_the_comparison(tmp_path, monkeypatch, capsys):
    from rlpipe.flows.rescore import main

    run_dir = make_run(tmp_path / "run")
    (tmp_path / "cli_rewards.py").write_text(
        "def reversed_reward(text, answer, example):\n    return float(text.strip() != str(answer))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main([str(run_dir), "--reward", "cli_rewards:reversed_reward"]) == 0
    out = capsys.readouterr().out
    assert "re-scored 8 rollouts" in out and "2 row(s)" in out
    assert "samples trained 6: 6 kept, 6 with their advantage's sign flipped" in out
    assert (run_dir / "rescore" / "reversed_reward" / "catalog.duckdb").is_file()
    assert main([str(run_dir), "--reward", "cli_rewards:missing"]) == 2
    assert "module 'cli_rewards' has no attribute 'missing'" in capsys.readouterr().err
    assert main([str(tmp_path / "nowhere"), "--reward", "exact_match"]) == 2
    assert "no config.json" in capsys.readouterr().err
    del sys.modules["cli_rewards"]


def test_a_run_older_than_some_tables_gets_a_working_rescore_catalog(tmp_path):
    import shutil

    import duckdb

    run_dir = make_run(tmp_path / "run")
    for table in ("decisions", "origins"):  # tables added after the run was written
        shutil.rmtree(run_dir / "tables" / table, ignore_errors=True)
    out = rescore(run_dir, wrong_is_right, "reversed")
    con = duckdb.connect(str(out / "catalog.duckdb"), read_only=True)
    assert con.sql("select count(*) from rollouts").fetchall() == [(8,)]
    assert con.sql("select count(*) from original_decisions").fetchall() == [(0,)]
    assert dict(con.sql("select status, count(*) from fates group by 1").fetchall())["trained"] == 6


def always_raises(text, answer, example):
    raise KeyError("no verifier")


def test_a_group_whose_every_reward_raised_has_no_row_left(tmp_path):
    out = rescore(make_run(tmp_path / "run"), always_raises, "raises_all")
    assert read_table(out, "groups").num_rows == 0 and read_table(out, "advantages").num_rows == 0
    con = connect([out])
    assert con.sql("select status, count(*) from fates group by 1").fetchall() == [("reward_error", 8)]
    rows = compare(out)
    assert (rows[1]["samples_dropped"], rows[2]["samples_dropped"]) == (2, 4)
    assert rows[1]["reward_errors_rescored"] == 6


def distilled_run(run_dir: Path, distill: dict) -> tuple[Path, RunConfig]:
    """make_run's run, its completions scored by a teacher: student log-probs -1 per token, the
    teacher's -0.5 and -1.5 - i/10 (completion i), under `[rl.distill]` = `distill`."""
    make_run(run_dir)
    for step in PLAN:
        rows = read_table(run_dir, "rollouts", step).to_pylist()
        for row in rows:
            i = int(row["sample_id"].rsplit(":", 1)[1])
            row |= {"completion_logprobs": [-1.0, -1.0], "teacher_logprobs": [-0.5, -1.5 - i / 10], "teacher": "t",
                    "prompt_tokens": [5, 6, 7], "completion_tokens": [8, 9 + i]}
        write_table(run_dir, "rollouts", step, rows, run_id=RUN_ID)
    data = tomllib.loads((ROOT / "configs" / "tiny.toml").read_text())
    data["task"]["options"] = OPTIONS
    data["rl"] |= {"teacher": "t", "distill": distill, "filter": {"drop_zero_variance": distill["type"] == "reward"}}
    return run_dir, validate_config(data)


@pytest.mark.parametrize("distill", [{"type": "reward", "weight": 0.5}, {"type": "advantage"}])
def test_a_distilled_runs_advantages_take_in_the_teacher_term(tmp_path, distill):
    run_dir, cfg = distilled_run(tmp_path / "run", distill)
    out = tmp_path / "out"
    rescore_run(run_dir, out, reward="wrong", env=env(), scorer=scoring_env(env(), wrong_is_right, 0.0),
                options=rollout_options(cfg.rl), seed=cfg.seed)
    plain = {row["sample_id"]: row["advantage"] for row in read_table(run_dir, "advantages").to_pylist()}
    got = read_table(out, "advantages").to_pylist()
    assert {row["sample_id"] for row in got} == set(plain)
    for row in got:
        i = int(row["sample_id"].rsplit(":", 1)[1])
        pull = (0.5 + (-0.5 - i / 10)) / 2  # mean over tokens of log p_teacher - log p_student
        # the reversed reward flips the verifier's part; pure distillation does not see the reward
        want = -plain[row["sample_id"]] + 0.5 * pull if distill["type"] == "reward" else pull
        assert row["advantage"] == pytest.approx(want, abs=1e-6), row


def test_another_teacher_rescores_the_teacher_term_and_is_named(tmp_path, capsys):
    from rlpipe.flows.rescore import main
    from rlpipe.models.presets import build_model
    from rlpipe.models.tokenizer import build_tokenizer
    from rlpipe.rollouts.distill import ModelTeacher
    from rlpipe.tasks.teacher import teacher_for

    tokenizer, folder = build_tokenizer(), tmp_path / "teacher"
    model = build_model("tiny-dense", vocab_size=len(tokenizer), seed=5)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    run_dir, cfg = distilled_run(tmp_path / "run", {"type": "advantage"})
    out = tmp_path / "out"
    rescore_run(run_dir, out, reward="env", env=env(), scorer=env(), options=rollout_options(cfg.rl), seed=cfg.seed,
                teacher=teacher_for(str(folder), cfg))
    got = {row["sample_id"]: row["advantage"] for row in read_table(out, "advantages").to_pylist()}
    rollouts = {row["sample_id"]: row for row in read_table(run_dir, "rollouts").to_pylist()}
    for sid, advantage in got.items():
        row = rollouts[sid]
        [scored] = ModelTeacher(model).logprobs([row["prompt_tokens"]], [row["completion_tokens"]])
        assert advantage == pytest.approx(sum(t + 1.0 for t in scored) / 2, abs=1e-5)  # student: -1 per token
    assert json.loads((out / "rescore.json").read_text())["teacher"] == \
        {"teacher": str(folder), "teacher_checkpoint": str(folder.resolve()), "teacher_url": None}
    # a run that was not distilled has no teacher term: refused in one line
    plain = make_run(tmp_path / "plain")
    assert main([str(plain), "--reward", "exact_match", "--teacher", str(folder)]) == 2
    assert "was not distilled" in capsys.readouterr().err
