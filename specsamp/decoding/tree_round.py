"""A token tree's round in the compiled loop (`decode.generate` with `Program.tree` set).

The drafter proposes a tree of the program's static shape per row (`propose_tree`,
`tree_draft`), or for a `DynamicTree` its candidates, of which each row keeps the nodes
its draft scores best (`tree.select_nodes`: a tree per row, the same number of nodes);
the target scores the root (the current token) and the N nodes in one call with the
tree's attention (`Model.forward(..., paths=)`); acceptance walks the tree
(`tree_acceptance`: greedy, or sampling for how the drafter says the children were
chosen); the accepted path's keys and values move to slot = position (`keep_path`); the
path's tokens and the token after it are committed as a chain round's would be. The
drafter's caches move their path entries likewise, so that a chain round may follow a
tree round on the same state (`--tree auto` switches shapes between chunks).

Statistics: a tree round records drafted = N (the nodes scored, the target's extra rows)
and accepted = the accepted depth (draft tokens kept and appended), so accepted / drafted
is the share of scored nodes kept; tokens per target call stay the chain's meaning. For
`--tree auto` it also records what its spine, the first-child chain, kept (`round_spine`):
the same round's chain, against which the tree's width is measured. Sampled, the spine is
tested token by token (the per-token rule, `--verify token`); a block-verified chain keeps
a little more in expectation (1-2.5% more tokens per call, docs/measurements.md), so the
tree's measured width gain flatters the tree by that much.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specsamp.decoding.sampling import probs_from_logits
from specsamp.decoding.state import (
    DecodeState, commit_accepted, gather_window, log_draft_calls, log_spine, round_keys,
)
from specsamp.decoding.tree import DynamicTree, block_paths, block_positions, select_nodes
from specsamp.decoding.tree_acceptance import (
    accept_tree_batch, accept_tree_greedy_batch, spine_kept, spine_kept_greedy,
)
from specsamp.models.argmax import first_argmax
from specsamp.models import KVCache
from specsamp.models.tree_cache import keep_path


def tree_round(prog, target_params, draft_params, state: DecodeState, eos_ids, stop_ids):
    """One round over prog.tree: draft, score in one target call, accept, commit."""
    keys = round_keys(state)  # split as the chain's round: 0 drafts, 1 accepts
    draft_keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, 0)
    accept_keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, 1)
    if isinstance(prog.tree, DynamicTree):  # each row scores its best nodes of the candidates
        proposal = prog.drafter.propose_tree(draft_params, state, draft_keys, prog.tree.candidates,
                                             scored=True)
        tree, chosen, tokens = select_nodes(prog.tree, proposal.tokens, proposal.scores)
    else:
        proposal = prog.drafter.propose_tree(draft_params, state, draft_keys, prog.tree)
        tree, chosen, tokens = prog.tree, None, proposal.tokens
    state = log_draft_calls(state, jnp.full(state.calls.shape, proposal.calls, jnp.int32))

    t = state.current
    block = jnp.concatenate([gather_window(state.tokens, t, 1), jnp.maximum(tokens, 0)],
                            axis=1)  # [B, N+1]: an absent node scores token 0, never tested
    target = prog.model
    hidden, cache = target.forward(target_params, block, block_positions(tree, t),
                                   state.target_cache, head=False, paths=block_paths(tree))
    logits = target.logits(target_params, hidden)
    if prog.sampling.greedy:
        argmax = first_argmax(logits, prog.native)
        acc = accept_tree_greedy_batch(tokens, argmax, tree=tree)
        spine = spine_kept_greedy(tokens, argmax, tree=tree)
    else:
        q = probs_from_logits(logits, prog.sampling)
        p = jnp.zeros_like(q) if proposal.p is None else proposal.p  # None: FIXED, not read
        if chosen is not None and proposal.p is not None:  # the chosen nodes' rows
            rows = jnp.concatenate([jnp.zeros_like(chosen[:, :1]), chosen + 1], axis=1)
            p = jnp.take_along_axis(p, rows[:, :, None], axis=1)
        acc = accept_tree_batch(accept_keys, tokens, p, q, tree=tree,
                                children=proposal.children, fixed=proposal.fixed_rows)
        spine = spine_kept(acc.path, tree=tree)
    state = log_spine(state, spine)

    kept = jnp.take_along_axis(tokens, jnp.maximum(acc.path, 0), axis=1)  # [B, K]
    # The target's features along the accepted path (root, then its nodes; the root's row
    # past them, stale positions a later round overwrites) for a drafter that reads them.
    rows = jnp.concatenate([jnp.zeros_like(acc.path[:, :1]), acc.path + 1], axis=1)  # [B, K+1]
    draft_state = prog.drafter.observe(
        proposal.draft_state, jnp.take_along_axis(hidden, rows[:, :, None], axis=1), t)
    # The draft's cache too, so that what follows finds the path where a chain round
    # leaves its drafts: a chain round after this one (`--tree auto`) rewrites only the
    # last position or the last K + 1, not the slots a tree block put elsewhere.
    # (A dynamic tree's drafter wrote every candidate: its path by the candidates' numbers.
    # A drafter that fed the spine alone left it where a chain's steps do: nothing to move,
    # and a leaf it kept, never fed, is the last accepted token, which every next round's
    # first draft call rewrites.)
    if not proposal.chain_layout:
        draft_path = acc.path if chosen is None else jnp.where(
            acc.path >= 0, jnp.take_along_axis(chosen, jnp.maximum(acc.path, 0), axis=1), -1)
        draft_state = jax.tree.map(lambda c: keep_path(c, draft_path, t) if isinstance(c, KVCache) else c,
                                   draft_state, is_leaf=lambda x: isinstance(x, KVCache))
    state = state.replace(target_cache=keep_path(cache, acc.path, t), draft=draft_state)
    return commit_accepted(state, kept, acc.n, acc.token, eos_ids, stop_ids, drafted=prog.tree.size)
