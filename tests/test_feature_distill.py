"""Training the feature-conditioned draft: it learns (held-out alpha rises), and what it
saves loads back into the engine as an exact drafter."""

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
    ids, p = data_mod.Teacher(_target(), T, 8, top_k=V)(tokens)
    np.savez(os.path.join(folder, "gen_00000.npz"), tokens=tokens, mask=mask,
             domain=(np.arange(n_rows) % 2).astype(np.uint8), top_ids=ids, top_p=p)


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
