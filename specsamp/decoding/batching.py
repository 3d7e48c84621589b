"""The host runner on top of the engine's device API: who sits in which slot, when to
insert, when to move rows into fewer slots, and each row's time.

A batching mode is a host policy of this one runner, not a program of its own:
`Static` inserts every prompt at once (one slot each), never refills or moves rows, runs
until all are done, and gives each row its batch's times; `Continuous` keeps B slots busy
while prompts remain (JetStream's prefill / insert / generate split): it inserts queued
prompts into free slots, runs chunks of rounds until enough slots have freed up to be
worth refilling (or a round limit, for stop strings and the K policy), and once the queue
is empty moves the running rows into fewer slots whenever half are free (`_Run.compact`),
so a run's last rows do not compute a batch of finished ones.

Exactness does not depend on the policy: each row's round keys are its own key folded
with its own length (`state.round_keys`), and no round reads another row, so a sample
depends only on its prompt, seed and settings (and the K schedule, under `--k auto`),
never on its slot, its neighbours or when it was inserted. Continuous timing is each
row's own: its share of the insert call that prefilled it, and for each chunk the chunk's
time times the fraction of the chunk's rounds the row ran.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Callable, Generator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specsamp.decoding.decode import Program, prefill_chunks
from specsamp.decoding.config import shape_key
from specsamp.decoding.costs import shape_program
from specsamp.decoding.position_rates import depth_counts
from specsamp.decoding.rounds import RawSample, from_log, round_logs
from specsamp.decoding.shapes import prefill_groups, prompt_bucket, width_for
from specsamp.decoding.state import MAX_TOKENS, RUNNING, STOP, STOP_REASONS

_NEVER = 1 << 30


@dataclasses.dataclass(frozen=True)
class Static:
    """Every prompt in a slot of its own, inserted at once; run until all are done. Each
    row reports its batch's prefill and decode time and rounds (compiling on row 0)."""

    chunk_rounds: int = _NEVER  # rounds per device call at most (stop strings, progress)


@dataclasses.dataclass(frozen=True)
class Continuous:
    """`slots` slots refilled from the queue as rows finish. Each row reports its own share
    of the inserts and chunks it was in."""

    slots: int
    chunk_rounds: int = _NEVER  # rounds per device call at most (stop strings, the K policy)
    refill_fraction: float = 0.125  # return to the host once this share of slots is free
    compact: bool = True  # move a run's last rows into fewer slots (`_Run.compact`)


Batching = Static | Continuous


