"""What the engine returns for each sample: the text and its statistics."""

from __future__ import annotations

import dataclasses

from specsamp.decoding import stats


@dataclasses.dataclass(frozen=True)
class Completion:
    """One generated sample and its per-sample statistics.

    Statistics describe exactly the emitted tokens (`token_ids`): when a stop string ends
    the sample, the rounds the loop ran past it are cut away (`specsamp.decoding.rounds`).

    Timing: `prefill_s` and `decode_s` are wall-clock seconds of already compiled programs
    (compilation is timed apart, in `compile_s`). `prefill_s` is the batch's prefill;
    `decode_s` is the decoding time until the sample's last emitted token: rounds of a
    batch take equal time, so it is the batch's decode time x the sample's target calls /
    the rounds the batch ran. At batch size 1 (the paper's latency setting) it is the
    measured time, less the rounds run past a stop string.
    """

    text: str
    token_ids: tuple[int, ...]
    prompt_tokens: int
    stop_reason: str  # 'eos' | 'stop' | 'max_tokens'
    mode: str  # 'speculative' | 'autoregressive'
    target_calls: int
    draft_calls: int
    accepted_per_loop: tuple[int, ...]
    prefill_s: float
    decode_s: float
    k: int = 0
    compile_s: float = 0.0  # compiling the batch's programs (first row of a batch; else 0)
    drafted_per_loop: tuple[int, ...] = ()  # each loop's K (draft tokens scored); (): k each
    # 'off', or the token tree's widths ('3x1x1'): a tree round's drafted entry is then its
    # nodes scored (N) and its accepted entry the depth it kept (`decoding.tree_round`)
    tree: str = "off"

    @property
    def generated_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def loop_lengths(self) -> tuple[int, ...]:
        """Each loop's draft length (drafted_per_loop, or k for every loop when not given),
        one per entry of accepted_per_loop."""
        return self.drafted_per_loop or (self.k,) * len(self.accepted_per_loop)

    @property
    def acceptance_rate(self) -> float:
        accepted, drafted, _ = stats.loop_counts(self.accepted_per_loop, self.loop_lengths)
        return stats.acceptance_rate(accepted, drafted)

    @property
    def tokens_per_call(self) -> float:
        return stats.tokens_per_call(self.generated_tokens, self.target_calls)

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def ms_per_token(self) -> float:
        return stats.ms_per_token(self.decode_s, self.generated_tokens)

    def stats(self) -> dict:
        """Every statistic as plain JSON-able values."""
        return {
            "mode": self.mode,
            "k": self.k,
            "tree": self.tree,
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "stop_reason": self.stop_reason,
            "target_calls": self.target_calls,
            "draft_calls": self.draft_calls,
            "accepted_per_loop": list(self.accepted_per_loop),
            "drafted_per_loop": list(self.loop_lengths),
            "acceptance_rate": self.acceptance_rate,
            "tokens_per_call": self.tokens_per_call,
            "prefill_s": self.prefill_s,
            "decode_s": self.decode_s,
            "total_s": self.total_s,
            "ms_per_token": self.ms_per_token,
            "compile_s": self.compile_s,
        }
