"""How often a hybrid's wide rounds come, pooled over the K values that run them, for the
K policy (`specsamp.decoding.kpolicy`).

A hybrid drafter (`lookup.HybridDrafter`) runs a wide round (its `wide` lookup tokens
instead of K) where every running row has a long lookup match. In a chunk of K < wide
that is a round the policy's chain model does not describe, so the chunk counts for more
rounds of the modelled kind by what its wide rounds emitted (`batching.modelled_rounds`),
and a K's round seconds are its timed seconds over those rounds. How often rounds are
wide, and what a wide round emits, is a property of the text (the lookup's matches), not
of K, yet each K's credit rested on its own chunks: at T = 1 (batch 1, 24 HumanEval chat
prompts) `--k auto`'s five K = 1 chunks (76 rounds) met almost no wide round (77 rounds
counted) where the run's other chunks had ~8% of theirs, K = 1 was predicted 3% below
K = 2, and the run kept K = 2, 10% slower than a fixed K = 1 with wide rounds.
`WideRounds` pools the wide share and a wide round's tokens over the timed chunks of every
such K and re-counts each K's timed rounds with the pooled figures. (A K's seconds a
round still come from its own chunks, whose rounds were wide less or more often: a wide
round scores more rows, so a K that met fewer is priced a little low, ~1% here.)

Plain arithmetic on a few floats; the runner reports each chunk (`batching`).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class WideRounds:
    """`observe` each timed chunk of a K below the wide length; `modelled` re-counts."""

    # Pooled over every observed chunk: row-rounds, wide row-rounds, their tokens.
    pooled: list = dataclasses.field(default_factory=lambda: [0.0, 0.0, 0.0])
    # Per shape key: row-rounds, wide row-rounds, their tokens, counted tokens, counted
    # row-rounds (the rounds the chain model describes).
    own: dict = dataclasses.field(default_factory=dict)

    def observe(self, key, chunk: tuple[float, float, float], counted: tuple[float, int]) -> None:
        """chunk: (row-rounds, wide row-rounds, their tokens) of a timed chunk at `key`, a
        K whose chunks run wide rounds; counted: (tokens, row-rounds) of its counted rounds
        (`KPolicy.observe`'s)."""
        own = self.own.setdefault(key, [0.0] * 5)
        for i, x in enumerate(tuple(chunk) + tuple(counted)):
            own[i] += x
        for i, x in enumerate(chunk):
            self.pooled[i] += x

    def modelled(self, key, rounds: float, modelled: float) -> float:
        """`modelled`: the `rounds` timed at `key` as their chunks counted them (each by its
        own wide rounds); returns them counted with the pooled wide share and tokens. A
        round's count is 1 + f (t - m) / m for a wide share f, a wide round's tokens t and
        a counted round's tokens m, so the pooled count replaces the own f (t - m)."""
        own = self.own.get(key)
        if own is None or own[0] == 0 or own[4] == 0 or self.pooled[0] == 0:
            return modelled
        rows, wide, wide_tokens, counted_tokens, counted = own
        mean = counted_tokens / counted
        pooled = (self.pooled[2] - self.pooled[1] * mean) / self.pooled[0]
        mine = (wide_tokens - wide * mean) / rows
        return modelled + rounds * (pooled - mine) / mean
