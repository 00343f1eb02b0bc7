"""The headline of each benchmark in docs/BENCHMARKS.md: a one-line summary and a table with the
ratio to its anchor (packed/padded, chunked/full memory, engine/generate, rlpipe/TRL step time,
...), read from the benchmark's own JSON. benchmarks/run_all.py runs the benchmarks and renders
the document around these.
"""

from __future__ import annotations

from benchmarks.markdown_tables import fmt, ratio, share, table

# Each headline function: (results, ceiling GFLOP/s by dtype) -> (one-line summary, table lines).
# They read the benchmark's own JSON; a key they do not find leaves only the raw table.


def inactive_expert_parameters(preset: str) -> int:
    """Expert weights a token does not use: experts x (1 - top_k / n_experts); 0 for dense."""
    from rlpipe.models.presets import build_model

    model = build_model(preset, vocab_size=128, seed=0)
    n_experts = getattr(model.config, "num_experts", 0) or 0
    if not n_experts:
        return 0
    experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    return round(experts * (1 - model.config.num_experts_per_tok / n_experts))


def headline_packing(results: dict, ceiling: dict) -> tuple[str, list[str]]:
    rows, speedups, inactive = [], [], {}
    for r in results["results"]:
        rate = ceiling["bfloat16" if r["precision"].startswith("bf16") else "float32"] * 1e9
        if r["preset"] not in inactive:
            inactive[r["preset"]] = inactive_expert_parameters(r["preset"])
        active = r["params"] - inactive[r["preset"]]
        flops = 6 * active * r["real_tokens"]
        speedups.append(r["speedup"])
        rows.append([r["preset"], r["precision"], f"{active / 1e6:.2f}M" + (
                     f" of {r['params'] / 1e6:.2f}M" if active != r["params"] else ""), r["real_tokens"],
                     round(r["packed_tok_s"]), round(r["padded_tok_s"]), ratio(r["speedup"]),
                     share(flops / r["packed_s"] / rate), share(flops / r["padded_s"] / rate)])
    limit = 1 / (1 - results["padding_fraction"]) if results.get("padding_fraction") is not None else None
    summary = (f"packed/padded real tokens/s {min(speedups):.2f}–{max(speedups):.2f}×"
               + (f" (dropping the padding alone: {limit:.2f}×; not a limit, the kernels differ)" if limit else ""))
    lines = table(["preset", "precision", "params (active)", "real tokens", "packed tok/s", "padded tok/s",
                   "packed/padded", "MFU packed", "MFU padded"], rows)
    note = ("MFU = 6 · parameters · real tokens / step time / the matmul rate of the row's precision "
            "(MoE: the parameters a token uses, experts × top-k / experts).")
    if limit:
        note += (f" The padded batch is {results['padding_fraction']:.0%} padding: at an equal cost per token, "
                 f"dropping it would give {limit:.2f}×. That is not a ceiling: the two sides do not run the "
                 "same kernels. The padded baseline runs transformers' sdpa over the whole [batch, max_len] block "
                 "with a materialised mask, the packed side varlen attention padded only per length bucket, so "
                 "a packed token is also cheaper than a padded batch's real token and ratios above "
                 f"{limit:.2f}× measure that difference too.")
    return summary, lines + ["", note]


