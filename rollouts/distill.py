"""On-policy distillation (`rl.teacher`, `[rl.distill]`): the student samples, a teacher scores every
sampled token, and the per-token reverse KL log p_student − log p_teacher is the signal.

    teacher = ModelTeacher(model, lineage)               # in process, its own weights
    teacher = HttpTeacher(url, options)                  # over HTTP (engines/http_teacher.py)
    rows = with_teacher(rollouts, teacher)               # `rollouts.teacher_logprobs`, per token,
                                                         # and the teacher's name, checkpoint, url
    token_advantages(advantage, rollout, options)        # what packing puts on each token
    mean_advantage(advantage, pulls(rollout), options)   # the `advantages` row (rescore too)

The student's log-prob of a token is the generator's (`completion_logprobs`, the tempered policy
that sampled it: sample at temperature 1 for the reverse KL of the policy itself). The teacher's is
`log_softmax(teacher(prompt + completion))` at temperature 1, no gradient. With the REINFORCE
objective, an advantage of −(log p_student − log p_teacher) on each token is the policy gradient
of the reverse KL to the teacher (each token's own term, no sum over later ones):
- `type = "advantage"`: that is the whole advantage (pure distillation; the verifier's reward is
  still scored and recorded, but does not train);
- `type = "reward"`: the verifier's group advantage plus `weight` times it on each token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from rlpipe.rollouts.records import Rollout

DISTILL_TYPES = ("none", "advantage", "reward")


@dataclass(frozen=True)
class DistillOptions:
    """`[rl.distill]`: how the teacher's signal enters the advantage."""

    type: str = "none"
    """none | advantage (the whole advantage) | reward (added to the verifier's, times `weight`)."""
    weight: float = 1.0
    """With type = "reward": the weight of the teacher's term."""

    def __post_init__(self) -> None:
        if self.type not in DISTILL_TYPES:
            raise ValueError(f"rl.distill.type must be one of {', '.join(DISTILL_TYPES)}, got {self.type!r}")


LINEAGE = ("teacher", "teacher_checkpoint", "teacher_url")
"""The `rollouts` columns naming the teacher that scored a row: its name (`rl.teacher`, else the
served model's), its checkpoint (folder or server's model root) and its URL (null in process)."""


class Teacher(Protocol):
    """Scores sampled tokens: the log-prob of each completion token given what precedes it."""

    def logprobs(self, prompts: Sequence[list[int]], completions: Sequence[list[int]]) -> list[list[float]]: ...

    def lineage(self) -> dict[str, str | None]:
        """The LINEAGE columns of the rows it scores now."""
        ...


class ModelTeacher:
    """A teacher in process: a causal LM of its own, frozen, one forward per completion;
    `lineage` holds its LINEAGE columns."""

    def __init__(self, model, lineage: dict[str, str | None] | None = None) -> None:
        self._lineage = {key: (lineage or {}).get(key) for key in LINEAGE}
        self.model = model.eval()
        for param in self.model.parameters():
            param.requires_grad_(False)

    def logprobs(self, prompts: Sequence[list[int]], completions: Sequence[list[int]]) -> list[list[float]]:
        import torch

        device = next(self.model.parameters()).device
        out = []
        with torch.no_grad():
            for prompt, completion in zip(prompts, completions, strict=True):
                if not completion:
                    out.append([])
                    continue
                ids = torch.tensor([list(prompt) + list(completion)], device=device)
                logits = self.model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
                labels = torch.tensor(completion, device=device)
                picked = torch.log_softmax(logits, dim=-1).gather(-1, labels[:, None])[:, 0]
                out.append([float(x) for x in picked.cpu()])
        return out

    def lineage(self) -> dict[str, str | None]:
        return dict(self._lineage)


def with_teacher(rollouts: list[Rollout], teacher: Teacher) -> list[Rollout]:
    """The rollouts with the teacher's log-prob of every completion token (`teacher_logprobs`)
    and the teacher that gave them (LINEAGE columns)."""
    if not rollouts:
        return rollouts
    scored = teacher.logprobs([r.prompt_tokens for r in rollouts], [r.completion_tokens for r in rollouts])
    lineage = teacher.lineage()
    named = {key: lineage.get(key) for key in LINEAGE}
    return [replace(r, teacher_logprobs=lps, **named) for r, lps in zip(rollouts, scored, strict=True)]


def reverse_kl(rollout: Rollout) -> list[float]:
    """Per completion token, log p_student − log p_teacher (the sampled estimate of the reverse KL)."""
    if rollout.teacher_logprobs is None:
        raise ValueError(f"rollout {rollout.sample_id!r} has no teacher log-probs (rl.teacher scores them)")
    return [float(s) - float(t) for s, t in zip(rollout.completion_logprobs, rollout.teacher_logprobs, strict=True)]


def pulls(rollout: Rollout) -> list[float]:
    """Per completion token, the teacher's pull log p_teacher − log p_student (minus `reverse_kl`)."""
    return [-kl for kl in reverse_kl(rollout)]


def advantages_from(advantage: float, pull: list[float], options: DistillOptions) -> list[float]:
    """Each token's advantage from the verifier's `advantage` and the teacher's `pull` (type
    advantage or reward)."""
    if options.type == "advantage":
        return list(pull)
    return [advantage + options.weight * p for p in pull]


def token_advantages(advantage: float, rollout: Rollout, options: DistillOptions) -> list[float] | None:
    """Each completion token's advantage under `options`; None without distillation (packing then
    puts the sequence's `advantage` on every token)."""
    if options.type == "none":
        return None
    return advantages_from(advantage, pulls(rollout), options)


def mean_advantage(advantage: float, pull: list[float], options: DistillOptions) -> float:
    """The sequence's advantage (its `advantages` row): the mean of its tokens' (0 without tokens);
    `advantage` itself without distillation."""
    if options.type == "none":
        return advantage
    per_token = advantages_from(advantage, pull, options)
    return sum(per_token) / len(per_token) if per_token else 0.0
