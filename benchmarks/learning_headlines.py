"""The headlines of the learning benchmarks (bench_curriculum, bench_distill, bench_multiturn, bench_code)
in docs/BENCHMARKS.md: a summary line and per-seed tables, read from each benchmark's JSON. They
join benchmarks/headlines.py's HEADLINES when this module is imported; run_all.py takes `headline`
from here."""

from __future__ import annotations

from benchmarks.headlines import HEADLINES, headline
from benchmarks.markdown_tables import share, table


def _curve(points: list[dict]) -> str:
    """A learning curve as text: accuracy at each eval, with the completions sampled by then."""
    return ", ".join(f"{share(p['accuracy'])} @ {p['sampled']:,}" for p in points if p["accuracy"] is not None)


def _reached(point: dict | None) -> str:
    return f"{point['sampled']:,} (step {point['step']})" if point else "not reached"


def headline_distill(results: dict, ceiling: dict) -> tuple[str, list[str]]:
    seeds, target = results["seeds"], results["settings"]["target"]
    rows = [[s["seed"], share(s["sft_accuracy"]), _reached(s["rl_reached"]), _reached(s["distill_reached"]),
             share(s["rl_curve"][-1]["accuracy"]), share(s["distill_curve"][-1]["accuracy"]),
             round(s["rl_seconds"]), round(s["distill_seconds"])] for s in seeds]
    fewer = sum(bool(s["distill_reached"]) and (not s["rl_reached"]
                                                or s["distill_reached"]["sampled"] < s["rl_reached"]["sampled"])
                for s in seeds)
    summary = (f"distillation reached {target:.0%} held-out in fewer sampled completions than RL in {fewer} of "
               f"{len(seeds)} seeds")
    curves = table(["seed", "RL: accuracy @ completions sampled", "distillation: accuracy @ completions sampled"],
                   [[s["seed"], _curve(s["rl_curve"]), _curve(s["distill_curve"])] for s in seeds])
    settings = results["settings"]
    note = (f"Per seed: the demo's SFT ({settings['sft_steps']} steps), its RL phase ({settings['rl_steps']} steps) "
            "from it, and a student distilled from that RL run's last checkpoint (pure distillation, "
            "`rl.distill.type = \"advantage\"`) from the same SFT checkpoint with the same steps and batch; "
            f"greedy accuracy on {settings['eval_examples']} held-out problems every {settings['eval_every']} steps."
            + (f" {settings['note']}" if settings.get("note") else ""))
    return summary, table(["seed", "after SFT", f"RL: completions to {target:.0%}",
                           f"distillation: completions to {target:.0%}", "RL last", "distillation last",
                           "RL s", "distillation s"], rows) + ["", *curves, "", note]


def headline_multiturn(results: dict, ceiling: dict) -> tuple[str, list[str]]:
    seeds = results["seeds"]
    after = [s["rl_accuracy"] for s in seeds]
    summary = (f"held-out greedy accuracy {min(after):.1%}–{max(after):.1%} after RL over {len(seeds)} seeds "
               f"(after SFT {min(s['sft_accuracy'] for s in seeds):.1%}–{max(s['sft_accuracy'] for s in seeds):.1%})")
    rows = [[s["seed"], share(s["sft_accuracy"]), share(s["rl_accuracy"]), share(s["tool_share_last_step"]),
             _curve(s["curve"]), round(s["sft_seconds"]), round(s["rl_seconds"])] for s in seeds]
    settings = results["settings"]
    note = (f"configs/multiturn.toml: {settings['sft_steps']} SFT steps, then {settings['rl_steps']} RL steps of "
            f"whole episodes; greedy accuracy on {settings['eval_examples']} held-out problems."
            + (f" {settings['note']}" if settings.get("note") else ""))
    return summary, table(["seed", "after SFT", "after RL", "episodes calling the tool (last step)",
                           "RL curve: accuracy @ completions sampled", "SFT s", "RL s"], rows) + ["", note]


def headline_code(results: dict, ceiling: dict) -> tuple[str, list[str]]:
    seeds, settings = results["seeds"], results["settings"]
    gains = [s["gain"] for s in seeds]
    summary = (f"held-out pass-rate gain of RL over SFT {min(gains):+.3f} to {max(gains):+.3f} over {len(seeds)} seeds "
               f"(target {settings['target_gain']:+.2f} on every seed within "
               f"{settings['target_seconds'] / 60:.0f} min: {'met' if results['met'] else 'not met'})")
    rows = [[s["seed"], s["sft_reward"], s["rl_reward"], f"{s['gain']:+.3f}", share(s["sft_accuracy"]),
             share(s["rl_accuracy"]), ", ".join(f"{p['reward_mean']:.3f} @ {p['sampled']:,}" for p in s["curve"]),
             round(s["sft_seconds"]), round(s["rl_seconds"]),
             round(s["cpu_seconds"]) if "cpu_seconds" in s else "–"] for s in seeds]
    note = (f"configs/code.toml: {settings['sft_steps']} SFT steps, then {settings['rl_steps']} RL steps judged by "
            "the hidden tests in the sandbox; pass rate = mean share of a held-out task's hidden tests passed "
            "(greedy), all tests = share of tasks passing every one; CPU s = both phases' CPU seconds (the "
            "process and its sandboxes)." + (f" {settings['note']}" if settings.get("note") else ""))
    return summary, table(["seed", "pass rate after SFT", "after RL", "gain", "all tests after SFT", "after RL",
                           "RL curve: pass rate @ completions sampled", "SFT s", "RL s", "CPU s"], rows) + ["", note]


def headline_curriculum(results: dict, ceiling: dict) -> tuple[str, list[str]]:
    runs = results["runs"]
    rows = [[r["run"], f"{r['zero_variance_share']:.1%}", f"{r['sampled_per_trained']:.2f}", f"{r['sampled']:,}",
             f"{r['trained']:,}", f"{r['skipped_prompts']:,}", r["accuracy"], f"{r['seconds']:.0f}"] for r in runs]
    summary = "zero-variance share of sampled completions " + ", ".join(
        f"{r['zero_variance_share']:.0%} ({r['run']})" for r in runs)
    settings = results["settings"]
    note = (f"{settings['rl_steps']} RL steps from one SFT checkpoint ({settings['sft_steps']} SFT steps); "
            f"the curriculum runs re-test resting prompts with probability {settings['retest']:g}"
            + (f"; keyed by class, a window of {settings['window']}, a solved rate of {settings['solved_rate']:g}"
               f" and reads {settings.get('reads', 0):g}"
               if "window" in settings else "") + ". Targets with "
            f"the curriculum: at most {settings['target_zero_variance_share']:.0%} zero-variance, held-out accuracy "
            f"at least {settings['target_accuracy']:.0%}, RL seconds not above the run without it."
            + (f" {settings['note']}" if settings.get("note") else ""))
    return summary, table(["run (rl.curriculum.type, key, rl.prompt_pool)", "zero-variance share", "sampled per trained",
                           "sampled completions", "trained completions", "prompts skipped", "held-out accuracy",
                           "RL seconds"], rows) + ["", note]



LEARNING = {"curriculum": headline_curriculum, "distill": headline_distill, "multiturn": headline_multiturn, "code": headline_code}
HEADLINES.update(LEARNING)
__all__ = ["LEARNING", "headline"]