def headline_logprobs(results: dict, ceiling: dict) -> tuple[str, list[str]]:
    ok = [r for r in results["results"] if "error" not in r]
    rows_by = {(r["mode"], r["tokens"], r["method"]): r for r in ok if r.get("dtype", "float32") == "float32"}
    rows, headline = [], None
    for mode, tokens in sorted({(m, t) for m, t, meth in rows_by if meth == "full"},
                               key=lambda k: (k[0], -k[1])):
        full, chunked = rows_by.get((mode, tokens, "full")), rows_by.get((mode, tokens, "chunked"))
        mem = chunked["peak_extra_mib"] / full["peak_extra_mib"] if full and chunked else None
        if mem is not None and headline is None:
            headline = f"chunked/full peak memory ({mode}, T={tokens:,}) {mem:.3f}×"
        rows.append([mode, f"{tokens:,}", full and full["peak_extra_mib"], chunked and chunked["peak_extra_mib"],
                     ratio(mem) if mem is not None and mem >= 0.01 else (mem and f"{mem:.3f}×"),
                     full and full["seconds_median"], chunked and chunked["seconds_median"]])
    lines = table(["mode", "T", "full: extra MiB", "chunked: extra MiB", "chunked/full memory",
                   "full s", "chunked s"], rows)
    # fwd + bwd of the previous version (old) vs the current eager (chunked) and compiled kernels
    by_dtype = {(r.get("dtype", "float32"), r["tokens"], r["method"]): r for r in ok if r["mode"] == "train"}
    speed, speedups = [], []
    for dtype, tokens in sorted({(d, t) for d, t, m in by_dtype if m == "old"}):
        old, new, comp = (by_dtype.get((dtype, tokens, m)) for m in ("old", "chunked", "compiled"))
        up = old["seconds_median"] / new["seconds_median"] if new else None
        if up:
            speedups.append(f"{dtype} {up:.2f}×")
        speed.append([dtype, f"{tokens:,}", old["seconds_median"], new and new["seconds_median"],
                      comp and comp["seconds_median"], ratio(up),
                      comp and ratio(old["seconds_median"] / comp["seconds_median"]), comp and comp.get("compile_s"),
                      old["peak_extra_mib"], new and new["peak_extra_mib"], comp and comp["peak_extra_mib"]])
    if speed:
        lines += ["", "Forward + backward, previous version (old) vs now: eager kernels (what `kernels=\"auto\"` "
                  "runs on the CPU) and compiled ones (what it runs on CUDA with `train.compile`; compile time apart):", ""]
        lines += table(["dtype", "T", "old s", "eager s", "compiled s", "old/eager", "old/compiled",
                        "compile s", "old extra MiB", "eager extra MiB", "compiled extra MiB"], speed)
        headline = (headline or "") + "; fwd+bwd old/new " + ", ".join(speedups)
    return headline or "see table", lines


def headline_engine(results: dict, ceiling: dict) -> tuple[str, list[str]]:
    by = {(r["scenario"], r["engine"]): r for r in results["results"]}
    rows = []
    for scenario, speedup in results["speedup_vs_generate"].items():
        engine, generate = by[(scenario, "torch_engine")], by[(scenario, "hf_generate")]
        rows.append([scenario, engine["sequences"], round(engine["tokens_per_s"]), round(generate["tokens_per_s"]),
                     ratio(speedup), engine["ms_per_decode_step"], generate["ms_per_decode_step"]])
    summary = "engine/generate tokens/s " + ", ".join(
        f"{k} {v:.2f}×" for k, v in results["speedup_vs_generate"].items())
    return summary, table(["scenario", "sequences", "engine tok/s", "generate tok/s", "engine/generate",
                           "engine ms/decode step", "generate ms/decode step"], rows)


def headline_serve(results: dict, ceiling: dict) -> tuple[str, list[str]]:
    res = results["results"]
    threads = {n: r.get("threads_total") for n, r in res.items()}
    rows = [[name.replace("_", " "), threads[name], round(r["tokens_per_s"]), round(r["tokens_per_s_best"]),
             ratio(r["vs_in_process"])] for name, r in res.items()]
    sync_ms = results["sync_latency_s"]["median"] * 1000
    best = max((r["vs_in_process"], n) for n, r in res.items() if n != "in_process")
    summary = (f"best HTTP setup ({best[1].replace('_', ' ')}, {threads[best[1]] or '?'} torch threads in all) "
               f"{best[0]:.2f}× in-process tokens/s ({threads['in_process'] or '?'} thread(s)); sync {sync_ms:.0f} ms")
    lines = table(["setup", "torch threads in all", "tok/s (median)", "tok/s (best run)", "vs in-process"], rows)
    return summary, lines + ["", "Each server process gets max(1, threads // 2) torch threads: at --threads 1 the "
                             "two servers use two cores between them against the in-process engine's one, so "
                             "their ratio is not a like-for-like speed-up of HTTP serving.",
                             "", f"Weight sync (POST /update_weights_from_disk) median: {sync_ms:.0f} ms."]


