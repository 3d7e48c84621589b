"""Exactness on a tiny model whose logits come in near-ties (`tiny.near_tie_params`): the
argmax is decided by the last bits at nearly every position, so greedy output equals
across batches, K, prefill passes and slot moves only where the numbers are bit for bit
the same, and a missing or stale cache entry shows as other tokens."""

import jax
import jax.numpy as jnp
import numpy as np

from specsamp.decoding import decode, engine as engine_module
from specsamp.decoding.config import SamplingParams
from specsamp.decoding.decode import PREFILL_CHUNK, Program
from specsamp.decoding.engine import Continuous, Engine
from specsamp.decoding.shapes import prefill_groups, width_for
from specsamp.models.model import Model
from tests import tiny
from tests.test_exactness import DRAFTS, PROMPT

GREEDY = SamplingParams(0.0)
PROMPTS = [PROMPT, [5, 4], [7], [3, 3, 3, 3, 3, 3, 1], [0, 2, 4, 6, 1], [6, 6, 2]]


def engine(drafter: str, k: int, max_new: int, sp=GREEDY, eos=()) -> Engine:
    params = tiny.near_tie_params()
    d, dp = tiny.drafter(DRAFTS[drafter], k, sp, target_params_=params)
    return Engine(Program(tiny.TARGET, sp, d), params, dp, eos_ids=eos, max_new_tokens=max_new)


def test_greedy_rows_equal_alone_in_a_batch_and_speculative():
    """Each row's greedy tokens are the same alone, in a batch of 6, and under speculative
    rounds of K = 3 and 4 (blocks of 18 and 30 query rows). Catches RMSNorm's sum of
    squares as `jnp.mean` (XLA's order changes from 8 rows), and a float product as one
    batched `dot_general` (other bits from 2 rows): either changes tokens here."""
    ar = engine("none", 1, 24).run(PROMPTS, list(range(6)))
    alone = engine("none", 1, 24)
    for prompt, row in zip(PROMPTS, ar):
        assert alone.run([prompt], [0])[0].token_ids == row.token_ids
    for drafter, k in [("ngram", 3), ("early-exit", 4)]:
        spec = engine(drafter, k, 24).run(PROMPTS, list(range(6)))
        assert [s.token_ids for s in spec] == [a.token_ids for a in ar], (drafter, k)


def _stepwise(prompt: list[int], n: int, slots: int):
    """(greedy tokens, target cache) by one-token calls from an empty cache (no prefill
    passes): the reference a prefill in passes must equal bit for bit."""
    model = Model(tiny.TARGET)
    params = tiny.near_tie_params()
    step = jax.jit(lambda t, p, c: model.forward(params, t, p, c))
    cache = model.init_cache(1, slots)
    tokens, out = list(prompt), []
    for i in range(len(prompt) + n - 1):
        logits, cache = step(jnp.asarray([[tokens[i]]]), jnp.asarray([[i]]), cache)
        if i >= len(prompt) - 1:
            tokens.append(int(np.argmax(np.asarray(logits[0, 0]))))
            out.append(tokens[-1])
    return out, cache


def _engine_prefill(eng: Engine, prompts: list[list[int]]):
    """The target cache after the engine's own prefill of `prompts` into a state of one
    slot each (its groups and passes, as the runner's inserts make them)."""
    lens = np.array([len(p) for p in prompts], np.int32)
    padded = np.zeros((len(prompts), width_for(prompts)), np.int32)
    for i, p in enumerate(prompts):
        padded[i, :len(p)] = p
    seeds = np.arange(len(prompts), dtype=np.uint32)
    state = eng.empty(eng.prog, len(prompts), eng.slots_for(prompts))
    for rows, chunks in prefill_groups(lens):
        at = np.asarray(rows)
        state, _ = eng.insert(eng.prog, state, padded[at], lens[at], seeds[at], at.astype(np.int32), chunks)
    return state.target_cache


def test_prompts_at_prefill_pass_boundaries():
    """Prompts whose all-but-last tokens fill exactly 1 or 2 prefill passes, or one token
    more or less: after the engine's prefill every prompt position's cache entry is bit
    for bit the one-token-at-a-time entry, and greedy tokens are the same. Catches a
    prompt prefilled one pass short (e.g. `prefill_chunks` as `-(-(n - 2) //
    PREFILL_CHUNK)`: its last prompt position's entry is never written)."""
    c = PREFILL_CHUNK
    rng = np.random.default_rng(4)
    lengths = [c, c + 1, c + 2, 2 * c + 1, 2 * c + 2]
    prompts = [rng.integers(0, tiny.TARGET.vocab_size, n).tolist() for n in lengths]
    eng = engine("none", 1, 16)
    cache = _engine_prefill(eng, prompts)
    got = eng.run(prompts, list(range(len(prompts))))
    for i, (prompt, row) in enumerate(zip(prompts, got)):
        n = len(prompt) - 1  # positions the prefill writes
        tokens, want = _stepwise(prompt, 16, cache.size)
        for have, ref in [(cache.k, want.k), (cache.v, want.v)]:
            np.testing.assert_array_equal(np.asarray(have)[:, i, :, :n], np.asarray(ref)[:, 0, :, :n],
                                          err_msg=f"prompt of {len(prompt)} tokens")
        assert list(row.token_ids) == tokens, len(prompt)


def test_rows_moved_unsorted_into_fewer_slots_with_fillers(monkeypatch):
    """Distinct prompts end at different times (EOS 5) in 6 slots; the last 3 rows move
    into 4 slots in an order that is not sorted, with a free filler slot. Each row
    keeps the tokens and statistics it has in the static engine. Catches the host's map
    moved in another order than the state's rows (e.g. `self.slot_row = [self.slot_row[s]
    for s in sorted(order)]` in `_Run.compact`), and results mapped back to the prompts of
    a sorted order."""
    orders = []
    real = engine_module.compiled

    def spy(fn, static, traced):
        if fn is decode.gather_rows:
            orders.append(np.asarray(traced["rows"]).tolist())
        return real(fn, static, traced)

    monkeypatch.setattr(engine_module, "compiled", spy)
    sp = GREEDY
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, tiny.TARGET.vocab_size, n).tolist() for n in (3, 9, 2, 14, 6, 5, 11, 4, 8)]
    seeds = list(range(50, 50 + len(prompts)))
    static = engine("early-exit", 2, 20, sp, eos=(5,))
    got = static.run(prompts, seeds, batching=Continuous(6, chunk_rounds=2))
    assert any(o != sorted(o) for o in orders), orders  # rows moved out of sorted order
    for row, alone in zip(got, static.run(prompts, seeds)):
        assert row.token_ids == alone.token_ids
        assert (row.stop_reason, row.accepted, row.calls) == (alone.stop_reason, alone.accepted, alone.calls)
