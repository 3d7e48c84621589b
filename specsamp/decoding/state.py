"""The decoding loop's state and the one way tokens are committed to it.

All arrays have a leading batch axis B. Each row advances by its own count: rows never wait
for each other except that the loop runs until every row is done.

Convention: `length[b]` tokens of row b are final (prompt + generated). The last of them, at
index t = length - 1, is the "current" token: it has not yet been fed to the models, so
both caches hold valid entries for positions < t only.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from specsamp.models import KVCache

RUNNING, EOS, STOP, MAX_TOKENS = 0, 1, 2, 3
STOP_REASONS = {EOS: "eos", STOP: "stop", MAX_TOKENS: "max_tokens"}


@flax.struct.dataclass
class DecodeState:
    tokens: jax.Array  # [B, S] int32: prompt then generated tokens; beyond length: stale
    length: jax.Array  # [B] int32
    prompt_len: jax.Array  # [B] int32
    max_len: jax.Array  # [B] int32: prompt_len + max_new_tokens
    keys: jax.Array  # [B, 2] uint32: each row's own key (from its seed)
    stop_reason: jax.Array  # [B] int32, RUNNING until the row is done
    calls: jax.Array  # [B] int32: target calls (rounds) while the row was running
    # The round log, one entry per target call of the row (R = max new tokens >= calls), so
    # that statistics can be cut at any token (a stop string found on the host):
    round_tokens: jax.Array  # [B, R] int32: tokens the round appended
    round_accepted: jax.Array  # [B, R] int32: draft tokens kept AND appended; -1: no draft scored
    round_draft_calls: jax.Array  # [B, R] int32: draft model calls the round made
    round_drafted: jax.Array  # [B, R] int32: draft tokens the round scored (its K; 0: plain step)
    # [B, R] int32: draft tokens a tree round's first-child chain would have kept
    # (`tree_acceptance.spine_kept`; at most what the round kept), 0 for other rounds.
    round_spine: jax.Array
    target_cache: KVCache
    # The drafter's own loop state (its KV cache, the target's features it reads, ...): a
    # pytree the drafter defines (`Drafter.init_state`) and only the drafter reads; None
    # without one. Leaves have the batch axis first, except a KVCache's ([L, B, ...]).
    draft: Any = None

    @property
    def done(self) -> jax.Array:
        return self.stop_reason != RUNNING

    @property
    def current(self) -> jax.Array:
        return self.length - 1


def round_keys(state: DecodeState) -> jax.Array:
    """A fresh key per row and round: the row's key folded with its current length, which
    grows every round. A sample depends only on its seed and its own tokens, never on the
    batch it ran in."""
    return jax.vmap(jax.random.fold_in)(state.keys, state.length)


def gather_window(buf: jax.Array, start: jax.Array, width: int) -> jax.Array:
    """buf[b, start[b] : start[b] + width] for each row; buf [B, S, ...]."""
    return jax.vmap(lambda row, s: jax.lax.dynamic_slice(
        row, (s,) + (0,) * (row.ndim - 1), (width,) + row.shape[1:]))(buf, start)


def shifted_features(features: jax.Array, start: jax.Array, width: int) -> jax.Array:
    """For positions start..start+width-1 of each row, the target's feature at the
    previous position (zeros before position 0). features [B, S, D] -> [B, width, D]."""
    padded = jnp.pad(features, ((0, 0), (1, 0), (0, 0)))  # padded[j] = features[j - 1]
    return gather_window(padded, start, width)


def write_window(buf: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
    """buf[b, start[b] : start[b] + W] = new[b] for each row; buf [B, S, ...], new [B, W, ...]."""
    return jax.vmap(lambda row, u, s: jax.lax.dynamic_update_slice(
        row, u, (s,) + (0,) * (row.ndim - 1)))(buf, new, start)


def cond_in_place(pred: jax.Array, true_fn, false_fn, carry):
    """true_fn(carry) if pred else false_fn(carry); both return carry's structure.

    `jax.lax.cond` would do, but XLA copies every buffer a branch updates in place (a KV
    cache written by the layer loop: two 12 MB copies per round at batch 1, a third of a
    decode step) or passes through unchanged. A while loop's carried buffers are updated
    in place, so each branch runs as a loop of zero or one iterations."""
    def once(run, fn, carry):
        return jax.lax.while_loop(lambda c: c[1], lambda c: (fn(c[0]), jnp.zeros_like(c[1])),
                                  (carry, run))[0]

    pred = jnp.asarray(pred, bool)
    return once(~pred, false_fn, once(pred, true_fn, carry))


def prefix_positions(tokens: jax.Array) -> jax.Array:
    """Positions 0..T-1 for every row of tokens [B, T] (prefill)."""
    return jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)


def commit_accepted(state: DecodeState, kept: jax.Array, n: jax.Array, x: jax.Array,
                    eos_ids: jax.Array, stop_ids: jax.Array, drafted: int | jax.Array) -> DecodeState:
    """A drafted round's `commit`: the first n[b] of the draft tokens kept[b] (their order
    in the output; [B, K]) and then the target's token x[b]."""
    k = kept.shape[1]
    padded = jnp.concatenate([kept, jnp.zeros_like(kept[:, :1])], axis=1)
    new = jnp.where(jnp.arange(k + 1)[None, :] < n[:, None], padded, x[:, None])
    return commit(state, new, n + 1, n, eos_ids, stop_ids, drafted=drafted)


