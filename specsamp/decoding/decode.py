"""The compiled programs, the engine's device side: `insert` (prefill prompts into slots),
`generate` (a loop, `jax.lax.while_loop`, of rounds at one K: plain autoregressive rounds,
the baseline, or speculative ones), `gather_rows` (move rows into fewer slots) and
`resync` (rebuild a drafter's cache after plain rounds).

`Program` is static (hashable): model configs, K, the sampling transform, the drafter, and
a token tree's shape where rounds draft trees (`tree_round`; None: chains).
Parameters and state are traced arguments, so one compiled program serves any weights of
the same shapes.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specsamp.decoding.acceptance import accept_batch, accept_block_batch, accept_greedy, check_verify
from specsamp.decoding.config import SamplingParams, no_tree_drafter
from specsamp.decoding.drafters import Drafter
from specsamp.decoding.tree import DynamicTree, Tree
from specsamp.decoding.tree_draft import check_level_order
from specsamp.decoding.tree_round import tree_round
from specsamp.errors import UserError
from specsamp.decoding.sampling import probs_from_logits, sample
from specsamp.decoding.state import (
    MAX_TOKENS, RUNNING, DecodeState, commit, commit_accepted, cond_in_place, gather_window,
    log_draft_calls, prefix_positions, round_keys,
)
from specsamp.models import KVCache, Model, ModelConfig, init_cache
from specsamp.models.argmax import first_argmax
from specsamp.models.model import default_attention
from specsamp.quant import kernels


@dataclasses.dataclass(frozen=True)
class Program:
    target: ModelConfig
    sampling: SamplingParams
    drafter: Drafter | None = None  # None: autoregressive baseline
    kv_cache: str = "float32"  # the target cache's type (`config.KV_CACHES`)
    # Whether the native CPU kernels (attention over the cache, the argmax) or XLA compute
    # this program: decided once (`with_backend`, when an `Engine` is built) and carried
    # as part of the static program; None: decided wherever a model is traced.
    native: bool | None = None
    # A token tree's static shape (`tree.Tree`): every drafted round drafts and scores that
    # tree (`tree_round`), its drafter drafting K = the tree's depth; or a `DynamicTree`
    # (N nodes per row chosen among its candidates). None: chains of K.
    tree: Tree | DynamicTree | None = None
    # How a sampled chain's K draft tokens are tested (`acceptance.VERIFY_RULES`): 'block'
    # (block verification, at least as many tokens kept) or 'token' (the paper's per-token
    # rule). Both are exact; greedy rounds and trees are not affected.
    verify: str = "block"

    def __post_init__(self):
        check_verify(self.verify)
        if self.tree is None:
            return
        if self.drafter is None or not hasattr(self.drafter, "propose_tree"):
            kind = "no drafter" if self.drafter is None else f"drafter {self.drafter.kind!r}"
            raise UserError(no_tree_drafter(kind))
        check_level_order(getattr(self.tree, "candidates", self.tree))
        getattr(self.drafter, "check_tree", lambda tree: None)(self.tree)
        if self.drafter.k != self.tree.max_depth:
            object.__setattr__(self, "drafter", self.drafter.with_k(self.tree.max_depth))

    def with_backend(self) -> "Program":
        """This program with its backend decided: the native kernels on one CPU device
        where they load (`quant.kernels.on_one_cpu_device`), else XLA; its drafter too."""
        if self.native is not None:
            return self
        native = kernels.on_one_cpu_device()
        drafter = self.drafter.with_native(native) if self.drafter is not None else None
        return dataclasses.replace(self, native=native, drafter=drafter)

    @property
    def model(self) -> Model:
        """The target, on this program's backend (the mesh is the state's placement)."""
        return Model(self.target, attention=default_attention(self.target, None, self.native))

    @property
    def k(self) -> int:
        return self.drafter.k if self.drafter is not None else 0

    def at_k(self, k: int) -> "Program":
        """This program with its drafter drafting k tokens a round (k >= 1)."""
        return self if k == self.k else dataclasses.replace(self, drafter=self.drafter.with_k(k))

    @property
    def wide(self) -> int:
        """The lookup tokens of a hybrid drafter's wide rounds (`HybridDrafter.wide`), else 0."""
        wide = getattr(self.drafter, "wide", None)
        return wide.k if wide is not None else 0

    @property
    def span(self) -> int:
        """The most draft tokens a round may score: K, or more in a hybrid's wide rounds or
        a tree's (its N nodes)."""
        return max(self.k, self.wide, self.tree.span if self.tree else 0)


