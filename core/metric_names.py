"""Metric names, in one place: what the loop logs to MLflow and what the report, the progress
bar and the CLI summary read back. Prefixes: `train/*`, `rollout/*`, `perf/*`, `eval/*`."""

# rollout/*: the batch filling of one step (rollouts/group_buffer.py, rollouts/source.py)
ZERO_VAR_GROUPS = "rollout/zero_var_groups"
VALID_GROUPS = "rollout/valid_groups"
SAMPLED_GROUPS = "rollout/sampled_groups"
STALE_DROPPED = "rollout/stale_dropped"
ZERO_VAR_FRACTION = "rollout/zero_var_fraction"
ATTEMPTS = "rollout/attempts_per_batch"
CARRIED_GROUPS = "rollout/carried_groups"
BATCH_GROUPS = "rollout/batch_groups"
KEPT_GROUPS = "rollout/kept_groups"
TRAINED_SAMPLES = "rollout/trained_samples"  # completions of the batch with a non-zero advantage
REWARD_MEAN = "rollout/reward_mean"
REWARD_MEAN_ALL = "rollout/reward_mean_all"
REWARD_ERRORS = "rollout/reward_errors"
COMPLETION_LENGTH = "rollout/completion_length_mean"
THINKING_LENGTH = "rollout/thinking_length_mean"  # tokens of the <think> block, tags included
ANSWER_LENGTH = "rollout/answer_length_mean"  # tokens after </think>
CUT_IN_THINKING = "rollout/cut_in_thinking"  # completions cut at max_new_tokens inside their reasoning
LAG_MEAN = "rollout/policy_lag_mean"
LAG_MAX = "rollout/policy_lag_max"
CURRICULUM_SKIPPED = "rollout/curriculum_skipped"  # resting prompts skipped (rl.curriculum.type)
CURRICULUM_RETESTED = "rollout/curriculum_retested"  # resting prompts sampled anyway

# eval/*: greedy evaluation on held-out prompts
EVAL_ACCURACY = "eval/accuracy"
EVAL_REWARD = "eval/reward_mean"


def pass_at(k: int) -> str:
    """eval/pass_at_<k>: unbiased pass@k of the sampled evals (`eval.samples`; MLflow refuses '@'
    in a metric name, so pass@k is spelled pass_at_k)."""
    return f"eval/pass_at_{k}"


def maj_at(k: int) -> str:
    """eval/maj_at_<k>: share of held-out prompts whose majority answer over k samples is correct."""
    return f"eval/maj_at_{k}"


# perf/*
TOKENS_PER_SECOND = "perf/tokens_per_second"
SECONDS_TOTAL = "perf/seconds_total"
COMPILE_SECONDS = "perf/compile_seconds"  # torch.compile time spent inside a train step (train.compile)


def fate(status: str) -> str:
    """rollout/fate_<status>: completions given that fate at the step (rollouts/fates.py)."""
    return f"rollout/fate_{status}"


def seconds(phase: str) -> str:
    """perf/seconds_<phase>: wall-clock of one phase of the step."""
    return f"perf/seconds_{phase}"


def train(name: str) -> str:
    """train/<name>: a metric of the optimizer step (loss, grad_norm, lr, ratio_mean, ...)."""
    return f"train/{name}"


def batch(name: str) -> str:
    """rollout/batch_<name>: what the batch maker reports of the step's batch (rollouts/batch_makers.py)."""
    return f"rollout/batch_{name}"


ENV_METRICS = ("reward_mean", "accuracy", "zero_var_fraction", "samples")
"""What `rollout/<env>/<name>` holds for each environment of a mixture (rollouts/env_metrics.py)."""


def env(env_name: str, name: str) -> str:
    """rollout/<env>/<name>: a metric of one environment of a mixture (ENV_METRICS)."""
    return f"rollout/{env_name}/{name}"


def eval_env(env_name: str, name: str) -> str:
    """eval/<env>/<name>: held-out accuracy or reward_mean of one environment of a mixture."""
    return f"eval/{env_name}/{name}"
