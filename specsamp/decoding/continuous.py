"""Continuous batching: B slots that stay busy while prompts remain.

The design is JetStream's prefill / insert / generate split. The host keeps a queue of
prompts and a decode state of B rows (slots). `insert` prefills a few prompts at once into
fresh rows and scatters them into free slots (every field of a row, the drafter's own state
included, so nothing of a slot's previous occupant survives); `decode_chunk` runs
the compiled loop of rounds until enough slots have freed up to be worth refilling (or a
round limit, for stop strings and the batch-aware K policy), then returns to the host.
Once the queue is empty, the host moves the running rows into fewer slots whenever half
are free (`_Run.compact`), so a run's last rows do not compute a batch of finished ones.

Exactness is that of the static engine: each row's round keys are its own key folded with
its own length (`state.round_keys`), and no round reads another row, so a sample depends
only on its prompt, seed and settings, never on its slot, its neighbours or when it was
inserted. Per-row timing is the row's own: its share of the insert call that prefilled it,
and for each chunk the chunk's time times the fraction of the chunk's rounds the row ran.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Callable, Generator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specsamp.compilation import compiled
from specsamp.decoding import stats
from specsamp.decoding.decode import Program, _ar_round, _spec_round, gather_rows, insert, new_state
from specsamp.decoding.engine import Engine, RawSample, prefill_groups, prompt_bucket
from specsamp.decoding.kpolicy import depth_counts
from specsamp.decoding.rounds import from_log, round_logs
from specsamp.decoding.state import MAX_TOKENS, RUNNING, STOP, STOP_REASONS, DecodeState


@dataclasses.dataclass(frozen=True)
class Variant:
    """One compiled program of the family a continuous engine switches between: `prog`'s
    drafter at K = prog.k, or (plain) autoregressive rounds that keep the drafter's cache
    and features level, so that drafting can resume in a later chunk."""

    prog: Program
    plain: bool = False


def empty_state(prog: Program, batch: int, slots: int, max_new: int) -> DecodeState:
    """B free slots: every row done, nothing to compute for them."""
    ones = jnp.ones((batch,), jnp.int32)
    state = new_state(prog, jnp.zeros((batch, 1), jnp.int32), ones, max_new,
                      jnp.zeros((batch,), jnp.uint32), slots)
    return state.replace(stop_reason=jnp.full((batch,), MAX_TOKENS, jnp.int32))


def _round(variant: Variant, target_params, draft_params, state, eos_ids, stop_ids):
    prog = variant.prog
    if prog.drafter is None or variant.plain:
        # Plain rounds with a drafter leave its cache behind (`resync` catches up) but let
        # it observe the target's hidden states (features), which only the target computes.
        return _ar_round(prog, target_params, state, eos_ids, stop_ids)
    return _spec_round(prog, target_params, draft_params, state, eos_ids, stop_ids)


@jax.jit(static_argnames=("prog", "width"), donate_argnames=("state",))
def resync(prog: Program, draft_params, state: DecodeState, width: int) -> DecodeState:
    """Rebuild the drafter's cache from each row's tokens 0..width-1 (width: at least every
    running row's length), after plain rounds that did not feed it. Positions past a row's
    length get stale entries that later writes overwrite, as in prefill."""
    start = jnp.zeros((state.tokens.shape[0],), jnp.int32)
    return state.replace(draft=prog.drafter.prefill(draft_params, state.tokens[:, :width],
                                                    state.draft, start))


@jax.jit(static_argnames=("variant",), donate_argnames=("state",))
def decode_chunk(variant: Variant, target_params, draft_params, state: DecodeState, eos_ids,
                 stop_ids, max_rounds, refill_at):
    """Rounds until no row runs, `max_rounds` have run, or at least `refill_at` rows are
    done (free slots the host can refill). Returns (state, rounds run)."""

    def cond(carry):
        state, i = carry
        running = state.stop_reason == RUNNING
        free = jnp.sum(~running)
        return jnp.any(running) & (i < max_rounds) & (free < refill_at)

    def body(carry):
        state, i = carry
        return _round(variant, target_params, draft_params, state, eos_ids, stop_ids), i + 1

    return jax.lax.while_loop(cond, body, (state, jnp.int32(0)))


# policy(accepted, tested, depth) -> index into the engine's ks: accepted and tested draft
# tokens of each running row so far, and the engine's (accepted, tested) by draft position.
PolicyFn = Callable[[np.ndarray, np.ndarray, tuple], int]


@dataclasses.dataclass
class ContinuousEngine:
    """Runs prompts through `batch` slots of one `Engine`'s program.

    ks: the K values it may switch between per chunk (0: plain rounds), default the
    program's own K; `policy(accepted, tested, depth)` picks an index into ks from the
    running rows' accepted and tested draft tokens and the engine's by draft position
    (`specsamp.decoding.kpolicy.KPolicy`).
    """

    engine: Engine
    batch: int
    ks: tuple[int, ...] = ()
    policy: PolicyFn | None = None
    chunk_rounds: int = 1 << 30  # rounds per device call at most (stop strings, the K policy)
    refill_fraction: float = 0.125  # return to the host once this share of slots is free
    compact: bool = True  # move a run's last rows into fewer slots (`_Run.compact`)

    def __post_init__(self):
        self.ks = tuple(self.ks) or (self.engine.prog.k,)
        prog = self.engine.prog
        # one compiled chunk program per K of ks (`decode_chunk`; also what
        # `costs.time_rounds` times)
        self.variants = [Variant(prog) if prog.drafter is None
                          else Variant(prog, plain=True) if k == 0
                          else Variant(dataclasses.replace(prog, drafter=prog.drafter.with_k(k)))
                          for k in self.ks]
        self.k_rounds = collections.Counter()  # rounds run per K (statistics)
        self.slot_rounds = collections.Counter()  # rounds run per slot count (statistics)
        # The drafter's accepted and tested tokens by draft position, pooled over every
        # row this engine ran (for the K policy: a property of the drafter, not of a run).
        self.depth = (np.zeros(max(self.ks)), np.zeros(max(self.ks)))
        self.prefill_s = self.decode_s = 0.0  # wall seconds of inserts / chunks, all runs

    @staticmethod
    def width_for(prompts: Sequence[Sequence[int]]) -> int:
        """The prompt buffer's width for a run of `prompts`: its longest one's bucket."""
        return prompt_bucket(max((len(p) for p in prompts), default=1))

    def slots_for(self, prompts: Sequence[Sequence[int]]) -> int:
        """Cache slots per row for a run of `prompts` (one size for every slot)."""
        need = self.width_for(prompts) + self.engine.max_new_tokens + max(*self.ks, self.engine.prog.span) + 2
        return -(-need // 128) * 128

    def run(self, prompts: Sequence[Sequence[int]], seeds: Sequence[int], stop_ids=(),
            should_stop: Callable[[int, list[int]], bool] | None = None,
            progress: Callable[[int], None] | None = None) -> list[RawSample]:
        """Like `Engine.run`, for any number of prompts; `should_stop(i, ids)` gets the
        prompt's index i."""
        steps = self.steps(prompts, seeds, stop_ids, should_stop, progress)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value

    def steps(self, prompts: Sequence[Sequence[int]], seeds: Sequence[int], stop_ids=(),
              should_stop: Callable[[int, list[int]], bool] | None = None,
              progress: Callable[[int], None] | None = None,
              ) -> Generator[None, None, list[RawSample]]:
        """`run`, one chunk at a time: a generator that yields after each chunk of rounds
        and returns the samples, so that a caller can take turns between engines
        (`specsamp bench --throughput` runs its continuous settings so)."""
        eng = self.engine
        for ids in prompts:
            eng.check_prompt(ids)
        n = len(prompts)
        prog = eng.prog
        fresh = getattr(self.policy, "fresh_choice", None)
        if prog.drafter is not None and fresh is not None and self.ks[fresh(self.depth)] == 0:
            # The policy puts fresh rows at K = 0, and plain rounds test no draft, so every
            # chunk of this run would choose K = 0 (`KPolicy.fresh_choice`): the run goes
            # without the drafter, computing what the autoregressive engine computes (no
            # drafter prefill, no drafter state), with the same tokens as plain rounds.
            prog = dataclasses.replace(prog, drafter=None)
        state = eng.place(empty_state(prog, self.batch, self.slots_for(prompts), eng.max_new_tokens))
        eos = jnp.asarray(np.array(eng.eos_ids or (-1,), np.int32))
        stops = jnp.asarray(np.array(tuple(stop_ids) or (-1,), np.int32))
        run = _Run(self, prompts, seeds, state, prog)
        while run.pending or run.active():
            run.refill()
            t0 = time.perf_counter()  # a drafter's resync (in _choose) is decode time too
            compiling = run.compile_s
            run.compact()
            variant, k = self._choose(run)
            # Plain chunks teach the policy nothing (no draft is tested), so it would choose
            # K = 0 again: they run on until slots free up, as an autoregressive engine does
            # (unless stop strings need the host every chunk_rounds rounds).
            rounds_cap = self.chunk_rounds if (k or should_stop is not None) else 1 << 30
            traced = dict(target_params=eng.target_params, draft_params=eng.draft_params,
                          state=run.state, eos_ids=eos, stop_ids=stops,
                          max_rounds=jnp.int32(rounds_cap), refill_at=jnp.int32(run.refill_at()))
            exe, seconds = compiled(decode_chunk, dict(variant=variant), traced)
            run.compile_s += seconds
            t0 += run.compile_s - compiling  # compiling is not decoding (`compile_s` column)
            run.state, rounds = exe(**traced)
            rounds = int(rounds)  # waits for the chunk
            seconds = time.perf_counter() - t0
            self.k_rounds[k] += rounds
            self.slot_rounds[len(run.slot_row)] += rounds
            self.decode_s += seconds
            run.charge_decode(seconds, rounds, k)
            if should_stop is not None:
                run.apply_stop_strings(should_stop)
            run.collect()
            if progress is not None:
                progress(n - len(run.pending) - len(run.active()))
            yield
        return run.results

    def _choose(self, run: "_Run") -> tuple[Variant, int]:
        if run.prog.drafter is None and self.engine.prog.drafter is not None:
            return Variant(run.prog), 0  # a run without the drafter (see `run`)
        if self.policy is None or len(self.ks) == 1:
            return self.variants[0], self.ks[0]
        i = self.policy(*run.acceptance())
        variant = self.variants[i]
        if run.plain and not variant.plain and variant.prog.drafter.uses_cache:
            eng = self.engine
            width = min(prompt_bucket(int(np.asarray(run.state.length).max())), run.state.tokens.shape[1])
            traced = dict(draft_params=eng.draft_params, state=run.state)
            exe, seconds = compiled(resync, dict(prog=variant.prog, width=width), traced)
            run.compile_s += seconds
            run.state = exe(**traced)
        run.plain = variant.plain
        return variant, self.ks[i]


class _Run:
    """Host bookkeeping of one `ContinuousEngine.run`: the queue, who sits in which slot,
    and each prompt's own prefill and decode time."""

    def __init__(self, owner: ContinuousEngine, prompts, seeds, state, prog: Program):
        self.owner, self.prompts, self.state, self.prog = owner, prompts, state, prog
        self.width = owner.width_for(prompts)  # inserted prompts pad to it
        self.seeds = [s % (1 << 32) for s in seeds]
        self.pending = collections.deque(range(len(prompts)))
        self.slot_row = [-1] * owner.batch  # prompt index in each slot, -1: free
        self.prefill_s = [0.0] * len(prompts)
        self.decode_s = [0.0] * len(prompts)
        self.calls = np.zeros(owner.batch, np.int64)
        self.compile_s = 0.0  # compiled since the last collected row (charged to the next one)
        self.accepted = np.zeros(owner.batch)
        self.tested = np.zeros(owner.batch)
        self.reason = np.full(owner.batch, MAX_TOKENS)
        self.plain = False  # the last chunk ran plain rounds (the drafter's cache is behind)
        self.results: list = [None] * len(prompts)

    def active(self) -> list[int]:
        return [s for s, r in enumerate(self.slot_row) if r >= 0]

    def refill_at(self) -> int:
        """Free slots at which the next chunk returns to the host: to refill while prompts
        are queued; after that, once half the slots are free (to `compact`), or at the end."""
        slots = len(self.slot_row)
        if not self.pending:
            return slots - slots // 2 if self.compacts() else slots + 1
        free = slots - len(self.active())
        return free + max(1, min(len(self.pending), round(self.owner.batch * self.owner.refill_fraction)))

    def compacts(self) -> bool:
        """Whether this run moves its last rows into fewer slots (not on a split target:
        the state's placement is the engine's)."""
        return self.owner.compact and len(self.slot_row) >= 2 and self.owner.engine.mesh is None

    def compact(self) -> None:
        """With no prompt left to insert and at most half the slots running, move the running
        rows into a state of fewer slots (the next power of two that holds them), so that
        the last rounds of a run compute only them: a round of 32 rows costs ~4x one of 8
        on a CPU. Every field of a row moves with it (its cache, drafter state, keys and
        counters), and a row's sample never depends on its slot."""
        active = self.active()
        if self.pending or not active or not self.compacts() or len(active) > len(self.slot_row) // 2:
            return
        size = 1 << (len(active) - 1).bit_length()
        free = [s for s, r in enumerate(self.slot_row) if r < 0]
        order = active + free[: size - len(active)]  # filler slots are free (done) rows
        traced = dict(state=self.state, rows=jnp.asarray(order, jnp.int32))
        exe, seconds = compiled(gather_rows, {}, traced)
        self.compile_s += seconds
        self.state = exe(**traced)
        self.slot_row = [self.slot_row[s] for s in order]
        self.calls, self.accepted, self.tested, self.reason = (
            a[order] for a in (self.calls, self.accepted, self.tested, self.reason))

    def refill(self) -> None:
        free = [s for s, r in enumerate(self.slot_row) if r < 0]
        take = [self.pending.popleft() for _ in range(min(len(free), len(self.pending)))]
        if not take:
            return
        for j, i in enumerate(take):
            self.slot_row[free[j]] = i
            self.calls[free[j]] = self.accepted[free[j]] = self.tested[free[j]] = 0
            self.reason[free[j]] = RUNNING
        groups = prefill_groups([len(self.prompts[i]) for i in take])
        for members, chunks in groups:
            self._insert([take[j] for j in members], [free[j] for j in members], chunks,
                         pad_rows=len(groups) == 1)

    def _insert(self, rows: list[int], slots: list[int], chunks: int, pad_rows: bool) -> None:
        """Prefill prompts `rows` into `slots` in one call of `chunks` prefill passes; with
        pad_rows, the call's row count is rounded up to a power of two (few shapes; padding
        rows are dropped). Prompts pad to the run's longest one's bucket: one shape per
        row count."""
        eng, b = self.owner.engine, self.owner.batch
        n = min(1 << (len(rows) - 1).bit_length(), b) if pad_rows else len(rows)
        padded = np.zeros((n, self.width), np.int32)
        lens, seeds = np.ones(n, np.int32), np.zeros(n, np.uint32)
        where = np.full(n, b, np.int32)  # padding rows go to slot b: dropped
        for j, (i, slot) in enumerate(zip(rows, slots)):
            ids = self.prompts[i]
            padded[j, : len(ids)], lens[j], seeds[j], where[j] = ids, len(ids), self.seeds[i], slot
        traced = dict(target_params=eng.target_params, draft_params=eng.draft_params,
                      state=self.state, prompts=jnp.asarray(padded), lens=jnp.asarray(lens),
                      seeds=jnp.asarray(seeds), slots=jnp.asarray(where),
                      chunks=jnp.int32(chunks))
        exe, seconds = compiled(insert, dict(prog=self.prog, max_new=eng.max_new_tokens), traced)
        self.compile_s += seconds
        t0 = time.perf_counter()
        self.state = exe(**traced)
        jax.block_until_ready(self.state.length)
        seconds = time.perf_counter() - t0
        self.owner.prefill_s += seconds
        share = seconds / len(rows)  # the rows' shares add up to the call's time
        for i in rows:
            self.prefill_s[i] = share

    def charge_decode(self, seconds: float, rounds: int, k: int) -> None:
        """Give each row its share of a chunk that ran `rounds` rounds at K = k, and count
        its tested draft tokens for the K policy (a round that kept fewer than k stopped at
        a rejection). A hybrid's wide rounds (more lookup tokens than k) are left out: they
        run only in chunks of a smaller K, and their long matches, kept far more often than
        the model's chained guesses, made the policy overrate K = 4."""
        st = self.state
        calls, log, widths = (np.asarray(a) for a in (st.calls, st.round_accepted, st.round_drafted))
        self.reason = np.array(st.stop_reason)
        depth = self.owner.depth
        for s in self.active():
            # A round takes the same time for every row of the batch.
            self.decode_s[self.slot_row[s]] += seconds * int(calls[s] - self.calls[s]) / max(rounds, 1)
            new, ks = log[s, self.calls[s] : calls[s]], widths[s, self.calls[s] : calls[s]]
            loops = new[(new >= 0) & (ks == k)]  # -1: a plain round
            accepted, _, tested = stats.loop_counts(loops, k)
            self.accepted[s] += accepted
            self.tested[s] += tested
            for total, part in zip(depth, depth_counts(loops, k, len(depth[0]))):
                total += part
        self.calls = calls.astype(np.int64)

    def acceptance(self) -> tuple[np.ndarray, np.ndarray, tuple]:
        """(accepted, tested) draft tokens so far of each running row, and the engine's
        (accepted, tested) by draft position, over all its runs."""
        running = [s for s in self.active() if self.reason[s] == RUNNING]
        return self.accepted[running], self.tested[running], self.owner.depth

    def apply_stop_strings(self, should_stop) -> None:
        reason = np.asarray(self.state.stop_reason).copy()
        tokens, length = np.asarray(self.state.tokens), np.asarray(self.state.length)
        changed = False
        for s in self.active():
            i = self.slot_row[s]
            if reason[s] == RUNNING and should_stop(i, tokens[s, len(self.prompts[i]) : length[s]].tolist()):
                reason[s], changed = STOP, True
        if changed:
            self.state = self.state.replace(stop_reason=jnp.asarray(reason))

    def collect(self) -> None:
        st = self.state
        reason = np.asarray(st.stop_reason)
        done = [s for s in self.active() if reason[s] != RUNNING]
        if not done:
            return
        tokens, length, calls = np.asarray(st.tokens), np.asarray(st.length), np.asarray(st.calls)
        logs = round_logs(st)
        for s in done:
            i, lo = self.slot_row[s], len(self.prompts[self.slot_row[s]])
            n = int(calls[s])
            # The row's own decode time stands as a "batch" of its own rounds, so that
            # `RawSample.decode_s` is exactly it (and a stop-string cut scales it by rounds).
            self.results[i] = RawSample(
                token_ids=tuple(int(x) for x in tokens[s, lo : length[s]]), prompt_tokens=lo,
                stop_reason=STOP_REASONS[int(reason[s])],
                rounds=from_log(*(log[s] for log in logs), n),
                prefill_s=self.prefill_s[i], batch_decode_s=self.decode_s[i], batch_rounds=max(n, 1),
                compile_s=self.compile_s)
            self.compile_s = 0.0  # the column sums to the run's compile time
            self.slot_row[s] = -1