def row_keys(seeds: jax.Array) -> jax.Array:
    """Each row's random key from its seed [B] uint32 (`state.round_keys` folds it)."""
    return jax.vmap(jax.random.PRNGKey)(seeds)


def new_state(
    prog: Program, prompts: jax.Array, prompt_len: jax.Array, max_new: int, seeds: jax.Array,
    slots: int,
) -> DecodeState:
    """prompts [B, P] (right-padded), prompt_len [B] >= 1, seeds [B] uint32."""
    b, p = prompts.shape
    tokens = jnp.zeros((b, slots), jnp.int32).at[:, :p].set(prompts)
    return DecodeState(
        tokens=tokens,
        length=prompt_len.astype(jnp.int32),
        prompt_len=jnp.array(prompt_len, jnp.int32),  # its own buffer: states are donated
        max_len=prompt_len.astype(jnp.int32) + max_new,
        keys=row_keys(seeds),
        stop_reason=jnp.full((b,), RUNNING, jnp.int32),
        calls=jnp.zeros((b,), jnp.int32),
        round_tokens=jnp.zeros((b, max_new), jnp.int32),
        round_accepted=jnp.full((b, max_new), -1, jnp.int32),
        round_draft_calls=jnp.zeros((b, max_new), jnp.int32),
        round_drafted=jnp.zeros((b, max_new), jnp.int32),
        round_spine=jnp.zeros((b, max_new), jnp.int32),
        target_cache=init_cache(prog.target, b, slots, jnp.dtype(prog.kv_cache)),
        draft=prog.drafter.init_state(b, slots) if prog.drafter is not None else None,
    )


@jax.jit(static_argnames=("prog", "batch", "slots", "max_new"))
def empty_state(prog: Program, batch: int, slots: int, max_new: int) -> DecodeState:
    """B free slots: every row done, nothing to compute for them. (One compiled program:
    op by op, a state is dozens of small programs, compiled again after every cache clear.)"""
    ones = jnp.ones((batch,), jnp.int32)
    state = new_state(prog, jnp.zeros((batch, 1), jnp.int32), ones, max_new,
                      jnp.zeros((batch,), jnp.uint32), slots)
    return state.replace(stop_reason=jnp.full((batch,), MAX_TOKENS, jnp.int32))


# Positions a pass of prefill's loop feeds. A prompt is prefilled in passes of this many
# positions, so it computes fewer than PREFILL_CHUNK padding positions (a one-token prompt:
# one pass), and one compiled prefill serves every prompt length: the count of passes is
# traced (docs/measurements.md: why 32).
PREFILL_CHUNK = 32


