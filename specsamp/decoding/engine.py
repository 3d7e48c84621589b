"""Host side of decoding: pads prompts to fixed shapes, compiles the batch's programs
before any clock starts (`specsamp.compilation`), times their execution only, and turns the
final state into `RawSample`s. Works on token ids; text lives in `specsamp.decoding.generator`.

Shapes are bucketed so that few programs are compiled: prompts pad to `prompt_bucket`
(multiples of 32 up to 128, then two sizes per doubling), the cache to a multiple of 128
slots. Prefill runs passes of 32 positions up to each prompt's own length (their count is
traced, so prompt lengths compile nothing new); a batch whose prompts need different
counts of passes is prefilled in groups (`prefill_groups`) rather than every row for the
longest one's.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specsamp.compilation import compiled
from specsamp.decoding.decode import Program, decode, insert, new_state, prefill, prefill_chunks
from specsamp.decoding.rounds import Rounds, from_log, round_logs
from specsamp.decoding.state import STOP_REASONS
from specsamp.errors import UserError

_MIN_BUCKET = 32


def prompt_bucket(n: int) -> int:
    """The padded length of a prompt of n tokens: 32, 64, 96, 128, then 192, 256, 384,
    512, 768, ... (1.5x and 2x each power of two). It sizes the batch's arrays (the prompt
    buffer, and with max_new_tokens the cache), so few shapes are compiled; prefill does
    not compute the padding (it runs passes of `decode.PREFILL_CHUNK` positions up to each
    prompt's own length)."""
    n = max(n, 1)
    if n <= 128:
        return max(_MIN_BUCKET, -(-n // 32) * 32)
    top = 1 << (n - 1).bit_length()
    middle = top // 2 + top // 4
    return middle if n <= middle else top


def prefill_groups(lens: Sequence[int]) -> list[tuple[list[int], int]]:
    """How to prefill prompts of these lengths: groups (row indices, passes of the prefill
    loop, `decode.prefill_chunks`).

    One group (every row run for the longest prompt's passes) unless splitting saves at
    least a fifth of the positions computed: 32 HumanEval chat prompts of 81-212 tokens
    run 32 x 7 passes of 32 positions, 4,521 of them real. Rows are grouped by their own
    count of passes, each group split into powers of two (few shapes to compile: 18 rows
    -> 16 + 2). Each row's numbers do not depend on its group (rows are computed alike
    whatever else is in a call, and passes past a row's prompt only write padding), so
    neither does its sample."""
    by_count: dict[int, list[int]] = {}
    for i, n in enumerate(lens):
        by_count.setdefault(prefill_chunks(int(n)), []).append(i)
    groups = []
    for count in sorted(by_count):
        rows = by_count[count]
        while rows:
            size = 1 << (len(rows).bit_length() - 1)
            groups.append((rows[:size], count))
            rows = rows[size:]
    whole = len(lens) * max(by_count)
    if sum(len(rows) * count for rows, count in groups) > 0.8 * whole:
        return [(list(range(len(lens))), max(by_count))]
    return groups


@dataclasses.dataclass(frozen=True)
class RawSample:
    """What the device returns for one row, before detokenisation."""

    token_ids: tuple[int, ...]
    prompt_tokens: int
    stop_reason: str
    rounds: Rounds  # what each target call did (cut with `cut`)
    prefill_s: float  # the batch's prefill
    batch_decode_s: float  # the batch's decoding, all its rounds
    batch_rounds: int  # rounds the batch's loop ran (the most target calls of a row)
    compile_s: float = 0.0  # compiling this batch's programs (not in the times above)

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

    def place(self, state):
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
        return self.prog.target.max_seq_len - self.max_new_tokens - self.prog.span - 2

    def _slots(self, bucket: int) -> int:
        need = bucket + self.max_new_tokens + self.prog.span + 2
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
        state = new_state(
            self.prog, jnp.asarray(padded), jnp.asarray(lens), self.max_new_tokens,
            jnp.asarray(seeds_arr), self._slots(bucket),
        )
        state = self.place(state)
        eos = jnp.asarray(np.array(self.eos_ids or (-1,), np.int32))
        stops = jnp.asarray(np.array(tuple(stop_ids) or (-1,), np.int32))

        groups = (prefill_groups(lens) if self.mesh is None
                  else [(list(range(b)), prefill_chunks(int(lens.max())))])
        prefill_calls, s1 = self._prefill_calls(state, groups, padded, lens, seeds_arr)
        run_decode, s2 = self._compile_decode(state, eos, stops)
        t0 = time.perf_counter()
        for call in prefill_calls:
            state = call(state)
        jax.block_until_ready(state.target_cache.k)
        t1 = time.perf_counter()
        state = self._decode(run_decode, state, eos, stops, lens, should_stop, progress)
        t2 = time.perf_counter()
        return self._collect(state, lens, t1 - t0, t2 - t1, s1 + s2)

    def _prefill_calls(self, state, groups, padded, lens, seeds):
        """The batch's prefill as calls state -> state, compiled now (before any clock
        starts; a no-op for shapes met before), and the seconds compiling took: one prefill
        of every row, or one insert per group of `prefill_groups`. The compiled programs
        depend on the batch's shapes and each group's row count, not on prompt lengths
        (the count of prefill passes is traced)."""
        params = dict(target_params=self.target_params, draft_params=self.draft_params)
        if len(groups) == 1:
            chunks = jnp.int32(groups[0][1])
            exe, seconds = compiled(prefill, dict(prog=self.prog),
                                    dict(**params, state=state, chunks=chunks))
            return [lambda st: exe(**params, state=st, chunks=chunks)], seconds
        calls, total = [], 0.0
        for rows, chunks in groups:
            at = np.asarray(rows)
            traced = dict(**params, prompts=jnp.asarray(padded[at]),
                          lens=jnp.asarray(lens[at]), seeds=jnp.asarray(seeds[at]),
                          slots=jnp.asarray(at.astype(np.int32)), chunks=jnp.int32(chunks))
            exe, seconds = compiled(insert, dict(prog=self.prog, max_new=self.max_new_tokens),
                                    dict(traced, state=state))
            calls.append(lambda st, exe=exe, traced=traced: exe(**traced, state=st))
            total += seconds
        return calls, total

    def _compile_decode(self, state, eos, stops):
        params = dict(target_params=self.target_params, draft_params=self.draft_params)
        return compiled(decode, dict(prog=self.prog), dict(
            **params, state=state, eos_ids=eos, stop_ids=stops, max_rounds=self._rounds_arg()))

    def _rounds_arg(self):
        return jnp.int32(self.rounds_per_call)

    def _decode(self, run_decode, state, eos, stops, lens, should_stop, progress):
        while True:
            state = run_decode(target_params=self.target_params, draft_params=self.draft_params,
                               state=state, eos_ids=eos, stop_ids=stops, max_rounds=self._rounds_arg())
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

    def _collect(self, state, lens, prefill_s, decode_s, compile_s) -> list[RawSample]:
        tokens, length = np.asarray(state.tokens), np.asarray(state.length)
        calls, reason = np.asarray(state.calls), np.asarray(state.stop_reason)
        logs = round_logs(state)
        return [
            RawSample(
                token_ids=tuple(int(x) for x in tokens[i, lens[i] : length[i]]),
                prompt_tokens=int(lens[i]),
                stop_reason=STOP_REASONS[int(reason[i])],
                rounds=from_log(*(log[i] for log in logs), int(calls[i])),
                prefill_s=prefill_s,
                batch_decode_s=decode_s,
                batch_rounds=int(calls.max()),
                compile_s=compile_s if i == 0 else 0.0,  # once per batch: the column sums
            )
            for i in range(len(lens))
        ]
