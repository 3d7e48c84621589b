"""The text-level API on a tiny checkpoint: stop strings, stop ids, statistics."""

import pytest

from specsamp.compilation import forget_executables
from specsamp.decoding.config import SamplingParams
from specsamp.decoding.generator import GeneratorSpec, load_generator
from specsamp.testing import make_tiny_checkpoint


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny") / "target"), seed=3, n_layers=2)


def _gen(target, **kw):
    kw.setdefault("sampling", SamplingParams(0.0))
    kw.setdefault("max_new_tokens", 24)
    return load_generator(GeneratorSpec(target=target, **kw))


def test_stop_string_cuts_text_and_reports_stop(target):
    free = _gen(target, draft="early-exit:1", k=3).generate(["the quick"], [0])[0]
    assert len(free.text) > 6, free.text
    stop = free.text[4:6]
    cut = free.text.index(stop)
    got = _gen(target, draft="early-exit:1", k=3, stop=(stop,)).generate(["the quick"], [0])[0]
    assert got.text == free.text[:cut] and got.stop_reason == "stop"
    assert got.token_ids == free.token_ids[: len(got.token_ids)]


def test_stop_token_id_ends_the_sample_and_is_not_in_the_text(target):
    free = _gen(target, draft="ngram", k=2).generate(["the quick"], [0])[0]
    ids = free.token_ids
    j = next(j for j in range(2, len(ids)) if ids[j] not in ids[:j])
    got = _gen(target, draft="ngram", k=2, stop_token_ids=(ids[j],)).generate(["the quick"], [0])[0]
    assert got.token_ids == ids[: j + 1] and got.stop_reason == "stop"
    assert got.text == _gen(target).tokenizer.decode(list(ids[:j]))


def test_statistics_add_up(target):
    sp = SamplingParams(1.0, 0, 0.9)
    for c in _gen(target, draft="early-exit:1", k=3, sampling=sp).generate(["a", "bcd", "the"], [1, 2, 3]):
        assert c.draft_calls == 3 * c.target_calls
        assert len(c.accepted_per_loop) == c.target_calls
        # Each loop emits its kept draft tokens and one more, except a loop cut by the
        # token limit or EOS inside its draft, which emits only kept draft tokens.
        assert sum(c.accepted_per_loop) + c.target_calls - c.generated_tokens in (0, 1)
        assert c.tokens_per_call == c.generated_tokens / c.target_calls
        assert c.decode_s > 0 and c.prefill_s > 0 and c.mode == "speculative"


def test_statistics_stop_at_the_stop_string(target):
    """The loop runs on past a stop string (it is found on the host every 16 rounds); the
    statistics must be those of the emitted tokens only: equal to a run whose token limit
    ends the same sample at the same token inside the loop. Catches calls, draft calls or
    accepted counts that include the rounds past the stop."""
    free = _gen(target, draft="early-exit:1", k=3).generate(["the quick"], [0])[0]
    got = _gen(target, draft="early-exit:1", k=3, stop=(free.text[4:6],)).generate(["the quick"], [0])[0]
    m = got.generated_tokens
    assert got.stop_reason == "stop" and m == len(got.token_ids) < free.generated_tokens
    limited = _gen(target, draft="early-exit:1", k=3, max_new_tokens=m).generate(["the quick"], [0])[0]
    assert limited.token_ids == got.token_ids
    assert (got.target_calls, got.draft_calls, got.accepted_per_loop) == (
        limited.target_calls, limited.draft_calls, limited.accepted_per_loop)


def test_rounds_cut_keeps_what_the_kept_tokens_needed():
    """Cutting a round log mid-round keeps that round's emitted draft tokens only."""
    from specsamp.decoding.rounds import Rounds

    log = Rounds(tokens=(3, 1, 4, 2), accepted=(2, -1, 3, 1), draft_calls=(3, 0, 3, 3),
                 drafted=(3, 0, 4, 2))
    assert log.cut(10) == log and log.cut(99) == log
    assert log.cut(4) == Rounds((3, 1), (2, -1), (3, 0), (3, 0))
    mid = log.cut(6)  # 2 of the third round's 4 tokens: both kept draft tokens
    assert mid == Rounds((3, 1, 2), (2, -1, 2), (3, 0, 3), (3, 0, 4))
    assert (mid.calls, mid.loops, mid.accepted_per_loop, mid.total_draft_calls) == (3, 2, (2, 2), 6)
    assert log.drafted_per_loop == (3, 4, 2)  # the plain round (-1) is no loop


