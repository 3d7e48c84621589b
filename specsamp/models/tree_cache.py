"""After a token tree's round: the accepted path's keys and values moved to slot = position.

A tree's scoring block (`Model.forward(..., paths=)`) writes the root and its N nodes at
slots start..start+N, while node i sits at position start + its depth. Once acceptance
has chosen a path (`tree_acceptance`: node indices by depth, -1 padded, a length per
row), the next call must find the path where a chain would have left it, the node at
depth d at slot start + d. `keep_path` copies them there, every layer, keys and values.
Slots past the accepted depth keep what they hold (other nodes' entries): they are past
the row's length, never read, and the next writes overwrite them, as rejected drafts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specsamp.models.llama import KVCache


def keep_path(cache: KVCache, path: jax.Array, start: jax.Array) -> KVCache:
    """cache (k, v [L, B, J, S, E], any float type); path [B, K] int32, each row's accepted
    nodes by depth (node i at block slot start + 1 + i), -1 past its accepted ones; start
    [B] the root's slot. Returns the cache with slot start + 1 + d holding what slot
    start + 1 + path[b, d] held, for each accepted d; all other slots unchanged. A chain's
    path (node d at depth d + 1) leaves the cache as it is."""
    path = jnp.asarray(path, jnp.int32)
    start = jnp.asarray(start, jnp.int32)[:, None]
    depth = jnp.arange(path.shape[1], dtype=jnp.int32)[None]
    dest = jnp.where(path >= 0, start + 1 + depth, cache.size)  # past the end: dropped
    src = jnp.clip(start + 1 + path, 0, cache.size - 1)
    rows = jnp.broadcast_to(jnp.arange(path.shape[0])[:, None], path.shape)

    def move(a):  # all sources read before any write: a path may cross its own slots
        return a.at[:, rows, :, dest].set(a[:, rows, :, src], mode="drop")

    return KVCache(k=move(cache.k), v=move(cache.v))
