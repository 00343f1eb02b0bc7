"""A distillation teacher over HTTP (`[rl.distill] url`): an OpenAI-compatible server that returns
the log-prob of every prompt token, vLLM's `prompt_logprobs` (`rlpipe serve`, or `vllm serve`).

    teacher = HttpTeacher("http://127.0.0.1:8001", HttpOptions(retries=3), name="teacher-v2")
    teacher.check(student_tokenizer)          # ValueError, one line, unless it is the student's
    teacher.logprobs(prompts, completions)    # rollouts/distill.py's Teacher protocol
    teacher.lineage()                         # {"teacher", "teacher_checkpoint", "teacher_url"}

How a completion is scored: its prompt and completion go as one token-id prompt to POST
/v1/completions with `prompt_logprobs: 0`, `max_tokens: 1`; the answer's entry at each completion
position gives the teacher's log-prob of that token given everything before it, at temperature 1
(the model's own distribution; vLLM's default, raw log-probs). Ids are sent, not text, so no
re-tokenization can move a token; that makes a teacher of another tokenizer silent, so `check`
compares the server's /tokenize of a probe text with the student's ids, and scores the student's
last token id (a smaller vocabulary refuses it).

Every answer is checked before a number of it is used: one choice per sequence, as many
`prompt_logprobs` entries as tokens sent, each completion position naming the token sent with a
finite log-prob <= 0. Anything else is a `TeacherResponseError` naming the position; a server that
cannot be reached is the HTTP engine's `EngineUnavailableError` (engines/http.py: retried first).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from rlpipe.engines.http import HttpEngine, HttpOptions
from rlpipe.engines.http_wire import EngineResponseError, EngineTimeoutError, EngineUnavailableError

PROBE = ("The quick brown fox: 12 + 345 = 357?\n\tdef f(x):\n        return x ** 2  # ÄÖü ß é 日本語 😀 "
         "{\"key\": [1, 2.5, null]} <think>\n</think>")
"""Text the server's tokenizer must cut exactly as the student's (with the student's special
tokens appended): digits, code, JSON, accents, CJK and an emoji."""
SEQUENCES_PER_REQUEST = 32
"""Completions scored per request (rlpipe serve accepts up to --max-prompts)."""


class TeacherResponseError(EngineResponseError):
    """The teacher answered, but not log-probs of the tokens sent."""


class HttpTeacher:
    """The Teacher protocol (rollouts/distill.py) against a server; see the module docstring.

    url: the server (`vllm+http://` for vLLM, which needs the served model's name in requests).
    name: what lineage calls it (default: the served model's name). client: an httpx.Client
    to use instead of a new one (tests: an in-process app)."""

    def __init__(self, url: str, options: HttpOptions | None = None, *, name: str = "", client: Any = None) -> None:
        self.engine = HttpEngine(url, options or HttpOptions(), client=client)
        self.url = self.engine.url
        self.name = name

    def lineage(self) -> dict[str, str | None]:
        """What the server says it serves now (GET /v1/models: its first model's id and root)."""
        data = self._call("GET", "/v1/models", None).get("data") or [{}]
        first = data[0] if isinstance(data[0], dict) else {}
        served = first.get("id")
        checkpoint = first.get("root") or served
        return {"teacher": self.name or (str(served) if served else self.url),
                "teacher_checkpoint": str(checkpoint) if checkpoint else None, "teacher_url": self.url}

    def check(self, student_tokenizer: Any) -> None:
        """ValueError in one line unless the server's tokenizer is the student's: the same ids for
        the probe text, and the student's last token id scored."""
        text = PROBE + "".join(str(t) for t in getattr(student_tokenizer, "all_special_tokens", []))
        ours = list(student_tokenizer(text, add_special_tokens=False)["input_ids"])
        try:
            answer = self.engine.request("POST", "/tokenize", {**self._model(), "prompt": text,
                                                               "add_special_tokens": False})
        except EngineResponseError as err:
            raise ValueError(f"the teacher at {self.url} cannot show its tokenizer (POST /tokenize): {err}") from err
        theirs = answer.get("tokens")
        if not isinstance(theirs, list):
            raise ValueError(f"the teacher at {self.url} answered /tokenize without a token list: {str(answer)[:200]}")
        if theirs != ours:
            at = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), min(len(ours), len(theirs)))
            raise ValueError(f"the teacher at {self.url} has another tokenizer than the student: a probe text is "
                             f"{len(theirs)} tokens there, {len(ours)} here, first differing at token {at} "
                             f"({theirs[at:at + 3]} against {ours[at:at + 3]})")
        last = len(student_tokenizer) - 1
        try:
            self.logprobs([ours[:4]], [[last]])
        except EngineResponseError as err:
            said = str(err).removeprefix(f"the teacher at {self.url}: ")
            raise ValueError(f"the teacher at {self.url} cannot score the student's last token id {last} "
                             f"(a smaller vocabulary, or no prompt_logprobs): {said}") from err

    def logprobs(self, prompts: Sequence[list[int]], completions: Sequence[list[int]]) -> list[list[float]]:
        """The teacher's log-prob of each completion token given its prompt and the tokens before it."""
        out: list[list[float]] = [[] for _ in prompts]
        todo = [i for i, c in enumerate(completions) if c]
        for start in range(0, len(todo), SEQUENCES_PER_REQUEST):
            chunk = todo[start : start + SEQUENCES_PER_REQUEST]
            sent = [list(prompts[i]) + list(completions[i]) for i in chunk]
            body = {**self._model(), "prompt": sent, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0}
            answer = self._call("POST", "/v1/completions", body)
            for i, ids, entries in zip(chunk, sent, prompt_logprobs_of(answer, len(sent), self.url), strict=True):
                out[i] = completion_logprobs(entries, ids, len(prompts[i]), self.url)
        return out

    def close(self) -> None:
        self.engine.close()

    def _call(self, method: str, path: str, body: Any) -> dict[str, Any]:
        """The engine's request (retries included), its errors saying it was the teacher's server."""
        try:
            return self.engine.request(method, path, body)
        except (EngineUnavailableError, EngineTimeoutError, EngineResponseError) as err:
            if str(err).startswith(f"the teacher at {self.url}"):
                raise
            raise type(err)(f"the teacher at {self.url}: {err}") from err

    def _model(self) -> dict[str, str]:
        model = self.engine.model_id()
        return {"model": model} if model else {}


def prompt_logprobs_of(answer: dict[str, Any], n: int, url: str) -> list[list[Any]]:
    """Each choice's `prompt_logprobs`, by choice index; TeacherResponseError unless there is one
    list per sequence sent."""
    choices = answer.get("choices")
    if not isinstance(choices, list) or len(choices) != n:
        got = len(choices) if isinstance(choices, list) else "no"
        raise TeacherResponseError(f"the teacher at {url} answered {got} choices for {n} sequences")
    by_index = {c.get("index", i): c for i, c in enumerate(choices) if isinstance(c, dict)}
    out = []
    for i in range(n):
        entries = by_index.get(i, {}).get("prompt_logprobs")
        if not isinstance(entries, list):
            raise TeacherResponseError(f"the teacher at {url} answered no prompt_logprobs for sequence {i} "
                                       "(does it support vLLM's prompt_logprobs?)")
        out.append(entries)
    return out


def completion_logprobs(entries: list[Any], sent: list[int], n_prompt: int, url: str) -> list[float]:
    """The log-probs of `sent[n_prompt:]` from one sequence's `prompt_logprobs`; TeacherResponseError
    when they do not line up with the tokens sent."""
    if len(entries) != len(sent):
        raise TeacherResponseError(f"the teacher at {url} answered {len(entries)} prompt log-probs for {len(sent)} "
                                   "tokens sent: its log-probs do not line up with the student's tokens")
    out = []
    for position in range(n_prompt, len(sent)):
        entry, token = entries[position], sent[position]
        scored = entry.get(str(token)) if isinstance(entry, dict) else None
        if scored is None:
            named = list(entry)[:3] if isinstance(entry, dict) else entry
            raise TeacherResponseError(f"the teacher at {url} scored token(s) {named} at position {position}, not the "
                                       f"student's token {token}: its tokens are not the student's")
        value = scored.get("logprob") if isinstance(scored, dict) else scored
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value > 1e-4:
            raise TeacherResponseError(f"the teacher at {url} answered log-prob {value!r} for token {token} at "
                                       f"position {position} (a finite number <= 0 expected)")
        out.append(min(float(value), 0.0))
    return out