def prefill_chunks(n: int) -> int:
    """Prefill passes for a prompt of n tokens: all but its last token (the first round
    feeds that one), PREFILL_CHUNK positions a pass; at least one, so that a one-token
    prompt joins the group of its batch-mates instead of making a call (and a compiled
    shape) of its own."""
    return max(1, -(-(n - 1) // PREFILL_CHUNK))


@jax.jit(static_argnames=("prog",))
def prefill(prog: Program, target_params, draft_params, state: DecodeState, chunks):
    """Feed each row's tokens at positions 0..chunks * PREFILL_CHUNK - 1 (chunks: traced),
    a pass of a loop per PREFILL_CHUNK positions: all but each row's current token; entries
    past that are padding, written to slots that later writes overwrite. A row's numbers
    are those of one call over all its positions (the passes attend to the cache the
    earlier ones wrote) wherever the kernels compute each row alike whatever the call's
    shape (the native CPU kernels do), and never depend on how many passes run beyond a
    row's prompt (those only write padding)."""
    c = PREFILL_CHUNK
    b = state.tokens.shape[0]
    target = prog.model

    def one_pass(i, state):
        start = i * c
        tokens = jax.lax.dynamic_slice_in_dim(state.tokens, start, c, axis=1)
        at = jnp.full((b,), start, jnp.int32)
        hidden, cache = target.forward(
            target_params, tokens, at[:, None] + prefix_positions(tokens), state.target_cache,
            head=False)
        state = state.replace(target_cache=cache)
        if prog.drafter is not None:
            draft = prog.drafter.observe(state.draft, hidden, at)
            state = state.replace(draft=prog.drafter.prefill(draft_params, tokens, draft, at))
        return state

    return jax.lax.fori_loop(0, chunks, one_pass, state)


def _by_row(f, state: DecodeState, *others: DecodeState) -> DecodeState:
    """jax.tree.map of f(batch axis, leaf, *the others' leaves) over a decode state: the
    batch axis is 1 in KV caches ([L, B, J, S, E]), 0 in every other field."""
    def rows(full, *parts):
        if isinstance(full, KVCache):
            return jax.tree.map(lambda a, *b: f(1, a, *b), full, *parts)
        return f(0, full, *parts)

    return jax.tree.map(rows, state, *others, is_leaf=lambda x: isinstance(x, KVCache))


def scatter_rows(state: DecodeState, fresh: DecodeState, slots: jax.Array) -> DecodeState:
    """state's rows `slots` = fresh's rows (every field, the drafter's state included);
    slots past the batch are dropped (padding)."""
    return _by_row(lambda axis, full, part: full.at[(slice(None),) * axis + (slots,)].set(
        part, mode="drop"), state, fresh)


@jax.jit
def gather_rows(state: DecodeState, rows: jax.Array) -> DecodeState:
    """A state of len(rows) rows: state's rows `rows`, in that order (every field, the
    drafter's state included)."""
    return _by_row(lambda axis, full: jnp.take(full, rows, axis=axis), state)


@jax.jit(static_argnames=("prog", "max_new"), donate_argnames=("state",))
def insert(prog: Program, target_params, draft_params, state: DecodeState, prompts, lens, seeds,
           slots, chunks, max_new: int, source=None) -> DecodeState:
    """Prefill prompts [n, P] (right-padded; lens [n], seeds [n]) into slots [n] of state,
    in `chunks` passes (traced: at least every prompt's `prefill_chunks`).

    source [n] (optional): rows that share a prompt are prefilled once. Then prompts [u, P]
    and lens [u] are the distinct prompts and slot i takes prompt source[i], with its own
    seeds[i]. A row's prefill does not depend on the call's other rows (`prefill`), so the
    copy holds the bits that prefilling the row alone would give."""
    seeds_u = seeds if source is None else jnp.zeros(prompts.shape[:1], jnp.uint32)
    fresh = new_state(prog, prompts, lens, max_new, seeds_u, state.tokens.shape[1])
    fresh = prefill(prog, target_params, draft_params, fresh, chunks)
    if source is not None:
        fresh = gather_rows(fresh, source).replace(keys=row_keys(seeds))
    return scatter_rows(state, fresh, slots)


@jax.jit(static_argnames=("prog", "width"), donate_argnames=("state",))
def resync(prog: Program, draft_params, state: DecodeState, width: int) -> DecodeState:
    """Rebuild the drafter's cache from each row's tokens 0..width-1 (width: at least every
    running row's length), after plain rounds that did not feed it. Positions past a row's
    length get stale entries that later writes overwrite, as in prefill."""
    start = jnp.zeros((state.tokens.shape[0],), jnp.int32)
    return state.replace(draft=prog.drafter.prefill(draft_params, state.tokens[:, :width],
                                                    state.draft, start))


def _ar_round(prog: Program, target_params, state: DecodeState, eos_ids, stop_ids):
    t = state.current
    current = gather_window(state.tokens, t, 1)
    target = prog.model
    hidden, cache = target.forward(target_params, current, t[:, None], state.target_cache, head=False)
    logits = target.logits(target_params, hidden)
    if prog.drafter is not None:  # e.g. keep a feature draft's inputs complete across plain rounds
        state = state.replace(draft=prog.drafter.observe(state.draft, hidden, t))
    if prog.sampling.greedy:  # sample() on the one-hot probabilities returns the argmax
        x = first_argmax(logits[:, 0], prog.native)
    else:
        x = jax.vmap(sample)(round_keys(state), probs_from_logits(logits[:, 0], prog.sampling))
    ones = jnp.ones_like(t)
    state = state.replace(target_cache=cache)
    return commit(state, x[:, None], ones, jnp.zeros_like(t), eos_ids, stop_ids, drafted=0)


def _spec_round(prog: Program, target_params, draft_params, state: DecodeState, eos_ids, stop_ids):
    wide = getattr(prog.drafter, "wide_lookup", lambda _: None)(state)
    if wide is None:
        return _drafted_round(prog, target_params, draft_params, state, eos_ids, stop_ids,
                              prog.drafter.propose)
    # A hybrid's wide round when every running row has a long lookup match: a round scores
    # the same number of tokens for all rows (one compiled call), so the choice is the batch's.
    return cond_in_place(
        jnp.all(wide.found | (state.stop_reason != RUNNING)),
        lambda s: _drafted_round(prog, target_params, draft_params, s, eos_ids, stop_ids,
                                 lambda params, st, _: prog.drafter.propose_wide(params, st, wide)),
        lambda s: _drafted_round(prog, target_params, draft_params, s, eos_ids, stop_ids,
                                 prog.drafter.propose),
        state,
    )


def _drafted_round(prog: Program, target_params, draft_params, state: DecodeState, eos_ids,
                   stop_ids, propose):
    """A round that drafts with propose(draft_params, state, draft_keys) -> Proposal."""
    keys = round_keys(state)
    draft_keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, 0)
    proposal = propose(draft_params, state, draft_keys)
    calls = prog.drafter.calls_per_round if proposal.calls is None else proposal.calls
    state = log_draft_calls(state, jnp.broadcast_to(jnp.asarray(calls, jnp.int32), state.calls.shape))
    draft, p, found, point = proposal.draft, proposal.p, proposal.found, proposal.point
    state = state.replace(draft=proposal.draft_state)  # what the rest of the round observes into
    if found is None:
        return _score(prog, target_params, state, keys, draft, p, eos_ids, stop_ids, point=point)
    # A drafter that may have nothing to propose (n-gram lookup without a match): when no
    # running row has a proposal, a plain step is cheaper than scoring K+1 tokens. In a
    # scored round, rows without a proposal take exactly the plain step too (same key, same
    # token), so a sample and its statistics never depend on its batch-mates.
    return cond_in_place(
        jnp.any(found & (state.stop_reason == RUNNING)),
        lambda s: _score(prog, target_params, s, keys, draft, p, eos_ids, stop_ids, found, point),
        lambda s: _ar_round(prog, target_params, s, eos_ids, stop_ids),
        state,
    )


def _score(prog: Program, target_params, state, keys, draft, p, eos_ids, stop_ids, found=None,
           point=None):
    """Score [current, draft] with the target in one call and apply the rejection rule
    (p None or `point`: point-mass drafts, `drafters.Proposal`)."""
    k = draft.shape[1]
    accept_keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, 1)

    t = state.current
    block = jnp.concatenate([gather_window(state.tokens, t, 1), draft], axis=1)  # [B, K+1]
    positions = t[:, None] + jnp.arange(k + 1)[None, :]
    target = prog.model
    hidden, cache = target.forward(target_params, block, positions, state.target_cache, head=False)
    logits = target.logits(target_params, hidden)
    draft_state = prog.drafter.observe(state.draft, hidden, t)  # e.g. the target's features
    if prog.sampling.greedy:  # q is a point mass on the argmax: no [B, K+1, V] arrays
        argmax = first_argmax(logits, prog.native)
        n = accept_greedy(draft, argmax)
        if found is not None:
            n = jnp.where(found, n, 0)  # as _ar_round: the argmax at the current position
        x = jnp.take_along_axis(argmax, n[:, None], axis=1)[:, 0]
    else:
        q = probs_from_logits(logits, prog.sampling)
        rule = accept_block_batch if prog.verify == "block" else accept_batch
        n, x = rule(accept_keys, draft, p, q, point)
        if found is not None:
            n = jnp.where(found, n, 0)
            x = jnp.where(found, x, jax.vmap(sample)(keys, q[:, 0]))  # as _ar_round draws it

    state = state.replace(target_cache=cache, draft=draft_state)
    return commit_accepted(state, draft, n, x, eos_ids, stop_ids,
                           drafted=k if found is None else jnp.where(found, k, 0))


