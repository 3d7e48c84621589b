"""Prompt-lookup drafters (the `Drafter` protocol of `specsamp.decoding.drafters`).

- `NgramDrafter`: prompt lookup; finds the latest earlier occurrence of the last n tokens and
  proposes what followed. Deterministic, so p is a point mass (one-hot). It drafts token
  trees of branches too (`propose_tree`): the W best matches, one a branch.
- `HybridDrafter`: prompt lookup where it finds a match (of 2 tokens or more, as the
  factory builds it), a model drafter (e.g. the trained feature draft) for the other rows;
  the model's chain is skipped in rounds where every running row has a match. With `k
  auto` it also runs wide rounds (more lookup tokens than K on long matches).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from specsamp.decoding.drafters import FeatureDrafter, FeatureState, Proposal
from specsamp.decoding.state import RUNNING, DecodeState, cond_in_place
from specsamp.decoding.tree import DynamicTree, Tree
from specsamp.decoding.tree_acceptance import Children
from specsamp.decoding.tree_draft import FeatureSteps, TreeProposal, children_mode
from specsamp.errors import UserError
from specsamp.models import ModelConfig


@dataclasses.dataclass(frozen=True)
class NgramDrafter:
    k: int
    vocab_size: int
    max_ngram: int = 3
    min_ngram: int = 1
    kind = "ngram"

    @property
    def uses_cache(self) -> bool:
        return False

    def init_state(self, batch: int, slots: int) -> None:
        return None  # a lookup in the tokens: no state of its own

    def observe(self, draft_state, hidden, start):
        return draft_state

    def prefill(self, params, tokens, draft_state, start):
        return draft_state

    @property
    def calls_per_round(self) -> int:
        return 0

    def with_k(self, k: int) -> "NgramDrafter":
        return dataclasses.replace(self, k=k)

    def with_native(self, native: bool) -> "NgramDrafter":
        return self  # no model

    def propose(self, params, state: DecodeState, keys: jax.Array):
        del params, keys
        draft, found = jax.vmap(self._lookup)(state.tokens, state.current)
        return Proposal(draft, None, state.draft, found)  # p: the point mass on the draft

    @staticmethod
    def check_tree(tree: Tree) -> None:
        """Lookup drafts trees of branches: each child of the root starts a chain (widths
        W x 1 x 1 ...), one match a branch."""
        if isinstance(tree, DynamicTree):
            raise UserError(f"n-gram lookup has no probabilities to choose a tree's nodes by: "
                            f"--tree {tree.nodes} needs a draft model (draft 'auto' or a trained draft)")
        if np.any((tree.children[1:] >= 0).sum(axis=1) > 1):
            raise UserError(f"n-gram lookup drafts trees of branches, widths like 3x1x1 "
                            f"(a match each), not parents {list(tree.parents)}")

    def propose_tree(self, params, state: DecodeState, keys: jax.Array, tree: Tree) -> TreeProposal:
        """W branches = the W best matches (longest n-gram, then latest occurrence), each
        followed as far as the tree is deep: chosen without drawing (`Children.FIXED`);
        a branch without a match is absent. No draft calls."""
        del params, keys
        self.check_tree(tree)
        width = int((np.asarray(tree.parents) < 0).sum())
        branches, found = jax.vmap(lambda r, t: self._matches(r, t, width, tree.max_depth))(
            state.tokens, state.current)  # [B, W, K], [B, W]
        branch = np.array([int(np.flatnonzero(tree.ancestors[i])[0]) for i in range(tree.size)])
        tokens = branches[:, branch, tree.depth - 1]
        return TreeProposal(jnp.where(found[:, branch], tokens, -1), None, state.draft,
                            Children.FIXED, 0)

    def _matches(self, row: jax.Array, t: jax.Array, width: int, depth: int):
        """row [S], current index t -> (the tokens after the `width` best match ends
        [W, depth], whether each was found [W]). Best: the longest n-gram, then the latest."""
        slots = row.shape[0]
        idx = jnp.arange(slots)
        score = jnp.full((slots,), -1)
        for n in range(self.min_ngram, self.max_ngram + 1):  # a longer match scores higher
            match = (idx >= n - 1) & (idx < t) & (t >= n - 1)
            for j in range(n):
                match &= jnp.roll(row, j)[idx] == row[jnp.maximum(t - j, 0)]
            score = jnp.where(match, n * slots + idx, score)
        best, ends = jax.lax.top_k(score, width)
        follow = jnp.minimum(ends[:, None] + 1 + jnp.arange(depth)[None], t)  # known tokens only
        return row[follow], best >= 0

    def _lookup(self, row: jax.Array, t: jax.Array) -> tuple[jax.Array, jax.Array]:
        """row [S], current index t -> (K proposed tokens, whether a match was found).
        The longest n-gram match wins, then the latest occurrence; with no match the
        proposal repeats the current token (still exact, only wasted)."""
        slots = row.shape[0]
        idx = jnp.arange(slots)
        best_end = jnp.full((), -1)
        for n in range(self.min_ngram, self.max_ngram + 1):  # longer matches override shorter
            match = (idx >= n - 1) & (idx < t) & (t >= n - 1)
            for j in range(n):
                match &= jnp.roll(row, j)[idx] == row[jnp.maximum(t - j, 0)]
            latest = jnp.max(jnp.where(match, idx, -1))
            best_end = jnp.where(latest >= 0, latest, best_end)
        follow = best_end + 1 + jnp.arange(self.k)
        follow = jnp.minimum(follow, t)  # never read past the known tokens
        proposal = row[follow]
        found = best_end >= 0
        return jnp.where(found, proposal, jnp.full((self.k,), row[t])), found


@dataclasses.dataclass(frozen=True)
class HybridDrafter:
    """Prompt lookup first, a feature draft for the rows it leaves without a proposal.

    Each row's proposal is either the n-gram continuation (a point mass) or the model's
    chain, chosen by that row's own tokens: exact under the rejection rule either way, and
    independent of batch-mates. When every running row has a match the model's chain is
    skipped; only its first call runs, so that its cache keeps up with the accepted tokens
    (the refresh window of K+1 positions covers everything a round can accept).
    """

    ngram: NgramDrafter
    model: FeatureDrafter
    # Wide rounds (`k auto`): when every running row has a lookup match of wide.min_ngram
    # tokens, the round scores wide.k lookup tokens instead of K (a long match is usually
    # followed further). The model's refresh window stays K+1: after a wide round that kept
    # more than K tokens, the positions before the window keep the draft's older entries
    # (proposals only, so still exact; a window of wide.k + 1 costs every round more and
    # gains no accepted tokens, docs/measurements.md).
    wide: NgramDrafter | None = None

    @property
    def k(self) -> int:
        return self.model.k

    @property
    def cfg(self) -> ModelConfig:
        return self.model.cfg

    @property
    def kind(self) -> str:
        return "ngram+" + self.model.kind

    @property
    def uses_cache(self) -> bool:
        return True

    @property
    def calls_per_round(self) -> int:
        return self.model.k  # at most; Proposal.calls says what each round used

    def init_state(self, batch: int, slots: int) -> FeatureState:
        return self.model.init_state(batch, slots)

    def observe(self, fs, hidden, start):
        return self.model.observe(fs, hidden, start)

    def prefill(self, params, tokens, fs, start):
        return self.model.prefill(params, tokens, fs, start)

    def forward(self, params, tokens, positions, cache):
        return self.model.forward(params, tokens, positions, cache)

    def with_k(self, k: int) -> "HybridDrafter":
        return HybridDrafter(self.ngram.with_k(k), self.model.with_k(k), self.wide)

    def with_native(self, native: bool) -> "HybridDrafter":
        return dataclasses.replace(self, model=self.model.with_native(native))

    def wide_lookup(self, state: DecodeState) -> Proposal | None:
        """The wide lookup of this round when wide rounds are longer than K (else None);
        `Proposal.found`: rows with a long match."""
        if self.wide is None or self.wide.k <= self.k:
            return None
        return self.wide.propose(None, state, None)

    def propose_wide(self, params, state: DecodeState, lookup: Proposal) -> Proposal:
        """A wide round: the lookup's wide.k tokens; the model's first call only (its
        cache keeps up with the accepted tokens)."""
        _, fs = self.model.refresh(params, state)
        return Proposal(lookup.draft, None, fs, lookup.found, jnp.ones_like(state.length))

    def propose(self, params, state: DecodeState, keys: jax.Array):
        lookup = self.ngram.propose(None, state, keys)
        found = lookup.found
        running = state.stop_reason == RUNNING

        # The carry: (draft, p) placeholders of the right shapes, and the draft state, which
        # each branch reads from the carry so that it is updated in place (`cond_in_place`).
        # The rows with a match draft point masses (`Proposal.point`): their p rows are
        # the model's or zeros, not read.
        def lookup_only(carry):
            _, fs = self.model.refresh(params, state.replace(draft=carry[2]))
            return lookup.draft, carry[1], fs

        def with_model(carry):
            drafted = self.model.propose(params, state.replace(draft=carry[2]), keys)
            return jnp.where(found[:, None], lookup.draft, drafted.draft), drafted.p, drafted.draft_state

        shape = lookup.draft.shape + (self.ngram.vocab_size,)
        draft, p, fs = cond_in_place(jnp.all(found | ~running), lookup_only, with_model,
                                     (lookup.draft, jnp.zeros(shape, jnp.float32), state.draft))
        calls = jnp.where(found, 1, self.k).astype(jnp.int32)
        return Proposal(draft, p, fs, None, calls, found)

    def check_tree(self, tree: Tree) -> None:
        """The lookup's shapes: trees of branches (`NgramDrafter.check_tree`); or a
        `DynamicTree` (`propose_tree`)."""
        if isinstance(tree, DynamicTree):
            return
        try:
            self.ngram.check_tree(tree)
        except UserError as e:
            raise UserError(f"the hybrid drafter ({self.kind}) drafts the lookup's trees: {e}") from None

    def _scored_lookup(self, state: DecodeState, tree: Tree):
        """A `DynamicTree`'s candidates from the lookup: its best matches as branches
        along the candidates whose rank paths are (b, 1, 1, ...), the best match first
        (scored above everything, then the next match), so a row's chosen nodes are its
        best match's chain as deep as the candidates go, then the next match's. Returns
        (tokens [B, Nc], scores [B, Nc], found [B])."""
        ranks = tree.rank_paths
        width = max(p[0] for p in ranks if all(r == 1 for r in p[1:]))
        branches, found = jax.vmap(lambda r, t: self.ngram._matches(r, t, width, tree.max_depth))(
            state.tokens, state.current)  # [B, W, K], [B, W]
        on = np.array([all(r == 1 for r in p[1:]) for p in ranks])
        branch = np.array([p[0] - 1 for p in ranks])
        tokens = jnp.where(on & found[:, branch], branches[:, branch, tree.depth - 1], -1)
        score = jnp.asarray(-(branch + 1e-3 * tree.depth), jnp.float32)
        return tokens, jnp.where(tokens >= 0, score, -jnp.inf), found[:, 0]

    def propose_tree(self, params, state: DecodeState, keys: jax.Array, tree: Tree,
                     scored: bool = False) -> TreeProposal:
        """A row with a lookup match drafts the lookup's tree (its best matches as
        branches, `Children.FIXED`; for a `DynamicTree`'s candidates, `scored`, those of
        `_scored_lookup` with their scores); a row without one, the model's tree (its
        children drawn as the model drafts them). Which one is decided by the row's own
        tokens before anything is drawn, and the proposal says it
        (`TreeProposal.fixed_rows`), so each row is accepted by the rule of how its
        children came: exact either way. When every running row has a match the model's
        tree is skipped; only its first call runs (its cache keeps up with the accepted
        tokens, as in chain rounds)."""
        running = state.stop_reason == RUNNING
        if scored:
            tokens, scores, found = self._scored_lookup(state, tree)
        else:
            tokens, scores = self.ngram.propose_tree(None, state, keys, tree).tokens, None
            found = tokens[:, 0] >= 0  # node 0 is the best match's first token
        sampled = not self.model.sampling.greedy
        b = state.current.shape[0]
        p0 = jnp.zeros((b, tree.size + 1, self.model.cfg.vocab_size), jnp.float32) if sampled else None
        pick = found[:, None]

        def lookup_only(carry):
            _, fs = self.model.refresh(params, state.replace(draft=carry[3]))
            return tokens, scores, carry[2], fs

        def with_model(carry):
            drafted = self.model.propose_tree(params, state.replace(draft=carry[3]), keys, tree, scored)
            return (jnp.where(pick, tokens, drafted.tokens),
                    None if scores is None else jnp.where(pick, scores, drafted.scores),
                    drafted.p, drafted.draft_state)

        tokens, scores, p, fs = cond_in_place(jnp.all(found | ~running), lookup_only, with_model,
                                              (tokens, scores, p0, state.draft))
        model_children = children_mode(self.model.sampling)
        calls = jnp.where(found, 1, tree.max_depth).astype(jnp.int32)
        return TreeProposal(tokens, p, fs, model_children, calls,
                            None if model_children is Children.FIXED else found, scores=scores,
                            chain_layout=FeatureSteps(self.model, tree).chain_layout)