def headline_storage(results: dict, ceiling: dict) -> tuple[str, list[str]]:
    rows = [["rollout rows written", f"{results['rows']:,} over {results['steps']} steps", None],
            ["write time, all tables", f"{results['write_seconds_total']:.1f} s "
             f"({results['rows'] / results['write_seconds_total']:,.0f} rows/s)", None],
            ["on disk (zstd Parquet)", f"{results['disk_mb_total']:.1f} MB", None]]
    slowest = 0.0
    for name, q in results["queries"].items():
        slowest = max(slowest, q["seconds_first"])
        rows.append([f"query `{name}` (first / best; catalog.duckdb first)",
                     f"{q['seconds_first']:.3f} / {q['seconds_best']:.3f} s; {q['catalog_seconds_first']:.3f} s",
                     "< 1 s: " + ("yes" if q["seconds_first"] < 1 else "no")])
    summary = (f"{results['rows']:,} rows written in {results['write_seconds_total']:.0f} s "
               f"({results['disk_mb_total']:.0f} MB); slowest canned query {slowest:.2f} s (target < 1 s)")
    if (long := results.get("long_run")) is not None:  # many steps, compacted: target < 0.5 s a query
        rows.append([f"long run: rollout rows over steps, files after compaction (every {long['compact_every']})",
                     f"{long['rows']:,} over {long['steps']:,} steps, {sum(long['files'].values()):,} files, "
                     f"compaction {long['compact_seconds']:.1f} s", None])
        worst = 0.0
        for name, q in long["queries"].items():
            worst = max(worst, q["seconds_first"])
            rows.append([f"long run: query `{name}` (first / best)", f"{q['seconds_first']:.3f} / "
                         f"{q['seconds_best']:.3f} s", "< 0.5 s: " + ("yes" if q["seconds_first"] < 0.5 else "no")])
        summary += f"; {long['steps']:,} steps: slowest {worst:.2f} s (target < 0.5 s)"
    return summary, table(["measure", "value", "target"], rows)


def headline_bytes(results: dict, ceiling: dict) -> tuple[str, list[str]]:
    per, s = results["bytes_per_generated_token"], results["settings"]
    rows = [[f"`{name}`", f"{results['bytes'][name] / 2**20:.1f} MB", f"{value:.2f}"] for name, value in per.items()]
    rows.append(["`train_tokens` per trained token (prompt + completion)", "", f"{results['bytes_per_trained_token']['train_tokens']:.2f}"])
    rows.append([f"Qwen3-0.6B checkpoint every {s['checkpoint_every']} steps, per trained token",
                 f"{results['checkpoint_qwen3_0_6b']['total'] / 2**30:.2f} GiB",
                 f"{results['checkpoint_bytes_per_trained_token']:,} ({results['checkpoint_weights_only_bytes_per_trained_token']:,} "
                 "without optimizer state)"])
    summary = (f"rollouts {per['rollouts']:.1f} B / generated token vs JSONL {per['jsonl']:.1f} "
               f"(gzip {per['jsonl_gzip']:.1f}); a kept Qwen3-0.6B checkpoint {results['checkpoint_bytes_per_trained_token']:,.0f} "
               "B / trained token")
    return summary, table(["data", "size", "bytes per generated token"], rows)


def rl_step_mode(report: dict, label: str) -> list[str]:
    """One configuration's stage table and its outside-share breakdown."""
    out, step = report["outside"], report["step"]
    ms = lambda seconds: f"{seconds * 1000:.1f}"  # noqa: E731
    rows = [[stage, r["steps"], ms(r["stopwatch_median_s"]), ms(r["function_median_s"]), ms(r["outside_median_s"]),
             share(r["outside_median_s"] / r["stopwatch_median_s"]) if r["stopwatch_median_s"] else None]
            for stage, r in report["stages"].items()]
    lines = [f"### {label}", "", f"Step wall time: median {step['wall_median_s']:.3f} s, of which "
             f"{step['function_median_s']:.3f} s inside the stage functions; outside, median per step: "
             f"{ms(out['median_s_per_step'])} ms.", ""]
    lines += table(["stage", "steps", "flow's stopwatch ms (median)", "stage function ms (median)",
                    "outside ms (median)", "outside share"], rows)
    lines += ["", *table(["outside the stage functions", "share of step wall time"], [
        ["all of it, all steps", share(out["share"])],
        [f"all of it, the {out['plain_steps']} steps without eval/checkpoint/sync", share(out["share_plain_steps"])],
        ["Parquet writes and reads (queued on the background writer)", share(out["parquet_share"])],
        ["MLflow (metrics, checkpoint registration)", share(out["mlflow_share"])],
        ["Prefect task runs + flow bookkeeping", share(out["prefect_and_flow_share"])],
        ["target (the issue)", f"≤ {out['target_share']:.0%}"]]), ""]
    return lines


