"""Stop strings: the one rule that cuts a completion's text, streamed or not.

    cutter = StopCutter(tokenizer, stops, skip_special_tokens, include_stop)
    for token in tokens:
        added = cutter.add(token)      # text the token makes final ("" while a character is partial)
        if cutter.hit is not None:     # a stop string completed: the text ends here
            break
    else:
        added = cutter.close()         # the engine's completion ended: what is left, then the search

The text is decoded incrementally, as vLLM's detokenizer does: each token decodes a short window
of recent tokens, and text is final only once the window does not end in U+FFFD (a UTF-8
character cut across tokens waits for its next byte; `close` makes whatever is left final, a
partial character as its replacement character). Stop strings are searched in final text only,
each time it grows and once more at `close`, so a replacement character that a later byte would
have completed never matches, and one the completed text keeps matches the same whether the text
arrives token by token or at once. The hit is the stop string completed first (the smallest end;
at equal ends the earliest start). The tokens kept are those taken until the hit, through the one
whose arrival made the stop string's text final (as vLLM keeps the token that triggered its stop):
a stream has sent exactly these token ids when it ends.

engines/openai_output.py `finish` feeds a whole completion through a cutter, and
engines/streaming.py `ChoiceStream` feeds one token at a time and sends only final text that no
stop string can still reach: both answers are the same by construction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

REPLACEMENT = "\ufffd"


@dataclass(frozen=True)
class StopHit:
    """Where a stop string ended a completion: the string, its start in the text, the text the
    answer keeps and how many tokens it keeps."""

    stop: str
    at: int
    text: str
    keep: int


class StopCutter:
    """One completion's tokens in, final text out, until the first stop string completes."""

    def __init__(self, tokenizer: Any, stops: tuple[str, ...], skip: bool, include_stop: bool) -> None:
        self.tokenizer, self.stops, self.skip, self.include_stop = tokenizer, tuple(stops), skip, include_stop
        self.longest = max((len(s) for s in self.stops), default=0)
        self.tokens: list[int] = []
        self.text = ""  # the final text so far
        self._prefix = self._read = 0  # token offsets of the decoding window
        self.hit: StopHit | None = None

    def add(self, token: int) -> str:
        """Take `token`; the text it makes final (check `hit` after)."""
        self.tokens.append(token)
        return self._advance(final=False)

    def close(self) -> str:
        """The completion ended: all text left is final (a partial character included)."""
        return self._advance(final=True)

    def _decode(self, start: int, end: int | None = None) -> str:
        return self.tokenizer.decode(self.tokens[start:end], skip_special_tokens=self.skip)

    def _advance(self, final: bool) -> str:
        if self.hit is not None:
            return ""
        before = self._decode(self._prefix, self._read)
        after = self._decode(self._prefix)
        if len(after) <= len(before) or (after.endswith(REPLACEMENT) and not final):
            return ""
        searched = max(0, len(self.text) - self.longest + 1)
        added = after[len(before):]
        self.text += added
        self._prefix, self._read = self._read, len(self.tokens)
        self.hit = self._search(searched)
        return added

    def _search(self, start: int) -> StopHit | None:
        hits = [(self.text.find(s, start), s) for s in self.stops]
        hits = [(at, s) for at, s in hits if at >= 0]
        if not hits:
            return None
        at, stop = min(hits, key=lambda hit: (hit[0] + len(hit[1]), hit[0]))
        end = at + len(stop)
        return StopHit(stop, at, self.text[:end] if self.include_stop else self.text[:at], len(self.tokens))
