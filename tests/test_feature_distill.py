"""Training the feature-conditioned draft: it learns (held-out alpha rises), and what it
saves loads back into the engine as an exact drafter."""

import dataclasses
import json
import os
import types

import numpy as np
import pytest

from specsamp.decoding.config import SamplingParams
from specsamp.decoding.decode import Program
from specsamp.decoding.engine import Engine
from specsamp.decoding.factory import build_drafter, file_loader
from specsamp.distill import data as data_mod
from specsamp.distill.feature import FeatureTrainConfig, train_feature_draft
from tests import tiny

T, V = 32, tiny.TARGET.vocab_size


def _target():
    tok = types.SimpleNamespace(fingerprint="tiny", eos_ids=())
    return types.SimpleNamespace(cfg=tiny.TARGET, params=tiny.target_params(), tokenizer=tok)


def _write_split(folder, n_rows, seed):
    """Greedy-ish text from the tiny target would be repetitive; random tokens with the
    target's full next-token distributions are enough to learn from."""
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, V, size=(n_rows, T)).astype(np.int32)
    mask = np.ones((n_rows, T), np.uint8)
    mask[:, -1] = 0
    ids, p, _ = data_mod.Teacher(_target(), T, 8, top_k=V)(tokens)
    np.savez(os.path.join(folder, "gen_00000.npz"), tokens=tokens, mask=mask,
             domain=(np.arange(n_rows) % 2).astype(np.uint8), top_ids=ids, top_p=p)


def test_teacher_gives_the_targets_distribution_and_features():
    """One forward gives both the teacher's top-k and the features training reads (so the
    data stage caches them and training runs no target pass): checked against separate
    full forwards, the top-k against the full softmax, the features against the hidden
    states (float16 rounding). 12 rows with a batch of 8: the padded last call too."""
    import jax
    import jax.numpy as jnp

    from specsamp.models import Model

    tokens = np.random.default_rng(3).integers(0, V, size=(12, T)).astype(np.int32)
    ids, p, hidden = data_mod.Teacher(_target(), T, 8, top_k=5)(tokens)
    model = Model(tiny.TARGET)
    want_h = np.asarray(model.full_forward(tiny.target_params(), jnp.asarray(tokens), head=False))
    probs = np.asarray(jax.nn.softmax(model.full_forward(tiny.target_params(), jnp.asarray(tokens)), -1))
    assert hidden.shape == (12, T, tiny.TARGET.d_model) and hidden.dtype == np.float16
    np.testing.assert_allclose(hidden.astype(np.float32), want_h, rtol=2e-3, atol=2e-3)
    top = np.sort(probs, axis=-1)[..., ::-1][..., :5]
    np.testing.assert_allclose(p.astype(np.float32), top, rtol=2e-3, atol=1e-4)
    np.testing.assert_allclose(np.take_along_axis(probs, ids.astype(np.int64), -1), top,
                               rtol=1e-5, atol=1e-7)


def test_feature_draft_learns_and_exports_an_exact_draft(tmp_path):
    data = tmp_path / "data"
    _write_split(str(data / "train"), 64, 0)
    _write_split(str(data / "heldout"), 16, 1)
    tc = FeatureTrainConfig(data_dir=str(data), out_dir=str(tmp_path / "out"), head_vocab=V,
                            learning_rate=1e-2, warmup_steps=1, steps=80, batch_rows=8,
                            eval_every=1000, checkpoint_every=40, init_layer=1)
    logs = []
    result = train_feature_draft(_target(), tc, log=logs.append)
    first = json.loads((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()[0])
    assert result["step"] == 80
    assert result["alpha_code"] > first["alpha_code"] + 0.05, (first, result)

    sp = SamplingParams(0.0)  # the saved draft as a user's `--draft PATH`, through the factory
    drafter, params = build_drafter(str(tmp_path / "out" / "draft"), 3, sp, tiny.TARGET, tiny.target_params(),
                                    file_loader(_target()))
    assert drafter.kind == "feature"
    spec = Engine(Program(tiny.TARGET, sp, drafter), tiny.target_params(),
                  params, max_new_tokens=20).run([[1, 2, 3, 4]], [0])[0]
    base = Engine(Program(tiny.TARGET, sp), tiny.target_params(), max_new_tokens=20).run([[1, 2, 3, 4]], [0])[0]
    assert spec.token_ids == base.token_ids and sum(spec.accepted) > 0


def test_training_continues_from_a_saved_draft(tmp_path):
    """init_from: a second run starts where the saved draft is (its step-0 evaluation
    equals the first run's last, up to the float16 of the saved weights), not at target
    layer `init_layer`; and it keeps the saved draft's head ids."""
    from specsamp.errors import UserError
    from specsamp.models.feature_draft import load_feature_draft

    data = tmp_path / "data"
    _write_split(str(data / "train"), 64, 0)
    _write_split(str(data / "heldout"), 16, 1)
    first = FeatureTrainConfig(data_dir=str(data), out_dir=str(tmp_path / "a"), head_vocab=V // 2,
                               learning_rate=1e-2, warmup_steps=1, steps=40, batch_rows=8,
                               eval_every=1000, checkpoint_every=1000, init_layer=1)
    trained = train_feature_draft(_target(), first)
    fresh = json.loads((tmp_path / "a" / "metrics.jsonl").read_text().splitlines()[0])
    second = dataclasses.replace(first, out_dir=str(tmp_path / "b"), steps=1, learning_rate=0.0,
                                 init_from=str(tmp_path / "a" / "draft"))
    train_feature_draft(_target(), second)
    start = json.loads((tmp_path / "b" / "metrics.jsonl").read_text().splitlines()[0])
    assert start["step"] == 0
    assert abs(start["alpha_code"] - trained["alpha_code"]) < 2e-3, (start, trained)
    assert trained["alpha_code"] > fresh["alpha_code"] + 0.05  # so the check above can fail
    head = lambda d: np.unique(np.asarray(load_feature_draft(str(d), _target())[1]["head_ids"]))
    np.testing.assert_array_equal(head(tmp_path / "b" / "draft"), head(tmp_path / "a" / "draft"))

    for bad, match in ((str(tmp_path / "nowhere"), "not a saved feature draft"),
                       (str(tmp_path / "a" / "draft"), "layer")):
        layers = 2 if match == "layer" else 1
        with pytest.raises(UserError, match=match):
            train_feature_draft(_target(), dataclasses.replace(
                second, out_dir=str(tmp_path / "c"), init_from=bad, n_layers=layers))


def test_training_without_data_is_a_user_error(tmp_path):
    """A recipe run before its data stage: one line saying what to run, no traceback."""
    from specsamp.errors import UserError

    (tmp_path / "data" / "train").mkdir(parents=True)
    tc = FeatureTrainConfig(data_dir=str(tmp_path / "data"), out_dir=str(tmp_path / "out"))
    with pytest.raises(UserError, match="distill-data"):
        train_feature_draft(_target(), tc)


def test_distill_command_traces_its_programs_with_batched_products(monkeypatch):
    """`specsamp distill` needs no bit-equal rows: its programs run batched (several times
    faster), and decoding's per-row default is back afterwards."""
    from specsamp import reductions
    from specsamp.commands import distill as distill_cmd

    seen = []
    monkeypatch.setattr(distill_cmd, "_run", lambda args: seen.append(reductions.per_row()) or 0)
    before = reductions.per_row()
    assert distill_cmd.run(None) == 0
    assert seen == [False] and reductions.per_row() == before