def test_compilation_is_timed_apart(target):
    """A batch that meets new shapes reports its compile seconds on its first row only;
    a later batch of the same shapes compiles nothing. Catches compilation left inside
    prefill_s / decode_s (compile_s would then be 0 everywhere)."""
    forget_executables()  # an earlier test in this process may have met these shapes
    gen = _gen(target, draft="ngram", k=2, max_new_tokens=20, batch_size=2)
    first = gen.generate(["a b c", "d e"], [1, 2])
    again = gen.generate(["f g h", "i"], [3, 4])
    assert first[0].compile_s > 0 and first[1].compile_s == 0
    assert [c.compile_s for c in again] == [0, 0]


def test_a_round_cut_inside_its_draft_counts_only_emitted_draft_tokens():
    """A round whose rule kept 3 draft tokens but that ends after 2 (the token limit in
    row 0, an EOS in row 1) logs 2 tokens and 2 accepted. Catches accepted counts that
    include draft tokens never emitted."""
    import jax.numpy as jnp

    from specsamp.decoding.state import DecodeState, commit
    from specsamp.models import ModelConfig, init_cache

    cfg = ModelConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=1, n_kv_heads=1, head_dim=8, d_ff=8)
    b, r = 2, 6
    state = DecodeState(
        tokens=jnp.zeros((b, 16), jnp.int32), length=jnp.array([4, 4]), prompt_len=jnp.array([4, 4]),
        max_len=jnp.array([6, 10]), keys=jnp.zeros((b, 2), jnp.uint32), stop_reason=jnp.zeros(b, jnp.int32),
        calls=jnp.zeros(b, jnp.int32), round_tokens=jnp.zeros((b, r), jnp.int32),
        round_accepted=jnp.full((b, r), -1, jnp.int32), round_draft_calls=jnp.zeros((b, r), jnp.int32),
        round_drafted=jnp.zeros((b, r), jnp.int32), round_spine=jnp.zeros((b, r), jnp.int32),
        target_cache=init_cache(cfg, b, 16))
    out = commit(state, jnp.array([[5, 6, 7, 8], [5, 9, 7, 8]]), jnp.array([4, 4]), jnp.array([3, 3]),
                 eos_ids=jnp.array([9]), stop_ids=jnp.array([-1]), drafted=3)
    assert out.length.tolist() == [6, 6] and out.calls.tolist() == [1, 1]
    assert out.round_tokens[:, 0].tolist() == [2, 2]
    assert out.round_accepted[:, 0].tolist() == [2, 2] and out.round_drafted[:, 0].tolist() == [3, 3]
    plain = commit(out.replace(stop_reason=jnp.array([0, 0])), jnp.array([[3], [3]]), jnp.array([1, 1]),
                   jnp.array([0, 0]), eos_ids=jnp.array([9]), stop_ids=jnp.array([-1]), drafted=0)
    assert plain.round_accepted[:, 1].tolist() == [-1, -1]  # a plain step is no speculative loop


def test_prompt_buckets_hold_the_prompt_with_little_padding():
    """Catches a bucket shorter than its prompt (a truncated prompt buffer) or one that
    wastes most of the buffer and cache it sizes: every n fits, buckets never shrink as n
    grows, padding is under 32 tokens up to 128 and under a third of the bucket above, with
    few distinct shapes."""
    from specsamp.decoding.shapes import prompt_bucket

    sizes = [prompt_bucket(n) for n in range(1, 2049)]
    assert all(b >= n for n, b in zip(range(1, 2049), sizes))
    assert sizes == sorted(sizes)
    assert all(b - n < 32 for n, b in zip(range(1, 129), sizes))
    assert all((b - n) / b < 1 / 3 for n, b in zip(range(129, 2049), sizes[128:]))
    assert len(set(sizes)) <= 12