def steps(engine, batching: Batching, prompts: Sequence[Sequence[int]], seeds: Sequence[int],
          stop_ids=(), should_stop: Callable[[int, list[int]], bool] | None = None,
          progress: Callable[[int], None] | None = None,
          ) -> Generator[None, None, list[RawSample]]:
    """`engine`'s run of `prompts` under `batching`, a chunk at a time: yields after each
    chunk of rounds and returns the samples, so that a caller can take turns between
    engines (`specsamp bench --throughput` does). should_stop(i, generated_ids) is asked
    after each chunk for prompt i (stop strings); progress(n_done_prompts) likewise."""
    for ids in prompts:
        engine.check_prompt(ids)
    n = len(prompts)
    prog = engine.prog
    fresh = getattr(engine.policy, "fresh_choice", None)
    if prog.drafter is not None and fresh is not None and engine.k.shapes[fresh(*_pooled(engine))] == 0:
        # The policy puts fresh rows at K = 0, and plain rounds test no draft, so every
        # chunk of this run would choose K = 0 (`KPolicy.fresh_choice`; a later run may
        # revisit drafting): the run goes without the drafter, computing what the
        # autoregressive engine computes (no drafter prefill, no drafter state), with the
        # same tokens as plain rounds.
        prog = dataclasses.replace(prog, drafter=None)
    slots = n if isinstance(batching, Static) else batching.slots
    state = engine.empty(prog, slots, engine.slots_for(prompts))
    eos = jnp.asarray(np.array(engine.eos_ids or (-1,), np.int32))
    stops = jnp.asarray(np.array(tuple(stop_ids) or (-1,), np.int32))
    run = _Run(engine, batching, prompts, seeds, state, prog)
    while run.pending or run.active():
        run.refill()
        t0 = time.perf_counter()  # moving rows and a drafter's resync are decode time too
        compiling = run.compile_s
        run.compact()
        shape = run.choose_k()
        prog, k = shape_program(run.prog, shape)  # a chain's K, or a tree's program and depth
        run.state, rounds, seconds = engine.generate(
            prog, k, run.state, eos, stops, max_rounds=run.chunk_rounds(k, should_stop is not None),
            refill_at=run.refill_at())
        run.compile_s += seconds
        t0 += run.compile_s - compiling  # compiling is not decoding (`compile_s` column)
        seconds = time.perf_counter() - t0
        engine.k_rounds[shape_key(shape)] += rounds
        engine.slot_rounds[len(run.slot_row)] += rounds
        engine.decode_s += seconds
        modelled, counted, wide = run.charge_decode(seconds, rounds, shape)
        if hasattr(engine.policy, "observe"):
            engine.policy.observe(shape, seconds, rounds, len(run.slot_row), modelled, counted, wide)
        if should_stop is not None:
            run.apply_stop_strings(should_stop)
        run.collect()
        if progress is not None:
            progress(n - len(run.pending) - len(run.active()))
        yield
    return run.samples()


def modelled_rounds(rounds: int, emitted: np.ndarray, mine: np.ndarray, counted: np.ndarray) -> float:
    """A chunk's `rounds` counted by what they emitted, in rounds of the kind the K policy
    models. emitted [B, R]: tokens each round appended; mine: the chunk's rounds of each
    row; counted: those of them the policy's model describes (drafted rounds at the
    chunk's K or tree).

    A chunk's time covers every round, but the policy predicts only its counted rounds'
    tokens: a hybrid's wide lookup rounds (about 3 tokens a round where the chained rounds
    of K = 1 give 1.5) and a lookup drafter's plain steps on rows without a match would
    otherwise leave the chunk's time with too few tokens, or too many, and misprice K
    against plain rounds. So the chunk counts as (its tokens / a counted round's mean
    tokens) rounds of the modelled kind, scaled to the batch's rounds; with no counted
    round (a plain chunk: plain rounds are what the policy predicts there), as `rounds`."""
    row_rounds, n_counted = int(mine.sum()), int(counted.sum())
    if n_counted == 0 or row_rounds == 0:
        return float(rounds)
    mean = emitted[counted].sum() / n_counted
    return rounds * float(emitted[mine].sum()) / mean / row_rounds


def _pooled(engine) -> tuple:
    """The engine's pooled counts a policy reads: by draft position, and each tree's
    tokens and its spines' where it has trees."""
    return (engine.depth, engine.tree_tokens) if engine.k.trees else (engine.depth,)


