"""On-policy distillation through `rlpipe run`: a student of the tiny preset distilled from a
teacher of its own tokenizer moves toward it (the reverse KL of its samples falls), with the
teacher's log-probs in the rollouts table; the same run's sampled evals answer pass@k."""

from __future__ import annotations

from pathlib import Path

import pytest
from rlpipe.storage.queries import run_canned, run_sql

from tests import warm_cli
from tests.integration.test_every_loss import ROOT, cli, env_for

pytestmark = pytest.mark.slow


def sharp_teacher(folder: Path) -> None:
    """A tiny-preset model of another seed whose logits are 4 times as large: far from the
    student's near-uniform start, with the same tokenizer."""
    import torch
    from rlpipe.tasks.setup import make_model_and_tokenizer

    model, tokenizer = make_model_and_tokenizer("tiny-dense", "", {}, seed=1)
    with torch.no_grad():
        model.model.norm.weight.mul_(4.0)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def test_distillation_moves_the_student_toward_the_teacher(tmp_path, prefect_api_url):
    sharp_teacher(tmp_path / "teacher")
    runs = tmp_path / "runs"
    settings = [f"runs_root={runs}", "run_name=d", "flow=rl", "rl.steps=10", "rl.eval_every=0",
                f"rl.teacher={tmp_path / 'teacher'}", "rl.distill.type=advantage",
                "rl.filter.drop_zero_variance=false", "rl.optim.lr=3e-3", "task.eval_examples=4",
                "eval.samples=3", "threads=1"]
    done = warm_cli.run(cli("run", str(ROOT / "configs" / "tiny.toml"), *[p for s in settings for p in ("--set", s)]),
                        cwd=tmp_path, env=env_for(tmp_path, prefect_api_url), capture_output=True, text=True,
                        timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = runs / "d"
    kl = run_sql([run_dir], "select step, avg(s - t) as kl, count(*) as n from (select step, "
                            "unnest(completion_logprobs) as s, unnest(teacher_logprobs) as t from rollouts) "
                            "group by step order by step").to_pylist()
    assert all(row["n"] > 0 for row in kl) and len(kl) >= 4
    first, last = [row["kl"] for row in kl[:2]], [row["kl"] for row in kl[-2:]]
    assert sum(last) / 2 < 0.9 * sum(first) / 2, kl  # measured: 0.80 over the first two, 0.63 over the last
    passes = run_canned([run_dir], "pass_at_k_by_step").to_pylist()
    assert {row["step"] for row in passes} == {0, 10} and {row["k"] for row in passes} == {1, 2, 3}


def test_a_teacher_served_over_http_scores_the_run_and_is_named_in_its_rows(tmp_path, prefect_api_url):
    """The same teacher behind `rlpipe serve` (a real socket; rl.distill.url): every row holds
    the log-probs the in-process teacher gives its tokens, and names the teacher and its server."""
    from rlpipe.engines.serve_app import build_app
    from rlpipe.engines.serve_generation import ServedModel
    from rlpipe.engines.torch_engine import TorchEngine
    from rlpipe.models.loading import load_model
    from rlpipe.models.tokenizer import load_tokenizer
    from rlpipe.rollouts.distill import ModelTeacher

    from tests.serve_sockets import serving

    folder = tmp_path / "teacher"
    sharp_teacher(folder)
    model = load_model(folder).eval()
    app = build_app(ServedModel(folder, load_tokenizer(folder), TorchEngine(model), 0), served_model_names=["sharp"])
    runs = tmp_path / "runs"
    with serving(app) as (host, port):
        url = f"http://{host}:{port}"
        settings = [f"runs_root={runs}", "run_name=h", "flow=rl", "rl.steps=2", "rl.eval_every=0",
                    f"rl.distill.url={url}", "rl.distill.type=advantage", "rl.filter.drop_zero_variance=false",
                    "task.eval_examples=2", "threads=1"]
        done = warm_cli.run(cli("run", str(ROOT / "configs" / "tiny.toml"),
                                *[p for s in settings for p in ("--set", s)]),
                            cwd=tmp_path, env=env_for(tmp_path, prefect_api_url), capture_output=True, text=True,
                            timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = run_sql([runs / "h"], "select prompt_tokens, completion_tokens, teacher_logprobs, teacher, "
                                 "teacher_checkpoint, teacher_url from rollouts").to_pylist()
    assert rows and {(r["teacher"], r["teacher_checkpoint"], r["teacher_url"]) for r in rows} == \
        {("sharp", str(folder), url)}
    want = ModelTeacher(model).logprobs([r["prompt_tokens"] for r in rows], [r["completion_tokens"] for r in rows])
    for row, expected in zip(rows, want, strict=True):
        assert row["teacher_logprobs"] == pytest.approx(expected, abs=1e-4)
    steps = run_canned([runs / "h"], "teacher_by_step").to_pylist()  # a step that sampled nothing has no row
    sampled = run_sql([runs / "h"], "select distinct step from rollouts order by step").column("step").to_pylist()
    assert [(s["step"], s["teacher"], s["teacher_url"]) for s in steps] == [(k, "sharp", url) for k in sampled]
    assert sum(s["samples"] for s in steps) == sum(len(r["completion_tokens"]) > 0 for r in rows)