def headline_rl_step(results: dict, ceiling: dict) -> tuple[str, list[str]]:
    settings = results["settings"]
    modes = results.get("modes") or {"task_runs": results}
    labels = settings.get("modes", {"task_runs": "tracking.prefect_task_runs = true"})
    summary = "outside the stage functions: " + ", ".join(
        f"{share(report['outside']['share'])} with {labels[mode]}" for mode, report in modes.items()
    ) + f" (target ≤ {results['outside']['target_share']:.0%})"
    lines = [f"{settings['rl_steps']} RL steps of {settings['prompts_per_step']} prompts × {settings['group_size']} "
             f"completions ({settings['parameters'] / 1e6:.2f}M parameters, {settings['max_new_tokens']} new tokens), "
             f"torch threads {settings['torch_threads']}, the same SFT start, run once per configuration one after "
             "the other. The flow's stopwatch wraps the stage call (a Prefect task run or a plain call) and the "
             "stage's table writes; the stage function is the pure computation inside it. Per stage, outside = "
             "stopwatch − function. The demo runs with `prefect_task_runs = false`.", ""]
    for mode, report in modes.items():
        lines += rl_step_mode(report, labels[mode])
    return summary, lines


def pm(summary: dict, figure: str) -> str | None:
    """'mean ± SE' of a common-evaluator figure, or None when it is missing."""
    if figure not in summary:
        return None
    return f"{summary[figure]:.3f} ± {summary[figure + '_se']:.3f}"