class _Run:
    """Host bookkeeping of one run: the queue, who sits in which slot, and each prompt's
    own prefill and decode time."""

    def __init__(self, engine, batching: Batching, prompts, seeds, state, prog: Program):
        self.engine, self.batching, self.prompts, self.state, self.prog = engine, batching, prompts, state, prog
        self.static = isinstance(batching, Static)
        self.width = width_for(prompts)  # inserted prompts pad to it
        self.seeds = [s % (1 << 32) for s in seeds]
        self.pending = collections.deque(range(len(prompts)))
        batch = state.tokens.shape[0]
        self.slot_row = [-1] * batch  # prompt index in each slot, -1: free
        self.prefill_s = [0.0] * len(prompts)
        self.decode_s = [0.0] * len(prompts)
        self.calls = np.zeros(batch, np.int64)
        self.compile_s = 0.0  # compiled since the last collected row (charged to the next one)
        self.accepted = np.zeros(batch)
        self.tested = np.zeros(batch)
        self.reason = np.full(batch, MAX_TOKENS)
        self.plain = False  # the last chunk ran plain rounds (the drafter's cache is behind)
        self.totals = [0.0, 0.0, 0.0]  # this run's insert, chunk and compile seconds
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
        return free + max(1, min(len(self.pending), round(slots * self.batching.refill_fraction)))

    def compacts(self) -> bool:
        """Whether this run moves its last rows into fewer slots (not on a split target:
        the state's placement is the engine's)."""
        return (not self.static and self.batching.compact and len(self.slot_row) >= 2
                and self.engine.mesh is None)

    def compact(self) -> None:
        """With no prompt left to insert and at most half the slots running, move the running
        rows into a state of fewer slots (the next power of two that holds them), so that
        the last rounds of a run compute only them. Every field of a row moves with it (its
        cache, drafter state, keys and counters), and a row's sample never depends on its
        slot."""
        active = self.active()
        if self.pending or not active or not self.compacts() or len(active) > len(self.slot_row) // 2:
            return
        size = 1 << (len(active) - 1).bit_length()
        free = [s for s, r in enumerate(self.slot_row) if r < 0]
        order = active + free[: size - len(active)]  # filler slots are free (done) rows
        self.state, seconds = self.engine.gather(self.state, order)
        self.compile_s += seconds
        self.slot_row = [self.slot_row[s] for s in order]
        self.calls, self.accepted, self.tested, self.reason = (
            a[order] for a in (self.calls, self.accepted, self.tested, self.reason))

    def chunk_rounds(self, k: int, stop_strings: bool) -> int:
        """Rounds the next chunk, at `k`, runs at most (it also returns where `refill_at`
        says). Plain chunks under a K policy teach it nothing (no draft is tested), so it
        would choose K = 0 again: they run on until slots free up, as an autoregressive
        engine does, or for as long as the policy says (`KPolicy.plain_rounds`: a close call
        is revisited after so many plain rounds). Drafted chunks at the chain a policy has
        settled on run longer (`KPolicy.drafted_rounds`); stop strings need the host every
        chunk."""
        chunk, policy = self.batching.chunk_rounds, self.engine.policy
        if policy is None or stop_strings:
            return chunk
        if k != 0:  # longer at a settled choice (`KPolicy.drafted_rounds`)
            longer = getattr(policy, "drafted_rounds", None)
            return chunk if longer is None else min(longer(chunk), _NEVER)
        asks = self.prog.drafter is not None and hasattr(policy, "plain_rounds")  # else not asked
        limit = policy.plain_rounds(chunk) if asks else None
        return _NEVER if limit is None else limit

    def choose_k(self):
        """The next chunk's shape, a K or a Tree: the engine's fixed K, or its policy's
        choice; a drafter whose cache plain rounds left behind is brought level first."""
        eng = self.engine
        if self.prog.drafter is None and eng.prog.drafter is not None:
            return 0  # a run without the drafter (see `steps`)
        if eng.policy is None or len(eng.k.shapes) == 1:
            return eng.k.ks[0]
        k = eng.k.shapes[eng.policy(*self.acceptance())]
        if self.plain and k != 0 and self.prog.drafter.uses_cache:
            width = min(prompt_bucket(int(np.asarray(self.state.length).max())), self.state.tokens.shape[1])
            self.state, seconds = eng.resync(self.prog, self.state, width)
            self.compile_s += seconds
        self.plain = k == 0
        return k

    def refill(self) -> None:
        free = [s for s, r in enumerate(self.slot_row) if r < 0]
        take = [self.pending.popleft() for _ in range(min(len(free), len(self.pending)))]
        if not take:
            return
        for j, i in enumerate(take):
            self.slot_row[free[j]] = i
            self.calls[free[j]] = self.accepted[free[j]] = self.tested[free[j]] = 0
            self.reason[free[j]] = RUNNING
        lens = [len(self.prompts[i]) for i in take]
        if self.static and self.engine.mesh is not None:  # a split target: one call
            groups = [(list(range(len(take))), max(prefill_chunks(n) for n in lens))]
        else:
            groups = prefill_groups(lens)
        for members, chunks in groups:
            self._insert([take[j] for j in members], [free[j] for j in members], chunks,
                         pad_rows=len(groups) == 1)

    def _insert(self, rows: list[int], slots: list[int], chunks: int, pad_rows: bool) -> None:
        """Prefill prompts `rows` into `slots` in one call of `chunks` prefill passes; with
        pad_rows, the call's row count is rounded up to a power of two (few shapes; padding
        rows are dropped). Prompts pad to the run's longest one's bucket: one shape per
        row count."""
        b = len(self.slot_row)
        n = min(1 << (len(rows) - 1).bit_length(), b) if pad_rows else len(rows)
        seeds, where = np.zeros(n, np.uint32), np.full(n, b, np.int32)  # padding rows: slot b, dropped
        distinct: dict[tuple, int] = {}  # a prompt -> its row in the prefill call
        source = np.zeros(n, np.int32)
        for j, (i, slot) in enumerate(zip(rows, slots)):
            source[j] = distinct.setdefault(tuple(self.prompts[i]), len(distinct))
            seeds[j], where[j] = self.seeds[i], slot
        # Rows that share a prompt (one prompt under many seeds) are prefilled once, in a
        # call of a power of two rows, when that is fewer than n.
        u = 1 << (len(distinct) - 1).bit_length()
        if u < n:
            prompts = list(distinct)  # in order of first use, as `source` numbers them
        else:
            u, source, prompts = n, None, [self.prompts[i] for i in rows]
        padded, lens = np.zeros((u, self.width), np.int32), np.ones(u, np.int32)
        for j, ids in enumerate(prompts):
            padded[j, : len(ids)], lens[j] = ids, len(ids)
        t0 = time.perf_counter()
        self.state, compiling = self.engine.insert(self.prog, self.state, padded, lens, seeds, where,
                                                   chunks, source)
        jax.block_until_ready(self.state.length)
        seconds = time.perf_counter() - t0 - compiling
        self.compile_s += compiling
        self.engine.prefill_s += seconds
        self.totals[0] += seconds
        share = seconds / len(rows)  # the rows' shares add up to the call's time
        for i in rows:
            self.prefill_s[i] = share

    def charge_decode(self, seconds: float, rounds: int, shape) -> float:
        """Give each row its share of a chunk that ran `rounds` rounds of `shape` (a K, or
        a Tree), and count its tested draft tokens for the K policy (a round that kept
        fewer than K stopped at a rejection; a tree round's spine counts as a chain round,
        and the tree's tokens against its spines' go to `tree_tokens`). A hybrid's wide
        rounds (more lookup tokens than k) are left out: they run only in chunks of a
        smaller K, and their long matches, kept far more often than the model's chained
        guesses, would make the policy overrate the larger K.

        Returns the chunk's rounds counted by what they emitted, in rounds of the kind the
        policy models (`modelled_rounds`), (tokens, row-rounds) of the rounds the policy
        models (a tree's: its spines'; `KPolicy.calibration`), and at a K below the
        hybrid's wide length (row-rounds, wide ones, their tokens; `WideRounds`), else
        None."""
        tree = None if isinstance(shape, int) else shape
        k, scored = (shape, shape) if tree is None else (len(tree.spine), tree.size)
        self.totals[1] += seconds
        st = self.state
        calls, log, widths, emitted, spine = (np.asarray(a) for a in (
            st.calls, st.round_accepted, st.round_drafted, st.round_tokens, st.round_spine))
        self.reason = np.array(st.stop_reason)
        active = np.array(self.active(), int)
        for s in active:  # a round takes the same time for every row of the batch
            self.decode_s[self.slot_row[s]] += seconds * int(calls[s] - self.calls[s]) / max(rounds, 1)
        # Each active row's loops of this chunk (-1: a plain round), all rows at once.
        log, widths, emitted, spine = log[active], widths[active], emitted[active], spine[active]
        at = np.arange(log.shape[1])[None, :]
        mine = (at >= self.calls[active][:, None]) & (at < calls[active][:, None])
        counted = mine & (log >= 0) & (widths == scored)
        modelled = modelled_rounds(rounds, emitted, mine, counted)
        if tree is not None:  # the spine's loops (cut where the round's output was)
            kept = np.minimum(spine, log)
            self.engine.tree_tokens[shape_key(tree)] += (
                float((1 + log[counted]).sum()), float((1 + kept[counted]).sum()))
            log = np.where(counted, kept, log)
        accepted = np.where(counted, log, 0).sum(axis=1)
        self.accepted[active] += accepted  # as `stats.loop_counts`, row by row
        self.tested[active] += accepted + (counted & (log < k)).sum(axis=1)
        depth = self.engine.depth
        for total, part in zip(depth, depth_counts(log[counted], k, len(depth[0]))):
            total += part
        self.calls = calls.astype(np.int64)
        models = (float((1 + log[counted]).sum()), int(counted.sum()))
        if tree is not None or not 0 < k < self.prog.wide:
            return modelled, models, None
        wide = mine & (log >= 0) & (widths > scored)
        return modelled, models, (float(mine.sum()), float(wide.sum()), float(emitted[wide].sum()))

    def acceptance(self) -> tuple:
        """(accepted, tested) draft tokens so far of each running row, and the engine's
        (accepted, tested) by draft position (and by depth and width, with trees), over
        all its runs."""
        running = [s for s in self.active() if self.reason[s] == RUNNING]
        return (self.accepted[running], self.tested[running], *_pooled(self.engine))

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
        length, calls = np.asarray(st.length)[done].tolist(), np.asarray(st.calls)[done].tolist()
        tokens = np.asarray(st.tokens)[done].tolist()
        logs = round_logs(st, done)
        rates = getattr(self.engine.policy, "rows", None)  # `KPolicy.rows`
        for j, s in enumerate(done):
            i, lo = self.slot_row[s], len(self.prompts[self.slot_row[s]])
            n = calls[j]
            if rates is not None:
                rates.finish(self.accepted[s], self.tested[s])
            # The row's own decode time stands as a "batch" of its own rounds, so that
            # `RawSample.decode_s` is exactly it (and a stop-string cut scales it by rounds).
            self.results[i] = RawSample(
                token_ids=tuple(tokens[j][lo : length[j]]), prompt_tokens=lo,
                stop_reason=STOP_REASONS[int(reason[s])],
                rounds=from_log(*(log[j] for log in logs), n),
                prefill_s=self.prefill_s[i], batch_decode_s=self.decode_s[i], batch_rounds=max(n, 1),
                compile_s=self.compile_s)
            self.totals[2] += self.compile_s
            self.compile_s = 0.0  # the column sums to the run's compile time
            self.slot_row[s] = -1

    def samples(self) -> list[RawSample]:
        """The results; under `Static`, each row with its batch's times and rounds, and the
        batch's compiling on row 0 (the column sums)."""
        if not self.static:
            return self.results
        prefill_s, decode_s, compile_s = self.totals
        compile_s += self.compile_s
        most = max((r.calls for r in self.results), default=0)
        return [dataclasses.replace(r, prefill_s=prefill_s, batch_decode_s=decode_s, batch_rounds=most,
                                    compile_s=compile_s if i == 0 else 0.0)
                for i, r in enumerate(self.results)]
