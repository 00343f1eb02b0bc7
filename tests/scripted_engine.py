"""A fake engine for tests of rollout loops: plays back token ids chosen from each context."""

from __future__ import annotations

from rlpipe.engines.base import Completion, SamplingParams


class ScriptedEngine:
    """Plays back a script: the k-th assistant turn of an episode samples `script[k]` (token ids),
    given as a function of the context so each episode can differ."""

    def __init__(self, script, end_id: int):
        self.script, self.end_id, self.calls = script, end_id, []

    policy_version = 0

    def generate(self, prompts, params: SamplingParams):
        self.calls.append((prompts, params))
        out = []
        for prompt in prompts:
            tokens = list(self.script(prompt))[: params.max_new_tokens]
            reason = "stop" if tokens and tokens[-1] == self.end_id else "length"
            out.append([Completion(tokens, [-0.5] * len(tokens), reason) for _ in range(params.n)])
        return out

    def sync(self, checkpoint_path, policy_version):
        pass

    def close(self):
        pass
