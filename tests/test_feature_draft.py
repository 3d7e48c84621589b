"""The feature-conditioned drafter sees the target's true features: with K = 1 and greedy
decoding, each loop's acceptance must equal an offline, teacher-forced computation
(full sequences, no cache) of whether the draft's argmax is the target's next token.
Also: the on-disk format, the 'ngram+<draft>' hybrid and the shipped draft."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from specsamp.decoding.config import SamplingParams, parse_draft
from specsamp.decoding.decode import Program
from specsamp.decoding.drafts import default_draft, resolve
from specsamp.decoding.engine import Engine
from specsamp.errors import UserError
from specsamp.models.feature_draft import FeatureDraft
from specsamp.models.llama import Transformer, init_cache
from tests import tiny


def test_k1_acceptance_matches_teacher_forced_draft():
    sp = SamplingParams(0.0)
    drafter, dparams = tiny.drafter("tiny-feature", 1, sp)
    cfg = drafter.cfg
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    engine = Engine(Program(tiny.TARGET, sp, drafter), tiny.target_params(),
                    dparams, eos_ids=(), max_new_tokens=20)
    [r] = engine.run([prompt], [0])
    seq = jnp.asarray([prompt + list(r.token_ids)])
    n = seq.shape[1]
    pos = jnp.arange(n)[None]
    hidden, _ = Transformer(tiny.TARGET).apply({"params": tiny.target_params()}, seq, pos,
                                               init_cache(tiny.TARGET, 1, n), head=False)
    feats = jnp.pad(hidden, ((0, 0), (1, 0), (0, 0)))[:, :n]  # position j gets h_{j-1}
    model = FeatureDraft(cfg)
    g, _ = model.apply({"params": dparams}, seq, feats, pos, init_cache(cfg, 1, n))
    proposal = np.asarray(jnp.argmax(model.apply({"params": dparams}, g, method=FeatureDraft.logits), -1))[0]
    seq = np.asarray(seq)[0]
    # Round i starts at current index t_i; K=1 proposes the draft's argmax at t_i.
    t, expected = len(prompt) - 1, []
    for _ in r.accepted:
        kept = int(proposal[t] == seq[t + 1])
        expected.append(kept)
        t += kept + 1
    assert list(r.accepted) == expected
    assert 0 < sum(expected) < len(expected)  # both outcomes occur: the check is not vacuous


def test_saved_feature_draft_loads_into_the_generator(tmp_path):
    """Round trip through the on-disk format (own weights only, float16), used by
    `--draft PATH`; greedy output equals the baseline's."""
    from specsamp.decoding.generator import GeneratorSpec, load_generator
    from specsamp.loading import load_model
    from specsamp.models.feature_draft import init_feature_draft, save_feature_draft
    from specsamp.testing import make_tiny_checkpoint

    target_path = make_tiny_checkpoint(str(tmp_path / "t"), seed=4, n_layers=2)
    target = load_model(target_path)
    cfg, params = init_feature_draft(target.cfg, target.params, n_layers=1, init_layer=0)
    save_feature_draft(str(tmp_path / "d"), cfg, params, target.tokenizer.fingerprint)
    assert not any("embed" in f.name for f in (tmp_path / "d").iterdir())
    make = lambda draft: load_generator(GeneratorSpec(target=target_path, draft=draft, k=3, max_new_tokens=16))
    spec = make(str(tmp_path / "d")).generate(["the quick brown"], [0])[0]
    base = make("none").generate(["the quick brown"], [0])[0]
    assert spec.token_ids == base.token_ids and spec.draft_calls == 3 * spec.target_calls
    hybrid = make(f"ngram+{tmp_path / 'd'}").generate(["the quick brown"], [0])[0]
    assert hybrid.token_ids == base.token_ids
    assert hybrid.target_calls <= hybrid.draft_calls <= 3 * hybrid.target_calls
    with pytest.raises(UserError, match="feature-conditioned"):
        make(f"ngram+{target_path}")  # a plain model is no feature draft


@pytest.mark.parametrize("bad", ["ngram+", "ngram+early-exit:2", "ngram:0+d", "ngram+none",
                                 "ngram+ngram"])
def test_malformed_hybrid_drafts_are_user_errors(bad):
    with pytest.raises(UserError):
        parse_draft(bad)


def test_auto_picks_the_shipped_draft_only_for_the_embedded_target():
    assert parse_draft("ngram:2+smollm2-feature") == ("hybrid", (2, resolve("smollm2-feature")))
    assert parse_draft("smollm2-feature") == ("model", resolve("smollm2-feature"))
    assert parse_draft("/my/draft") == ("model", "/my/draft")
    assert default_draft(None) == default_draft("smollm2") == "ngram+smollm2-feature"
    assert default_draft("/models/other.gguf") == "ngram"
    manifest = os.path.join(resolve("smollm2-feature"), "specsamp_draft.json")
    assert os.path.getsize(os.path.join(resolve("smollm2-feature"), "model.safetensors")) < 20e6
    with open(manifest) as f:
        assert json.load(f)["kind"] == "feature"


def test_padded_reduced_head_proposes_the_same():
    """Catches a padding of the reduced head (to whole groups of 16 rows, as loading for
    decoding does) or a greedy shortcut that changes the draft: full-vocabulary logits,
    greedy tokens and the shortcut's tokens are the same with and without the padding, and
    the ids come sorted whatever order they were given in."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from specsamp.models.argmax import first_argmax
    from specsamp.models.feature_draft import FeatureModel, draft_logits, reduced_head
    from tests import tiny

    cfg, params = tiny.feature_draft()
    ids = [6, 0, 3, 5, 2]
    plain = {**params, **reduced_head(tiny.TARGET, tiny.target_params(), ids)}
    padded = {**params, **reduced_head(tiny.TARGET, tiny.target_params(), ids, pad=True)}
    assert list(np.asarray(plain["head_ids"])) == sorted(ids)
    assert padded["head_ids"].shape == (16,) and int(padded["head_ids"][-1]) == 6
    g = jax.random.normal(jax.random.PRNGKey(0), (7, cfg.d_model))
    want = np.asarray(draft_logits(cfg, plain, g))
    np.testing.assert_array_equal(np.asarray(draft_logits(cfg, padded, g)), want)
    tokens = np.asarray(first_argmax(jnp.asarray(want)))
    for p in (plain, padded):
        np.testing.assert_array_equal(np.asarray(FeatureModel(cfg).greedy_tokens(p, g)), tokens)
    assert set(tokens) <= set(ids)
