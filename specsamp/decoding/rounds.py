"""One sample's round log and the statistics read from it, cut at any token.

The decoding loop records what each target call (round) of a row did (`state.py`). A stop
string is found on the host, after the loop has run on for a few more rounds; cutting the
log at the stop string's last token makes every statistic (target calls, draft calls,
accepted tokens, decode time) describe exactly the tokens the sample emitted.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Rounds:
    """Per round, in order: tokens appended; draft tokens kept and appended (-1: the round
    scored no draft, a plain step); draft model calls."""

    tokens: tuple[int, ...]
    accepted: tuple[int, ...]
    draft_calls: tuple[int, ...]

    @property
    def calls(self) -> int:
        return len(self.tokens)

    @property
    def accepted_per_loop(self) -> tuple[int, ...]:
        return tuple(a for a in self.accepted if a >= 0)

    @property
    def loops(self) -> int:
        return len(self.accepted_per_loop)

    @property
    def total_draft_calls(self) -> int:
        return sum(self.draft_calls)

    def cut(self, n_tokens: int) -> Rounds:
        """The rounds that produced the first n_tokens tokens; the last one keeps only the
        tokens it contributed (and the draft tokens among them)."""
        done = 0
        for i, t in enumerate(self.tokens):
            if done + t >= n_tokens:
                kept = n_tokens - done
                last = self.accepted[i] if self.accepted[i] < 0 else min(self.accepted[i], kept)
                return Rounds(self.tokens[:i] + (kept,), self.accepted[:i] + (last,),
                              self.draft_calls[: i + 1])
            done += t
        return self


def from_log(tokens, accepted, draft_calls, calls: int) -> Rounds:
    """A row of the loop's round log (numpy arrays [R]) with `calls` rounds."""
    return Rounds(*(tuple(int(x) for x in a[:calls]) for a in (tokens, accepted, draft_calls)))
