"""Host side of decoding: pads prompts to fixed shapes, runs the compiled programs, times
them, and turns the final state into `Completion`s. Works on token ids; text lives in
`specsamp.generator`.

Shapes are bucketed so that few programs are compiled: prompts pad to a power of two
(at least 32), the cache to a multiple of 128 slots.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specsamp.decode import Program, decode, new_state, prefill
from specsamp.errors import UserError
from specsamp.state import STOP_REASONS

_MIN_BUCKET = 32


def enable_compilation_cache() -> None:
    """Reuse compiled programs across processes (tests, workers, repeated CLI runs)."""
    path = os.environ.get("SPECSAMP_JAX_CACHE") or os.path.join(
        os.environ.get("SPECSAMP_CACHE", os.path.expanduser("~/.cache/specsamp")), "jax"
    )
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def prompt_bucket(n: int) -> int:
    return max(_MIN_BUCKET, 1 << max(0, n - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class RawSample:
    """What the device returns for one row, before detokenisation."""

    token_ids: tuple[int, ...]
    prompt_tokens: int
    stop_reason: str
    calls: int  # target calls
    loops: int  # speculative rounds (calls that scored a draft)
    draft_calls: int  # draft model calls
    accepted: tuple[int, ...]
    prefill_s: float
    decode_s: float


@dataclasses.dataclass
class Engine:
    """Runs one `Program` on fixed weights.

    target_params / draft_params: pytrees (draft_params None for n-gram and the baseline).
    eos_ids: token ids that end a sample (kept in the output).
    """

    prog: Program
    target_params: object
    draft_params: object = None
    eos_ids: tuple[int, ...] = ()
    max_new_tokens: int = 256
    rounds_per_call: int = 1 << 30
    mesh: Any = None  # a tensor-parallel mesh (specsamp.mesh) the params are placed on

    def _place(self, state):
        """The decode state on the mesh: replicated, except the target's KV cache, which
        is split as the target's weights are (`Model.cache_sharding`)."""
        if self.mesh is None:
            return state
        from specsamp.mesh import replicate
        from specsamp.models import Model

        cache = Model(self.prog.target, self.mesh).shard_cache(state.target_cache)
        return replicate(state.replace(target_cache=None), self.mesh).replace(target_cache=cache)

    @property
    def max_prompt_tokens(self) -> int:
        return self.prog.target.max_seq_len - self.max_new_tokens - self.prog.k - 2

    def _slots(self, bucket: int) -> int:
        need = bucket + self.max_new_tokens + self.prog.k + 2
        return -(-need // 128) * 128

    def check_prompt(self, ids: Sequence[int]) -> None:
        if not ids:
            raise UserError("empty prompt")
        if len(ids) > self.max_prompt_tokens:
            raise UserError(
                f"prompt has {len(ids)} tokens; at most {self.max_prompt_tokens} fit with "
                f"max-new-tokens {self.max_new_tokens} in the model's context of "
                f"{self.prog.target.max_seq_len}"
            )

    def run(
        self,
        prompts: Sequence[Sequence[int]],
        seeds: Sequence[int],
        stop_ids: Sequence[int] = (),
        should_stop: Callable[[int, list[int]], bool] | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> list[RawSample]:
        """Generate for a batch of token-id prompts, one seed each.

        should_stop(row, generated_ids) is asked between device calls (every
        `rounds_per_call` rounds) for stop strings; progress(n_done_rows) likewise.
        """
        for ids in prompts:
            self.check_prompt(ids)
        b = len(prompts)
        lens = np.array([len(p) for p in prompts], np.int32)
        bucket = prompt_bucket(int(lens.max()))
        padded = np.zeros((b, bucket), np.int32)
        for i, ids in enumerate(prompts):
            padded[i, : len(ids)] = ids
        seeds_arr = np.array([s % (1 << 32) for s in seeds], np.uint32)
        drafter = self.prog.drafter
        draft_cfg = drafter.cfg if drafter is not None and drafter.uses_cache else None
        state = new_state(
            self.prog, jnp.asarray(padded), jnp.asarray(lens), self.max_new_tokens,
            jnp.asarray(seeds_arr), self._slots(bucket), draft_cfg,
            feature_dim=self.prog.target.d_model if getattr(drafter, "needs_features", False) else 0,
        )
        state = self._place(state)
        eos = jnp.asarray(np.array(self.eos_ids or (-1,), np.int32))
        stops = jnp.asarray(np.array(tuple(stop_ids) or (-1,), np.int32))

        t0 = time.perf_counter()
        # The current (last) prompt token is fed by the first round, not by prefill.
        state = prefill(self.prog, self.target_params, self.draft_params, state, bucket - 1)
        jax.block_until_ready(state.target_cache.k)
        t1 = time.perf_counter()
        state = self._decode(state, eos, stops, lens, should_stop, progress)
        t2 = time.perf_counter()
        return self._collect(state, lens, t1 - t0, t2 - t1)

    def _decode(self, state, eos, stops, lens, should_stop, progress):
        while True:
            state = decode(
                self.prog, self.target_params, self.draft_params, state, eos, stops,
                jnp.int32(self.rounds_per_call),
            )
            reason = np.asarray(state.stop_reason)
            if should_stop is not None and (reason == 0).any():
                reason = self._apply_stop_strings(state, reason, lens, should_stop)
                state = state.replace(stop_reason=jnp.asarray(reason))
            if progress is not None:
                progress(int((reason != 0).sum()))
            if (reason != 0).all():
                return state

    @staticmethod
    def _apply_stop_strings(state, reason, lens, should_stop):
        tokens, length = np.asarray(state.tokens), np.asarray(state.length)
        reason = reason.copy()
        for row in np.flatnonzero(reason == 0):
            if should_stop(int(row), tokens[row, lens[row] : length[row]].tolist()):
                reason[row] = 2  # STOP
        return reason

    def _collect(self, state, lens, prefill_s, decode_s) -> list[RawSample]:
        tokens, length = np.asarray(state.tokens), np.asarray(state.length)
        calls, loops = np.asarray(state.calls), np.asarray(state.loops)
        draft_calls = np.asarray(state.draft_calls)
        accepted = np.asarray(state.accepted)
        reason = np.asarray(state.stop_reason)
        busiest = max(int(calls.max()), 1)
        b = len(lens)
        return [
            RawSample(
                token_ids=tuple(int(x) for x in tokens[i, lens[i] : length[i]]),
                prompt_tokens=int(lens[i]),
                stop_reason=STOP_REASONS[int(reason[i])],
                calls=int(calls[i]),
                loops=int(loops[i]),
                draft_calls=int(draft_calls[i]),
                accepted=tuple(int(x) for x in accepted[i, : loops[i]]) if self.prog.k else (),
                # Latency as the row saw it: the batch's prefill, then decoding until the
                # row's last round (rounds of a batch take equal time).
                prefill_s=prefill_s,
                decode_s=decode_s * int(calls[i]) / busiest,
            )
            for i in range(b)
        ]
