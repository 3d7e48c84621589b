"""Batch-aware speculation (`--k auto`): before each chunk of rounds, pick the K (0 = plain
autoregressive rounds) that maximises the batch's expected tokens per second.

A round at K costs the seconds the engine's own round program takes for the whole batch
(measured once per machine, `specsamp.decoding.costs.cost_curve`: drafting, scoring K+1
tokens, acceptance and bookkeeping; cheap in K at small batches, growing with K at large
ones), corrected by the run's own chunks as they are timed (`KPolicy.observe`: a curve
measured in a busy minute would otherwise misprice a shape for good), and yields, for each
running row with acceptance rate a, (1 - a^(K+1)) / (1 - a) tokens in expectation (the
paper's cost model; SmartSpec's goodput rule, here with measured batch costs). Each row's
a is its running estimate, shrunk toward the pooled rate of every row the engine ran as
strongly as the finished rows' spread says (`specsamp.decoding.row_rates`). Deeper draft
positions need not be kept as often as the first (a trained draft's chained guesses are
worse than its first): the rate of each position d given the ones before it, pooled over
every row the engine ran, scales the row's rate there (`specsamp.decoding.position_rates`);
before any round tested position d it is taken to be the first position's, the plain model.

Token trees (`--tree auto`, `KChoice.trees`): beside the chains the policy weighs a few
tree shapes, each with its own measured round seconds. A tree's spine (its first-child
chain, `Tree.spine`) is the chain of J drafts the drafter would have proposed, so its
rounds yield what that chain yields (the chain model above, J = the spine's length) times
the tree's width gain: the tokens its rounds emitted over the tokens their spines alone
would have (each round records both, `round_spine`), with `gain_weight` tokens at a gain of
1 (a width not tried yet counts as no better than one child, so each tree that could beat
the chains at all runs one chunk early on, explore). Measured on the same rows in the same
rounds, the gain does not move with how easy the prompts of the moment are, as rates
pooled by (depth, width) over the run did: a tree explored on easy first prompts was
predicted far above the chains and ran for hundreds of slower rounds. What the spines kept
counts as chain rounds of J drafts for the rates above. A tree runs only where predicted
faster than the best chain by `tree_margin`.

The model is calibrated per draft length K by what the rounds it predicted emitted
(`KPolicy.calibration`): each chunk's counted rounds' tokens over the tokens the model
predicted for them when it chose the chunk, pooled with `gain_weight` tokens at 1 (a
tree's spine counts for its length). The pooled rates come mostly from the shapes that ran
most, and the rounds behind them are not quite the rounds of another K: a hybrid drafter's
lookup rounds of 3 tokens are wide rounds in chunks of K < 3 (left out of the counts) but
ordinary rounds of K >= 3, and acceptance varies together along a chain (a row in a copied
stretch keeps every position), which a product of pooled rates misses. Uncalibrated, the
model put K = 3 at 2.09 tokens a round at T = 0.7 top-p 0.9 where a fixed K = 3 kept 2.34,
and K = 2 greedy 5% below its measured speed, K = 1 4% above.

Plain rounds test no draft, so a choice of plain rounds could never be undone by what the
run shows. Where it was a close call (the best drafted shape predicted within `close`),
after `revisit` plain rounds in a row one chunk drafts again (`KPolicy._revisit_due`); a
plain chunk runs no further than that (`KPolicy.plain_rounds`), so that a wrong call costs
the same few rounds at batch 1, where a chunk would otherwise run to the end of its row,
as at batch 32.

A chain K that has not run yet and is predicted within `close` of the choice runs one chunk
first (`KPolicy._explore`): its round seconds otherwise rest on the curve alone. One chunk
corrects neither them nor its deeper positions' rates, and a chain predicted below the
choice would never run again: every `reexplore` drafted-chain choices, one chunk runs at
the other drafted chain (the least run so far) predicted within `reexplore_within` of the
choice (`KPolicy._reexplored`), or at plain rounds if the run has not timed any (a curve
that overprices them would otherwise keep a losing K for good). Each re-run that leaves
the choice as it was doubles the wait for the next (up to `reexplore_max`), once the
chains within reach ran `reexplore_evidence` chunks each; a new choice resets it. Without
that a long run paid one chunk in nine at a chain 10-15% slower for good. The curve times
rounds in which a lookup drafter finds no match, the dearer kind, which overprices long
chains most; timed chunks correct that only for the K values that run.

Exactness: every round is exact whatever K or tree it runs at, and the shape is chosen
from the past only, so samples follow the target's distribution (checked by chi-square in
the tests); greedy output is the same token for token. A sampled row's tokens for a given
seed, however, depend on the K schedule, hence on its batch and on the machine's timing:
with a fixed K they do not.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Sequence

import numpy as np

from specsamp.decoding.config import shape_key
from specsamp.decoding.costs import CostCurve, cost_curve
from specsamp.decoding.position_rates import expected_tokens_by_position, shrunk_rates
from specsamp.decoding.row_rates import RowRates
from specsamp.decoding.shapes import width_for
from specsamp.decoding.stats import expected_tokens
from specsamp.decoding.tree import Tree
from specsamp.decoding.wide_rounds import WideRounds


@dataclasses.dataclass
class KPolicy:
    """policy(accepted, tested) -> index into ks, from the running rows' accepted and tested
    draft tokens so far (see `specsamp.decoding.engine.Engine`)."""

    curve: CostCurve
    ks: Sequence[int]
    trees: Sequence[Tree] = ()  # tree shapes beside the chains (indices after ks)
    rows: RowRates = dataclasses.field(default_factory=RowRates)  # each row's rate
    wide: WideRounds = dataclasses.field(default_factory=WideRounds)  # a hybrid's wide rounds
    depth_weight: float = 16.0  # pseudo-observations of the first position's rate, per position
    # Draft only where the best K is predicted this much faster than plain rounds: the
    # cost curve is measured once on a machine whose speed drifts, and a predicted gain of
    # a few percent is within a curve's error (docs/measurements.md); plain rounds cost
    # what the baseline costs.
    # It shrinks as the run's own chunks time both plain rounds and the shape against
    # which it is weighed (`_margin`): then neither cost rests on the curve.
    margin: float = 0.05
    # A tree only where predicted this much faster than the best chain (plain included):
    # the same curve error, and a tree's gain rests on fewer rounds than a chain's rates.
    tree_margin: float = 0.05
    # Tokens at a width gain of 1 pooled with a tree's measured tokens (about 16 rounds'):
    # one exploring chunk moves a tree's gain halfway to what it measured.
    gain_weight: float = 32.0
    # Plain rounds test no draft, so a plain call made on few or unlucky tested tokens
    # would stand for good. After `revisit` plain rounds in a row (chunks, or runs
    # without the drafter), where the best drafted shape is predicted within `close` of
    # plain rounds, one chunk runs at that shape; a clear loss is not re-tested. Counted
    # in rounds: at batch 1 a plain chunk ran to the end of its row.
    revisit: int = 64
    close: float = 0.10
    # The curve is a few rounds per shape timed once (its figures for one shape moved by
    # 15-50% between measurements minutes apart here). A shape's round seconds are its
    # timed rounds pooled with `cost_weight` rounds at the curve's figure, scaled by how
    # the timed rounds of every shape compare with the curve (a slower machine moves all
    # alike). Chunks at fewer slots than the curve's (a compacted tail) do not count.
    cost_weight: float = 16.0
    # A chunk's fixed cost (the device call, the host's wait for it and its choice) is
    # spread over its rounds: 1-round chunks read 6.5-10.8 ms a round at batch 1 where
    # the same shape's 16-round chunks read ~5 (a row's last chunk is as short as the row's
    # rounds left). A shape explored once would carry that for the rest of a run, so
    # chunks of fewer rounds than this are not timed (what they emitted still counts).
    timed_min_rounds: int = 4
    # See the module's note: every `reexplore` drafted-chain choices one chunk re-runs a
    # chain predicted within `reexplore_within` of the choice; the wait doubles with each
    # re-run that leaves the choice as it was (once `reexplore_evidence` allows), up to
    # `reexplore_max`, and starts again at `reexplore` when the choice moves.
    reexplore: int = 8
    reexplore_within: float = 0.25
    reexplore_max: int = 64
    # The wait doubles only once the chain a re-run picks (the least run of those within
    # reach) has run this many chunks: one chunk's tokens and seconds move by 10-30% with
    # the stretch of text it lands on (a K = 3 chunk at T = 0.7 top-p 0.9 kept 0.8x and
    # took 1.1x its run-long figures, and the chain was not run again).
    reexplore_evidence: int = 3

    def __post_init__(self):
        # The last chunks' shapes (a K, or a tree's widths, '2x1'), and the chunks each
        # index into `shapes` ran (`explored`): a worker's policy chooses millions of
        # chunks, so no list of them all.
        self.chosen: collections.deque = collections.deque(maxlen=1024)
        self.chunks: collections.Counter = collections.Counter()
        self.plain_run = 0  # plain rounds in a row (`revisit`), counted by `observe`
        self.plain_for: int | None = None  # rounds the chosen plain chunk runs (`plain_rounds`)
        self.calibrated: dict = {}  # K -> [tokens emitted, tokens predicted] (`calibration`)
        self.predicted: tuple | None = None  # the chosen chunk's (shape key, K, tokens a row-round)
        self._estimates: tuple = (np.full(1, 0.5), None)  # the last choice's (alpha, rates)
        self.timed: dict = {}  # shape key -> [seconds, rounds, modelled rounds] of timed chunks
        self.chain_run = 0  # drafted-chain choices since the last re-run (`reexplore`)
        self.reexplore_wait = self.reexplore  # choices between re-runs (doubles, `reexplore_max`)
        self.settled: int | None = None  # the drafted chain the wait was counted for

    def observe(self, shape, seconds: float, rounds: int, slots: int, modelled: float | None = None,
                counted: tuple[float, int] | None = None, wide: tuple | None = None) -> None:
        """A chunk of `rounds` rounds of `shape` over `slots` slots took `seconds`; by what
        they emitted, they were `modelled` rounds of the kind this policy predicts tokens
        for (`batching.modelled_rounds`: a hybrid's wide lookup rounds count for more;
        default `rounds`). counted: (tokens, row-rounds) of its rounds the model describes
        (a tree's: its spines' tokens), for `calibration` where this policy chose the
        chunk; wide: its wide rounds, at a K below a hybrid's wide length (`WideRounds`).
        Plain rounds in a row count towards `revisit` at any slots. Timed
        (`round_seconds`): chunks of at least `timed_min_rounds` rounds over the curve's
        slots."""
        key = shape_key(shape)
        self.plain_run = self.plain_run + rounds if key == 0 else 0
        chose = self.predicted is not None and self.predicted[0] == key != 0
        if chose and counted is not None and counted[1] > 0:
            tally = self.calibrated.setdefault(self.predicted[1], [0.0, 0.0])
            tally[0] += counted[0]
            tally[1] += self.predicted[2] * counted[1]
        self.predicted = None
        if rounds >= max(self.timed_min_rounds, 1) and slots == self.curve.batch:
            timed = self.timed.setdefault(key, [0.0, 0, 0.0])
            timed[0] += seconds
            timed[1] += rounds
            timed[2] += rounds if modelled is None else modelled
            if wide is not None and counted is not None:
                self.wide.observe(key, wide, counted)

    @property
    def shapes(self) -> tuple:
        return tuple(self.ks) + tuple(self.trees)

    def round_seconds(self, shape) -> float:
        """A round's seconds at `shape`: the curve's, corrected by the run's timed chunks
        (`cost_weight`), per modelled round (`observe`; a hybrid's wide rounds pooled over
        the K values that run them, `WideRounds`)."""
        seconds, rounds, modelled = self._timed(shape)
        modelled = self.wide.modelled(shape_key(shape), rounds, modelled)
        prior = self.curve.rounds[shape_key(shape)] * self._drift()
        return (self.cost_weight * prior + seconds) / (self.cost_weight + modelled)

    def _drift(self) -> float:
        """Timed rounds' seconds over the curve's, pooled over shapes and shrunk toward 1
        with `cost_weight` rounds (rounds as they ran: the curve times no wide round)."""
        ratio = sum(s / self.curve.rounds[key] for key, (s, _, _) in self.timed.items())
        rounds = sum(n for _, n, _ in self.timed.values())
        return (self.cost_weight + ratio) / (self.cost_weight + rounds)

    def _margin(self, shape) -> float:
        """`margin`, times the larger share of the curve in the round seconds of plain
        rounds and of `shape` (`round_seconds`: `cost_weight` rounds at the curve's figure
        against the run's timed rounds)."""
        share = [self.cost_weight / (self.cost_weight + self._timed(x)[2]) for x in (0, shape)]
        return self.margin * max(share)

    def _timed(self, shape) -> tuple[float, int, float]:
        """The run's timed chunks at `shape`: (seconds, rounds, modelled rounds), 0 if none."""
        return self.timed.get(shape_key(shape), (0.0, 0, 0.0))

    def position_rates(self, depth) -> np.ndarray:
        """Each draft position's rate given the ones before it, over the rate of all tested
        positions together (what a row's alpha estimates), from the pooled (accepted,
        tested) by position (one entry per position up to the deepest shape); a position no
        round tested yet is taken at the first one's (`shrunk_rates`)."""
        accepted, tested = (np.asarray(a, float) for a in depth)
        overall = (accepted.sum() + 1.0) / (tested.sum() + 2.0)
        return shrunk_rates(accepted, tested, self.depth_weight) / overall

    def width_gain(self, tree: Tree, tree_tokens) -> float:
        """The tokens a tree's rounds emitted over those their spines would have, pooled
        with `gain_weight` tokens at 1; tree_tokens: shape key -> (tree's, spines')."""
        kept, spine = (tree_tokens or {}).get(shape_key(tree), (0.0, 0.0))
        return (kept + self.gain_weight) / (spine + self.gain_weight)

    def calibration(self, k: int) -> float:
        """The tokens that rounds of K drafts emitted over what the model predicted for
        them, pooled with `gain_weight` tokens at 1 (1 at K = 0: a plain round's token)."""
        emitted, predicted = self.calibrated.get(k, (0.0, 0.0))
        return (emitted + self.gain_weight) / (predicted + self.gain_weight)

    @staticmethod
    def chain_length(shape) -> int:
        """A chain's K, or a tree's spine length (what the chain model predicts it by)."""
        return len(shape.spine) if isinstance(shape, Tree) else shape

    @staticmethod
    def model_tokens(k: int, alpha: np.ndarray, rates=None) -> np.ndarray:
        """Each row's expected tokens a round of K drafts, uncalibrated."""
        return expected_tokens(alpha, k) if rates is None else expected_tokens_by_position(alpha, rates, k)

    def tokens_per_second(self, shape, alpha: np.ndarray, rates=None, tree_tokens=None) -> float:
        """shape: a chain's K, or a Tree (its spine's chain, calibrated, times its
        `width_gain`)."""
        k = self.chain_length(shape)
        gain = self.width_gain(shape, tree_tokens) if isinstance(shape, Tree) else 1.0
        tokens = self.calibration(k) * float(np.sum(self.model_tokens(k, alpha, rates)))
        return gain * tokens / self.round_seconds(shape)

    def __call__(self, accepted: np.ndarray, tested: np.ndarray, depth=None, tree_tokens=None) -> int:
        """depth: (accepted, tested) draft tokens by position, pooled over rows
        (`depth_counts`; a tree round's spine counts as a chain), or None for the plain
        model; tree_tokens: shape key -> (tokens the tree's rounds emitted, tokens their
        spines would have), with trees. Returns an index into `shapes`; a tree not yet run
        is chosen once wherever drafting is."""
        best, speeds = self._choice(accepted, tested, depth, tree_tokens)
        due = self._revisit_due(best, speeds)
        best = best if due is None else due
        if self.shapes[best] != 0:
            best = self._explore(best, speeds)
            best = self._reexplored(best, speeds)
            # a re-run of plain rounds times them (one chunk); a close plain call runs
            # until its revisit is due; a clear one until the batch changes
            self.plain_for = 0 if self.shapes[best] == 0 else None
        else:
            self.plain_for = max(self.revisit - self.plain_run, 0) if self._close(speeds) else None
        key, k = shape_key(self.shapes[best]), self.chain_length(self.shapes[best])
        self.chunks[best] += 1
        self.chosen.append(key)
        tokens = float(np.mean(self.model_tokens(k, *self._estimates)))
        self.predicted = (key, k, tokens)
        return best

    @property
    def explored(self) -> set[int]:
        """The indices (into `shapes`) that ran a chunk."""
        return {i for i, n in self.chunks.items() if n > 0}

    def _explore(self, best: int, speeds: list[float]) -> int:
        """Where drafting is chosen: a tree that has not run yet (its gain cannot move
        before it does) and could beat the chains (`_ceiling`), else a chain K that has not
        run yet and is predicted within `close` of `best` (its round seconds rest on the
        curve alone), else `best`."""
        explored, chains = self.explored, max(speeds[: len(self.ks)])
        fresh = [i for i in range(len(self.ks), len(self.shapes))
                 if i not in explored and self._ceiling(self.shapes[i]) > chains]
        fresh += [i for i, k in enumerate(self.ks) if k != 0 and i not in explored | {best}
                  and speeds[i] >= (1 - self.close) * speeds[best]]
        return fresh[0] if fresh else best

    def _ceiling(self, tree: Tree) -> float:
        """`tree`'s tokens per second if every running row kept its whole depth each round.
        A tree below the best chain even then could never be chosen, so it is not explored:
        at batch 32 a tree round cost 4-6 plain rounds, and its one chunk ~7% of a run."""
        return len(self._estimates[0]) * (tree.max_depth + 1) / self.round_seconds(tree)

    def _reexplored(self, best: int, speeds: list[float]) -> int:
        """`best`, or, once `reexplore_wait` drafted-chain choices ran since the last
        re-run, the other drafted chain predicted within `reexplore_within` of it that ran
        fewest chunks (plain rounds among them until a chunk of them was timed). The wait
        doubles with each re-run of a chain that has run `reexplore_evidence` chunks
        (`reexplore_max` at most) while the choice stays; a new choice starts it again at
        `reexplore`."""
        if best >= len(self.ks) or self.chunks[best] == 0:  # a tree, or a first run
            return best
        if best != self.settled:  # counted afresh for a new choice
            self.settled, self.reexplore_wait, self.chain_run = best, self.reexplore, 0
        self.chain_run += 1
        if self.chain_run < self.reexplore_wait:
            return best
        # plain rounds too while none was timed: a curve that overprices them (it priced
        # plain rounds at 2x their cost, K = 1 at 1.4x, in a run at batch 32 where K = 1
        # ran at 0.8x of plain) is corrected only by running them
        others = [i for i, k in enumerate(self.ks) if i != best
                  and (k != 0 or self._timed(0)[1] == 0)
                  and speeds[i] >= (1 - self.reexplore_within) * speeds[best]]
        if not others:
            return best
        self.chain_run = 0
        pick = min(others, key=lambda i: (self.chunks[i], i))
        if self.chunks[pick] + 1 >= self.reexplore_evidence:
            self.reexplore_wait = min(2 * self.reexplore_wait, self.reexplore_max)
        return pick

    def drafted_rounds(self, chunk: int) -> int:
        """The rounds a drafted chunk just chosen runs at most: `chunk` times how far the
        re-run wait has backed off (`reexplore_wait` / `reexplore`) at the settled chain,
        else `chunk`. A chunk costs ~1.5 ms beyond its rounds (2% of 16 at batch 1)."""
        settled = None if self.settled is None else shape_key(self.shapes[self.settled])
        if not self.chosen or self.chosen[-1] != settled:  # the last choice's shape
            return chunk
        return chunk * max(self.reexplore_wait // self.reexplore, 1)

    def plain_rounds(self, chunk: int) -> int | None:
        """The rounds a plain chunk the policy just chose runs at most before it is asked
        again (at least `chunk`), or None: until the batch changes (a clear plain call,
        which is never revisited)."""
        return None if self.plain_for is None else max(self.plain_for, chunk)

    def fresh_choice(self, depth=None, tree_tokens=None) -> int:
        """The index for rows none of which has tested a draft token yet (each at the
        pooled prior); not in `chosen`. A run this puts at K = 0 runs without the drafter
        (`batching.steps`): plain rounds test no draft, so its chunks' choices could not
        change. Its rounds count towards `revisit` (`observe`), so that a later run comes
        back to drafting (its first chunk) where the call was close."""
        best, speeds = self._choice(np.zeros(1), np.zeros(1), depth, tree_tokens)
        due = self._revisit_due(best, speeds)
        return best if due is None else due

    def _revisit_due(self, best: int, speeds: list[float]) -> int | None:
        """The drafted shape a revisit is due at instead of `best`, or None: the best one,
        where `revisit` plain rounds in a row ran and it is predicted within `close` of
        plain rounds."""
        if self.shapes[best] != 0 or self.plain_run < self.revisit or not self._close(speeds):
            return None
        return self._best_drafted(speeds)

    def _best_drafted(self, speeds: list[float]) -> int | None:
        """The index of the drafted shape (chain or tree) predicted fastest, None if none."""
        return max((i for i, shape in enumerate(self.shapes) if shape != 0), key=speeds.__getitem__,
                   default=None)

    def _close(self, speeds: list[float]) -> bool:
        """Whether the best drafted shape is predicted within `close` of plain rounds."""
        top = self._best_drafted(speeds)
        plain = speeds[self.shapes.index(0)] if 0 in self.shapes else 0.0
        return top is not None and speeds[top] >= (1 - self.close) * plain

    def _choice(self, accepted, tested, depth, tree_tokens=None) -> tuple[int, list[float]]:
        """(the index of the predicted fastest shape, every shape's predicted speed)."""
        pooled = None if depth is None else tuple(float(np.sum(c)) for c in depth)
        alpha = np.minimum(self.rows(np.asarray(accepted, float), np.asarray(tested, float), pooled), 0.999)
        rates = None if depth is None else self.position_rates(depth)
        self._estimates = alpha, rates
        speeds = [self.tokens_per_second(k, alpha, rates, tree_tokens) for k in self.shapes]
        chains = speeds[: len(self.ks)]
        best = int(np.argmax(chains))
        plain = (1 + self._margin(self.ks[best])) * chains[self.ks.index(0)] if 0 in self.ks else 0.0
        if 0 in self.ks and chains[best] < plain:
            best = self.ks.index(0)
        if self.trees:
            top = len(self.ks) + int(np.argmax(speeds[len(self.ks):]))
            if speeds[top] > (1 + self.tree_margin) * max(chains[best], plain):
                return top, speeds
        return best, speeds


def auto_policy(engine, batch: int, prompts) -> KPolicy:
    """The policy for `engine` (its K values) running `batch` slots on a run of `prompts`,
    from this machine's round costs at that shape (measured on first use, then read from
    disk)."""
    return KPolicy(cost_curve(engine, batch, engine.slots_for(prompts), width_for(prompts)),
                   engine.k.ks, engine.k.trees)