def headline_trl(results: dict, ceiling: dict) -> tuple[str, list[str]]:
    settings, anchor = results["settings"], results["anchor"]
    rows, parts, verdicts = [], [], []
    for precision, run in results["runs"].items():
        for side in ("trl", "rlpipe"):
            r = run[side]
            name = f"{'TRL ' + r.get('version', '') if side == 'trl' else 'rlpipe'} ({precision})"
            if "error" in r:
                rows.append([name, f"failed: {r['error'][:120]}", None, None, None, None])
                continue
            final = r.get("final_eval", {})
            gain = final.get("gain_over_start", {}).get("greedy_accuracy")
            rows.append([name, r["seconds_per_step"], r.get("seconds_per_step_functions_only"),
                         pm(final, "greedy_accuracy"), pm(final, "sampled_reward"),
                         f"{gain['delta']:+.3f} ± {gain['se']:.3f}" if gain else None])
        c = run["comparison"]
        if c:
            v = c.get("final_eval")
            rows.append([f"**rlpipe/TRL ({precision})**", ratio(c["step_time_ratio"]), None,
                         f"{v['greedy_accuracy']['delta']:+.3f} ± {v['greedy_accuracy']['se']:.3f}" if v else None,
                         f"{v['sampled_reward']['delta']:+.3f} ± {v['sampled_reward']['se']:.3f}" if v else None,
                         None])
            parts.append(f"{precision} {c['step_time_ratio']:.2f}×")
            if v:
                ci = v["greedy_accuracy"]["ci90"]
                verdicts.append(f"{precision}: {v['verdict']} (greedy accuracy {v['greedy_accuracy']['delta']:+.3f}, "
                                f"90% CI [{ci[0]:+.3f}, {ci[1]:+.3f}], margin {v['margin']})")
        elif "error" in run["trl"]:
            parts.append(f"{precision}: TRL failed")
    summary = ("rlpipe/TRL seconds per step " + ", ".join(parts) + " (target ≤ 0.5×); reward non-inferiority: "
               + (", ".join(verdicts) or "not measured"))
    for precision, reason in settings.get("precisions_skipped", {}).items():
        summary += f"; {precision}: {reason}"
    start = results["start"].get("final_eval") or {}
    lines = [f"{settings['preset']} ({settings['parameters'] / 1e6:.2f}M parameters), "
             f"{settings['prompts_per_step']} prompts × {settings['group_size']} completions, ≤ "
             f"{settings['max_new_tokens']} new tokens, {settings['steps']} steps at lr {settings['lr']:g} from the "
             f"same SFT checkpoint (greedy accuracy {pm(start, 'greedy_accuracy') or fmt(results['start']['eval_accuracy'])}), "
             f"seeds {settings.get('seeds', [0])} per side, interleaved seed by seed (one process per side and seed), "
             f"the same prompts at each step on both sides, gradient checkpointing off on both sides, "
             f"torch threads {settings['torch_threads']}, CPU. rlpipe runs its `rl` flow with a Prefect task run per "
             f"stage. Anchor ({anchor['source']}): TRL {anchor['trl_version']}, {anchor['model']}, {anchor['completions']} "
             f"completions × {anchor['completion_tokens']} tokens: {anchor['seconds_per_step'][0]}–"
             f"{anchor['seconds_per_step'][1]} s per step.", ""]
    lines += table(["", "s / step (median, all seeds)", "stage functions only", "greedy accuracy after",
                    "sampled reward after", "greedy gain over start"], rows)
    stages = [[f"{side} ({precision})", *(run[side]["stage_function_seconds"].get(k) for k in ("generate", "train"))]
              for precision, run in results["runs"].items() for side in ("trl", "rlpipe")
              if "stage_function_seconds" in run.get(side, {})]
    if stages:
        lines += ["", "Where a step goes (seconds, median over steps 2 .. N-1 of the first seed; TRL: its "
                  "`_generate_and_score_completions` against the rest of the step):", "",
                  *table(["side", "generate + score", "train"], stages),
                  "", "Where the speed-up comes from, by design choice (each measured on its own above): "
                  "the engine (generation: rlpipe's TorchEngine decodes through a lean Qwen3 forward over a "
                  "preallocated KV cache, see `engine`, against transformers `generate`); packing (training: "
                  "no padding tokens through the model, see `packing`; TRL pads every completion to the "
                  "longest and every prompt to the longest); shared prefixes (each group's prompt runs once "
                  "per micro-batch, not once per completion). Gradient checkpointing is off on both sides, "
                  "both compute the entropy, and both take one forward and one backward per step.",
                  "", "The update itself is the same on both sides: `python -m benchmarks.bench_trl_grads` feeds "
                  "identical rollouts to rlpipe's `forward_backward` and TRL's `_compute_loss`, step by step from "
                  "the same SFT start, and measured (fp32, 5 steps) gradient cosine 1 − <1e-9, norm "
                  "ratio 1 ± 2e-7, the two models' weights 7e-7 apart after 5 AdamW steps (not growing); both "
                  "sample from the same distribution (same prompt tokens, EOS ids, temperature/top-p/top-k; "
                  "engine vs trainer log-probs within 1e-5). A reward difference between the sides therefore "
                  "comes from the rollouts each side happens to draw: run-to-run noise, which the seeds and the "
                  "confidence interval above measure."]
    final = settings.get("final_eval", {})
    lines += ["", f"After the last step one evaluator scores every final model alike ({final.get('examples')} "
              f"held-out prompts, fp32, rlpipe's engine): greedy accuracy, and the mean reward of "
              f"{final.get('samples_per_prompt')} temperature-1 samples per prompt. ± is a standard error covering "
              "prompts and seeds (the larger of the two); rlpipe − TRL is paired by seed and prompt. Non-inferiority: "
              f"rlpipe is 'non-inferior' when the one-sided 95% lower bound of the greedy-accuracy difference clears "
              f"−{settings.get('non_inferiority', {}).get('margin', 0.02)} (the 90% CI is shown), 'inferior' when the "
              "upper bound is below it, else 'inconclusive'."]
    return summary, lines