def _round(prog: Program, k: int, target_params, draft_params, state, eos_ids, stop_ids):
    if prog.drafter is None or k == 0:
        # Plain rounds with a drafter leave its cache behind (`resync` catches up) but let
        # it observe the target's hidden states (features), which only the target computes.
        return _ar_round(prog, target_params, state, eos_ids, stop_ids)
    if prog.tree is not None:
        return tree_round(prog, target_params, draft_params, state, eos_ids, stop_ids)
    return _spec_round(prog.at_k(k), target_params, draft_params, state, eos_ids, stop_ids)


@jax.jit(static_argnames=("prog", "k"), donate_argnames=("state",))
def generate(prog: Program, k: int, target_params, draft_params, state: DecodeState, eos_ids,
             stop_ids, max_rounds, refill_at):
    """The one round program: rounds at K = k (0: plain rounds, which keep a drafter's
    features level so that drafting can resume later) until no row runs, `max_rounds`
    have run, or at least `refill_at` rows are done (free slots the host can refill).
    Returns (state, rounds run)."""

    def cond(carry):
        state, i = carry
        running = state.stop_reason == RUNNING
        free = jnp.sum(~running)
        return jnp.any(running) & (i < max_rounds) & (free < refill_at)

    def body(carry):
        state, i = carry
        return _round(prog, k, target_params, draft_params, state, eos_ids, stop_ids), i + 1

    return jax.lax.while_loop(cond, body, (state, jnp.int32(0)))