def commit(
    state: DecodeState, new: jax.Array, count: jax.Array, n_accepted: jax.Array,
    eos_ids: jax.Array, stop_ids: jax.Array, drafted: int | jax.Array,
) -> DecodeState:
    """Append new[b, :count[b]] to each running row, cut after an EOS or stop id (which is
    kept) or at max_len.

    new: [B, W] candidate tokens (entries at or beyond count are ignored);
    count: [B] tokens the round produced (1..W); n_accepted: [B] draft tokens kept;
    drafted: draft tokens the round scored, for all rows (an int) or per row ([B]); a row
    with 0 took a plain step and records no speculative round.
    """
    width = new.shape[1]
    j = jnp.arange(width)[None, :]
    produced = j < count[:, None]
    is_eos = jnp.isin(new, eos_ids)
    is_stop = produced & (is_eos | jnp.isin(new, stop_ids))
    any_stop = jnp.any(is_stop, axis=1)
    until_stop = jnp.where(any_stop, jnp.argmax(is_stop, axis=1) + 1, count)
    room = state.max_len - state.length
    emit = jnp.minimum(until_stop, room)
    running = ~state.done

    tokens = write_window(state.tokens, new, state.length)
    length = jnp.where(running, state.length + emit, state.length)
    hit_stop = any_stop & (until_stop <= room)
    stopped_on_eos = jnp.take_along_axis(is_eos, (until_stop - 1)[:, None], axis=1)[:, 0]
    stop_kind = jnp.where(stopped_on_eos, EOS, STOP)
    reason = jnp.where(hit_stop, stop_kind, jnp.where(length >= state.max_len, MAX_TOKENS, RUNNING))
    reason = jnp.where(running, reason, state.stop_reason)
    state = state.replace(
        tokens=jnp.where(running[:, None], tokens, state.tokens),
        length=length,
        stop_reason=reason,
        calls=state.calls + running.astype(jnp.int32),
    )
    drafted = jnp.broadcast_to(jnp.asarray(drafted, jnp.int32), emit.shape)
    accepted = jnp.where(drafted > 0, jnp.minimum(n_accepted, emit), -1)
    return _log_round(state, emit, accepted, drafted, running)


def _log_round(state: DecodeState, emit, accepted, drafted, running) -> DecodeState:
    """Record the round just committed at index calls - 1 of each running row. `accepted`
    counts only appended draft tokens: a round cut by EOS, a stop id or the token limit
    after j of its tokens kept min(n, j), so the log describes exactly the emitted tokens."""
    rows, at = jnp.arange(emit.shape[0]), state.calls - 1

    def put(log, value):
        return log.at[rows, at].set(jnp.where(running, value, log[rows, at]), mode="drop")

    return state.replace(round_tokens=put(state.round_tokens, emit),
                         round_accepted=put(state.round_accepted, accepted),
                         round_drafted=put(state.round_drafted, drafted))


def log_draft_calls(state: DecodeState, calls: jax.Array) -> DecodeState:
    """Record the draft calls of the round about to be committed (at index calls)."""
    return state.replace(round_draft_calls=_log_next(state, state.round_draft_calls, calls))


def log_spine(state: DecodeState, kept: jax.Array) -> DecodeState:
    """Record what the spine of the tree round about to be committed kept (`round_spine`)."""
    return state.replace(round_spine=_log_next(state, state.round_spine, kept))


def _log_next(state: DecodeState, log: jax.Array, value: jax.Array) -> jax.Array:
    """log [B, R] with entry `calls` of each running row set to value [B]."""
    rows = jnp.arange(state.calls.shape[0])
    value = jnp.where(state.done, log[rows, state.calls], value)
    return log.at[rows, state.calls].set(value, mode="drop")