def headline_losses(results: dict, ceiling: dict) -> tuple[str, list[str]]:
    settings, rows = results["settings"], results["results"]
    gains = [r["gain_mean"] for r in rows]
    summary = (f"training-reward gain over {settings['steps']} steps, every loss: {min(gains):+.2f} to "
               f"{max(gains):+.2f} ({settings['task']})")
    lines = table(["loss", "reward, first 5 steps", "last 5 steps", "gain (mean over seeds)", "gain range",
                   "entropy first 5 → last 5", "greedy accuracy gain"],
                  [[r["variant"], r["reward_first"], r["reward_last"], f"{r['gain_mean']:+.3f}",
                    f"{r['gain_min']:+.3f} .. {r['gain_max']:+.3f}",
                    f"{r['entropy_first']:.2f} → {r['entropy_last']:.2f}" if r["entropy_last"] is not None else None,
                    f"{r['accuracy_gain_mean']:+.3f}" if r.get("accuracy_gain_mean") is not None else None]
                   for r in rows])
    return summary, lines + ["", f"{settings['seeds']} seed(s), {settings['prompts_per_step']} prompts × "
                             f"{settings['group_size']} completions per step, lr {settings['lr']:g}, start: "
                             f"{settings['start']}. On-policy the ratio-based losses start at ratio 1, where "
                             "ppo_clip and cispo give reinforce's gradient exactly (the engine samples with the "
                             "trainer's fp32 weights): equal rows are expected, not a bug."]


def headline_async(results: dict, ceiling: dict) -> tuple[str, list[str]]:
    rows = [[r["engine"], r["k"], f"{r['seconds']:.1f}", f"{r['tokens_per_second']:.0f}", f"{r['speedup']:.2f}",
             r["accuracy"]] for r in results["runs"]]
    best = max((r for r in results["runs"] if r["k"] == 1), key=lambda r: r["speedup"], default=None)
    summary = f"k = 1 end to end ×{best['speedup']:.2f} over k = 0 ({best['engine']})" if best else "no k = 1 run"
    return summary, table(["engine", "k", "RL seconds", "completion tok/s", "× k=0", "final accuracy"], rows)


def headline_distributed(results: dict, ceiling: dict) -> tuple[str, list[str]]:
    runs = {r["setting"]: r for r in results["runs"]}
    rows = [[r["setting"], f"{r['tokens_per_second']:,.0f}", f"{r['vs_1_process_1_thread']:.2f}×",
             " ".join(f"{x:,.0f}" for x in r["all"])] for r in results["runs"]]
    ddp, fsdp = runs["2 ranks DDP, 1 thread each"], runs["2 ranks FSDP2, 1 thread each"]
    summary = (f"2 ranks ×{ddp['vs_1_process_1_thread']:.2f} (DDP), ×{fsdp['vs_1_process_1_thread']:.2f} (FSDP2) "
               "the real tok/s of one 1-thread process (medians on a CPU with 2 cores: see the spread)")
    load = results["machine"].get("loadavg")
    note = ("Two ranks share the machine's 2 cores (other work ran beside them"
            + (f"; load average {load[0]:.1f} at the end" if load else "") + "): they can at best match one "
            "process using both cores, so this measures the distributed path's overhead (batch broadcast, "
            "gradient all-reduce over gloo, filler micro-batches), not the scaling of one GPU per rank. A "
            "2-thread process suffers most when other processes take a core (its threads wait for each "
            "other). "
            f"{results['settings']['sequences']} sequences (lengths 32-256) per step, {results['settings']['preset']}, "
            f"micro-batches of at most {results['settings']['budget']} tokens.")
    return summary, table(["setting", "real tok/s (median)", "× 1 process, 1 thread", "each repeat"], rows) + \
        ["", note]


