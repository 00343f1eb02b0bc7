"""The multi-seed learning benchmarks (distillation vs RL on the demo, the calculator agent): their
configs validate, a learning curve reads back from a run's tables, the headline tables say what
the JSON holds, and the generated document names what has not been measured with its command."""

from __future__ import annotations

import argparse

import pytest
from rlpipe.storage.writer import write_table
from rlpipe.tasks.config import validate_config

from benchmarks.bench_distill import phase_configs
from benchmarks.learning_headlines import headline
from benchmarks.run_all import BENCHMARKS, not_measured, render
from benchmarks.seed_curves import eval_curve, first_reaching


def test_the_distillation_runs_share_the_demo_and_differ_in_the_teacher_and_completions_per_prompt(tmp_path):
    args = argparse.Namespace(sft_steps=7, rl_steps=5, eval_every=2, eval_examples=30, distill_group_size=2)
    configs = phase_configs(tmp_path, 3, args)
    configs["distill"]["rl"]["teacher"] = str(tmp_path / "teacher")
    sft, rl, distill = (validate_config(configs[k]) for k in ("sft", "rl", "distill"))
    assert {c.seed for c in (sft, rl, distill)} == {3} and sft.sft.steps == 7
    assert (rl.rl.steps, rl.rl.eval_every, rl.task.eval_examples, rl.tracking.enabled) == (5, 2, 30, False)
    assert distill.rl.distill.type == "advantage" and not distill.rl.filter.drop_zero_variance
    assert rl.rl.distill.type == "none" and rl.rl.prompts_per_step == distill.rl.prompts_per_step
    assert (rl.rl.group_size, distill.rl.group_size) == (8, 2)  # the demo's, and the student's


def test_a_curve_counts_the_completions_sampled_by_each_eval(tmp_path):
    def rollout(step, i):
        return dict(policy_version=0, env="e", example_id=f"x{i}", group_id="g", sample_id=f"{step}-{i}",
                    attempt=1, n_prompt_tokens=1, n_completion_tokens=1)

    def evaluated(step, correct):
        return [dict(env="e", example_id=f"x{i}", reward=float(ok), correct=ok) for i, ok in enumerate(correct)]

    for step, n in [(1, 4), (2, 6), (3, 4)]:
        write_table(tmp_path, "rollouts", step, [rollout(step, i) for i in range(n)], run_id="r")
    for step, correct in [(0, [False, False]), (2, [True, False]), (3, [True, True])]:
        write_table(tmp_path, "evals", step, evaluated(step, correct), run_id="r")
    curve = eval_curve(tmp_path)
    assert [(p["step"], p["sampled"], p["accuracy"], p["reward_mean"]) for p in curve] == \
        [(0, 0, 0.0, 0.0), (2, 10, 0.5, 0.5), (3, 14, 1.0, 1.0)]
    assert first_reaching(curve, 0.5)["step"] == 2 and first_reaching(curve, 1.01) is None


def test_the_headlines_read_the_benchmarks_json():
    point = lambda step, sampled, acc: {"step": step, "sampled": sampled, "accuracy": acc}  # noqa: E731
    distill = {"settings": {"sft_steps": 700, "rl_steps": 120, "eval_every": 10, "eval_examples": 1000, "target": 0.95},
               "seeds": [{"seed": s, "sft_accuracy": 0.5, "rl_seconds": 10.0, "distill_seconds": 9.0,
                          "rl_curve": [point(0, 0, 0.5), point(10, 900, 0.96)],
                          "distill_curve": [point(0, 0, 0.5), point(10, 700, 0.97) if s else point(10, 700, 0.9)],
                          "rl_reached": point(10, 900, 0.96), "distill_reached": point(10, 700, 0.97) if s else None}
                         for s in range(3)]}
    summary, lines = headline("distill", {"results": distill}, {})
    assert summary == "distillation reached 95% held-out in fewer sampled completions than RL in 2 of 3 seeds"
    assert any("| 0 | 50.0% | 900 (step 10) | not reached |" in line for line in lines)
    multiturn = {"settings": {"sft_steps": 400, "rl_steps": 40, "eval_examples": 200},
                 "seeds": [{"seed": s, "sft_accuracy": 0.0, "rl_accuracy": 0.7 + s / 100, "tool_share_last_step": 0.99,
                            "curve": [point(0, 0, 0.0), point(40, 5000, 0.7)], "sft_seconds": 100.0,
                            "rl_seconds": 400.0} for s in range(3)]}
    summary, lines = headline("multiturn", {"results": multiturn}, {})
    assert summary == "held-out greedy accuracy 70.0%–72.0% after RL over 3 seeds (after SFT 0.0%–0.0%)"
    assert any("0.0% @ 0, 70.0% @ 5,000" in line for line in lines)
    code = {"settings": {"sft_steps": 300, "rl_steps": 40, "target_gain": 0.1, "target_seconds": 900}, "met": False,
            "seeds": [{"seed": s, "sft_reward": 0.5, "rl_reward": 0.55 + s / 20, "gain": 0.05 + s / 20,
                       "sft_accuracy": 0.4, "rl_accuracy": 0.5, "sft_seconds": 300.0, "rl_seconds": 400.0, "cpu_seconds": 650.0,
                       "curve": [{"step": 0, "sampled": 0, "accuracy": 0.4, "reward_mean": 0.5}]} for s in range(3)]}
    summary, lines = headline("code", {"results": code}, {})
    assert summary == ("held-out pass-rate gain of RL over SFT +0.050 to +0.150 over 3 seeds "
                       "(target +0.10 on every seed within 15 min: not met)")
    assert any("| 2 | 0.5 | 0.65 | +0.150 | 40.0% | 50.0% | 0.500 @ 0 | 300 | 400 | 650 |" in line for line in lines)


def test_the_document_names_each_benchmark_not_measured_with_its_command():
    report = {"machine": {"platform": "p", "python": "3", "torch": "2", "cpus": 2, "torch_threads": 2},
              "ceiling_gflops": {"float32": 1.0}, "benchmarks": {}}
    text = render(report)
    assert "## Not measured yet" in text
    for name in BENCHMARKS:
        assert f"`python -m benchmarks.bench_{name}`" in text
    assert not_measured([]) == []


def test_the_distillation_curves_are_drawn_side_by_side():
    import xml.etree.ElementTree as ET

    from benchmarks.bench_distill import curves_svg

    point = lambda sampled, acc: {"step": 0, "sampled": sampled, "accuracy": acc}  # noqa: E731
    report = {"settings": {"target": 0.95}, "seeds": [
        {"seed": s, "rl_curve": [point(0, 0.5), point(4000, 0.97)], "distill_curve": [point(0, 0.5), point(800, 0.96)]}
        for s in range(3)]}
    svg = ET.fromstring(curves_svg(report))
    lines = [e for e in svg.iter("{http://www.w3.org/2000/svg}polyline")]
    texts = [e.text for e in svg.iter("{http://www.w3.org/2000/svg}text")]
    assert len(lines) == 2 * (3 + 1)  # per panel: a line per seed and the target
    assert "RL from SFT" in texts and "distilled from the RL checkpoint" in texts and "4,000" in texts
    last = lines[-1].get("points").split()  # the third seed's distillation line ends at x = 800 of 4,000
    assert float(last[-1].split(",")[0]) == pytest.approx(360 + 48 + 800 / 4000 * (360 - 96), abs=0.1)
