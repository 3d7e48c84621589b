"""The text-level API on a tiny checkpoint: stop strings, stop ids, statistics."""

import pytest

from specsamp.config import SamplingParams
from specsamp.generator import GeneratorSpec, load_generator
from specsamp.testing import make_tiny_checkpoint


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny") / "target"), seed=3, n_layers=2)


def _gen(target, **kw):
    kw.setdefault("sampling", SamplingParams(0.0))
    return load_generator(GeneratorSpec(target=target, max_new_tokens=24, **kw))


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
        assert sum(c.accepted_per_loop) + c.target_calls - c.generated_tokens in range(0, 4)
        assert c.tokens_per_call == c.generated_tokens / c.target_calls
        assert c.decode_s > 0 and c.prefill_s > 0 and c.mode == "speculative"
