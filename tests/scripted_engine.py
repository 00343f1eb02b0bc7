"""Fake engines for tests: one for rollout loops that plays back token ids chosen from each
context, one for `rlpipe serve` that writes a reply chosen from the prompt's text."""

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


class ScriptedReplies:
    """An engine writing a fixed reply per conversation state (decided from the prompt's text)."""

    def __init__(self, model, tokenizer, reply):
        self.model, self.tokenizer, self.reply = model, tokenizer, reply
        self.policy_version = 0

    def generate(self, prompts, params, on_token=None, cancelled=None):
        out = []
        for prompt in prompts:
            text = self.reply(self.tokenizer.decode(prompt, skip_special_tokens=False)) + "<|im_end|>"
            tokens = self.tokenizer(text, add_special_tokens=False)["input_ids"][: params.max_new_tokens]
            out.append([Completion(tokens, [-0.25] * len(tokens), "stop") for _ in range(params.n)])
        return out


def scripted_app(checkpoint, reply, parser):
    """The app of `rlpipe serve --tool-call-parser PARSER` for `checkpoint`, whose replies are
    `reply(prompt_text)` (ScriptedReplies) instead of the model's samples."""
    from rlpipe.engines.serve_app import build_app
    from rlpipe.engines.serve_generation import ServedModel, load_served_model

    served = load_served_model(checkpoint)
    engine = ScriptedReplies(served.engine.model, served.tokenizer, reply)
    return build_app(ServedModel(served.path, served.tokenizer, engine, 0), tool_call_parser=parser)
