"""One sample's round log and the statistics read from it, cut at any token.

The decoding loop records what each target call (round) of a row did (`state.py`). A stop
string is found on the host, after the loop has run on for a few more rounds; cutting the
log at the stop string's last token makes every statistic (target calls, draft calls,
accepted tokens, decode time) describe exactly the tokens the sample emitted.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Rounds:
    """Per round, in order: tokens appended; draft tokens kept and appended (-1: the round
    scored no draft, a plain step); draft model calls; draft tokens scored (the round's K,
    which `k auto` chooses per round; 0 for a plain step)."""

    tokens: tuple[int, ...]
    accepted: tuple[int, ...]
    draft_calls: tuple[int, ...]
    drafted: tuple[int, ...]

    @property
    def calls(self) -> int:
        return len(self.tokens)

    @property
    def accepted_per_loop(self) -> tuple[int, ...]:
        return tuple(a for a in self.accepted if a >= 0)

    @property
    def drafted_per_loop(self) -> tuple[int, ...]:
        return tuple(d for a, d in zip(self.accepted, self.drafted) if a >= 0)

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
                              self.draft_calls[: i + 1], self.drafted[: i + 1])
            done += t
        return self


def round_logs(state, rows) -> list[list[list[int]]]:
    """The decode state's round logs of `rows` (slots), in `from_log`'s order: for each
    log, a list per row of its R entries (one host copy and conversion for all rows)."""
    rows = np.asarray(rows, int)
    return [np.asarray(a)[rows].tolist() for a in (
        state.round_tokens, state.round_accepted, state.round_draft_calls, state.round_drafted)]


def from_log(tokens, accepted, draft_calls, drafted, calls: int) -> Rounds:
    """A row of the loop's round logs (lists [R], `round_logs`) with `calls` rounds."""
    return Rounds(*(tuple(a[:calls]) for a in (tokens, accepted, draft_calls, drafted)))


@dataclasses.dataclass(frozen=True)
class RawSample:
    """What the device returns for one row, before detokenisation."""

    token_ids: tuple[int, ...]
    prompt_tokens: int
    stop_reason: str
    rounds: Rounds  # what each target call did (cut with `cut`)
    prefill_s: float  # the row's prefill: its batch's (static) or its share of its insert
    batch_decode_s: float  # decoding over batch_rounds rounds (static: the batch's)
    batch_rounds: int  # rounds batch_decode_s covers (static: the most target calls of a row)
    compile_s: float = 0.0  # compiling programs (not in the times above; the column sums)

    @property
    def calls(self) -> int:  # target calls
        return self.rounds.calls

    @property
    def loops(self) -> int:  # speculative rounds (calls that scored a draft)
        return self.rounds.loops

    @property
    def draft_calls(self) -> int:
        return self.rounds.total_draft_calls

    @property
    def accepted(self) -> tuple[int, ...]:  # draft tokens kept and emitted, per loop
        return self.rounds.accepted_per_loop

    @property
    def drafted(self) -> tuple[int, ...]:  # draft tokens scored, per loop (its K)
        return self.rounds.drafted_per_loop

    @property
    def decode_s(self) -> float:
        """Decoding time until this row's last emitted token: the rounds of a batch take
        equal time, so the batch's time x this row's rounds / the rounds the batch ran
        (exact at batch size 1 when the loop stopped at the row's end)."""
        return self.batch_decode_s * self.calls / max(self.batch_rounds, 1)

    def cut(self, n_tokens: int) -> "RawSample":
        """The sample up to its first n_tokens generated tokens, statistics included."""
        return dataclasses.replace(self, token_ids=self.token_ids[:n_tokens],
                                   rounds=self.rounds.cut(n_tokens))