def headline_compile(results: dict, ceiling: dict) -> tuple[str, list[str]]:
    runs = [r for r in results["results"] if "skipped" not in r]
    rows = [[r["preset"], "bf16 autocast" if r["autocast"] else "fp32", f"{r['eager_tokens_per_second']:,.0f}",
             f"{r['compiled_tokens_per_second']:,.0f}", f"{r['compiled_over_eager']:.2f}×",
             f"{r['warmup_seconds']:.0f}", r["recompiles_after_warmup"]] for r in runs]
    summary = ("compiled/eager train-step tokens/s "
               + ", ".join(f"{r['compiled_over_eager']:.2f}× ({'bf16' if r['autocast'] else 'fp32'})" for r in runs)
               + "; compile warm-up " + ", ".join(f"{r['warmup_seconds']:.0f} s" for r in runs)
               + "; recompiles after it: " + ", ".join(str(r["recompiles_after_warmup"]) for r in runs))
    load = results.get("loadavg")
    note = (f"{results['threads']} torch thread(s); median over {results.get('repeats', '?')} alternating steps of "
            "micro-batches of varying length; the warm-up is the compiled model's first step from an empty "
            "inductor cache (the eager first step took "
            + ", ".join(f"{r['eager_first_step_seconds']:.1f} s" for r in runs) + ")"
            + (f"; load average {load[0]:.1f} at the end" if load else "") + ". "
            + " ".join(f"bf16 autocast: {r['skipped']}." for r in results["results"] if "skipped" in r)
            + " `train.compile` is meant for the GPU (docs/BENCHMARKS_GPU.md); it stays off by default.")
    return summary, table(["preset", "precision", "eager tok/s", "compiled tok/s", "compiled / eager",
                           "compile warm-up s", "recompiles after it"], rows) + ["", note]


def headline_cluster_scoring(results: dict, ceiling: dict) -> tuple[str, list[str]]:
    runs, settings, load = results["runs"], results["settings"], results["machine"].get("loadavg")
    rows = [[r["setting"], f"{r['completions_per_second']:.1f}", f"{r['vs_in_process']:.2f}×",
             " ".join(f"{x:.1f}" for x in r["all"]), r["batch_overhead_ms"]] for r in runs]
    cluster = [r for r in runs if r["workers"]]
    summary = ("Dask " + ", ".join(f"{r['workers']} worker(s) ×{r['vs_in_process']:.2f}" for r in cluster)
               + " the in-process completions/s; per-batch overhead "
               + "–".join(f"{r['batch_overhead_ms']:.0f}" for r in (min(cluster, key=lambda r: r["batch_overhead_ms"]),
                                                                   max(cluster, key=lambda r: r["batch_overhead_ms"])))
               + f" ms (on {results['machine']['cpus']} CPU cores)")
    note = (f"{settings['completions']} completions of the code task (each its reference solution, run in the sandbox "
            f"against {settings['tests_per_completion']:.1f} hidden tests on average), batches of "
            f"{settings['batch_size']}, median of {settings['repeats']} round(s) after a warm-up round. The per-batch "
            "overhead is one batch of one arithmetic rollout (a reward that costs nothing) end to end: submit, a "
            "Prefect task run on the worker, the result back. Worker processes share the benchmark machine's "
            f"{results['machine']['cpus']} cores with the flow's process"
            + (f" and other work (load average {load[0]:.1f} at the end)" if load else "")
            + ", so more workers than cores cannot add throughput here: the table measures the cluster path's cost, "
            "not the scaling of workers on machines of their own.")
    return summary, table(["setting", "completions/s (median)", "× in process", "each repeat",
                           "per-batch overhead ms"], rows) + ["", note]


HEADLINES = {"packing": headline_packing, "logprobs": headline_logprobs, "engine": headline_engine,
             "serve": headline_serve, "storage": headline_storage, "rl_step": headline_rl_step,
             "trl": headline_trl, "losses": headline_losses, "async": headline_async,
             "distributed": headline_distributed, "compile": headline_compile,
             "bytes": headline_bytes, "cluster_scoring": headline_cluster_scoring}


def headline(name: str, entry: dict, ceiling: dict) -> tuple[str, list[str]]:
    """The benchmark's summary line and headline table; a failure to read its JSON says so."""
    if "error" in entry:
        return "failed (see below)", []
    try:
        return HEADLINES[name](entry["results"], ceiling)
    except (KeyError, TypeError, ValueError, ZeroDivisionError, IndexError) as error:
        return "see the raw results", [f"(no headline table: {type(error).__name__} {error})"]
