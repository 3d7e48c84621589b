"""Distillation: the loss teaches, the measured acceptance is the true one, a resumed run is
the run that never stopped, and the exported draft is a normal, exact draft.

Tiny target (tests.tiny.TARGET, vocabulary 8): the teacher keeps all 8 probabilities, so the
top-k acceptance is exact and can be checked against sum_x min(p, q) from full forwards.
"""

import json
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specsamp.decoding.config import SamplingParams
from specsamp.decoding.decode import Program
from specsamp.decoding.engine import Engine
from specsamp.decoding.factory import build_drafter, file_loader
from specsamp.distill import data as data_mod
from specsamp.distill import draft as draft_mod
from specsamp.distill import train as train_mod
from specsamp.distill.config import load_config
from specsamp.errors import UserError
from specsamp.models.llama import Transformer, init_cache
from tests import tiny

T, V = 32, tiny.TARGET.vocab_size


def _target():
    return types.SimpleNamespace(cfg=tiny.TARGET, params=tiny.target_params())


def _dataset(n_rows: int, seed: int) -> dict:
    """Random sequences with the tiny target's full next-token distributions, half 'code'."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, V, size=(n_rows, T)).astype(np.int32)
    mask = np.ones((n_rows, T), np.uint8)
    mask[:, -1] = 0
    ids, p, _ = data_mod.Teacher(_target(), T, 8, top_k=V)(tokens)
    return {"tokens": tokens, "mask": mask, "domain": (np.arange(n_rows) % 2).astype(np.uint8),
            "top_ids": ids, "top_p": p}


@pytest.fixture(scope="module")
def datasets():
    return _dataset(64, 0), _dataset(16, 1)


def _setup(**overrides):
    settings = dict(n_layers=1, init_layers=(0,), learning_rate=1e-2, warmup_steps=1, batch_rows=8,
                    steps=60, tv_weight=2.0, checkpoint_every=10, eval_every=1000)
    cfg = train_mod.TrainConfig(**{**settings, **overrides})
    dcfg = draft_mod.draft_config(tiny.TARGET, cfg.n_layers)
    trainable, frozen = draft_mod.init_from_target(tiny.target_params(), cfg.init_layers, tiny.TARGET.n_layers)
    return cfg, dcfg, trainable, frozen


def _full_probs(cfg, params, tokens):
    b, t = tokens.shape
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    logits, _ = Transformer(cfg).apply({"params": params}, jnp.asarray(tokens), pos, init_cache(cfg, b, t))
    return np.asarray(jax.nn.softmax(logits, -1), np.float64)


def test_heldout_alpha_is_sum_of_min_over_full_distributions(datasets):
    """Catches a wrong acceptance metric (misaligned positions, wrong gather, masks ignored)."""
    _, held = datasets
    _, dcfg, trainable, frozen = _setup()
    params = draft_mod.merge(trainable, frozen)
    _, stats_fn = train_mod.make_fns(dcfg, 2.0, train_mod.optimizer(_setup()[0]))
    got = train_mod.evaluate(stats_fn, params, held)
    q = _full_probs(tiny.TARGET, tiny.target_params(), held["tokens"])
    p = _full_probs(dcfg, params, held["tokens"])
    alpha = np.minimum(p, q).sum(-1)[:, :-1]  # the last position is masked out
    for d, name in enumerate(("code", "prose")):
        want = alpha[held["domain"] == d].mean()
        assert got[f"alpha_{name}"] == pytest.approx(want, abs=2e-3)  # float16 teacher probs


def test_training_raises_heldout_alpha(datasets, tmp_path):
    """Catches a loss that does not teach (sign, stop-gradient, frozen trainables)."""
    train_data, held = datasets
    cfg, dcfg, trainable, frozen = _setup()
    result = train_mod.train(cfg, dcfg, trainable, frozen, train_data, held, str(tmp_path), log=lambda s: None)
    first = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])["alpha_code"]
    assert result["alpha_code"] > first + 0.05, (first, result["alpha_code"])
    assert result["alpha_prose"] > 0.5


def test_resume_gives_the_same_state(datasets, tmp_path):
    """Catches a resume that restarts the schedule, the optimizer moments or the batch order."""
    train_data, held = datasets
    cfg, dcfg, trainable, frozen = _setup(steps=6, checkpoint_every=100)
    train_mod.train(cfg, dcfg, trainable, frozen, train_data, held, str(tmp_path / "a"), log=lambda s: None)
    train_mod.train(cfg, dcfg, trainable, frozen, train_data, held, str(tmp_path / "b"), log=lambda s: None, until=3)
    train_mod.train(cfg, dcfg, trainable, frozen, train_data, held, str(tmp_path / "b"), log=lambda s: None)
    with np.load(tmp_path / "a" / "checkpoint.npz") as a, np.load(tmp_path / "b" / "checkpoint.npz") as b:
        assert int(a["step"]) == int(b["step"]) == 6
        assert sorted(a.files) == sorted(b.files)
        for k in a.files:
            np.testing.assert_allclose(a[k], b[k], rtol=1e-6, atol=1e-7, err_msg=k)
        moved = [k for k in a.files if k.startswith("leaf_")]
    assert moved


def _tiny_tokenizer():
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    from specsamp.loading.tokenizer import Tokenizer, TokenizerMeta

    tk = HFTokenizer(WordLevel({c: i for i, c in enumerate("abcdefgh")}, unk_token="a"))
    tk.pre_tokenizer = Whitespace()
    return Tokenizer(tk, TokenizerMeta())


def test_exported_draft_loads_and_is_exact_under_greedy(datasets, tmp_path):
    """Catches an export that load_model reads differently from what was trained (layout,
    transposes, config), and a draft that breaks greedy equality with the target."""
    from specsamp.loading import load_model

    train_data, held = datasets
    cfg, dcfg, trainable, frozen = _setup(steps=20)
    train_mod.train(cfg, dcfg, trainable, frozen, train_data, held, str(tmp_path / "t"), log=lambda s: None)
    _, trainable, _ = train_mod.load_checkpoint(str(tmp_path / "t" / "checkpoint.npz"), trainable,
                                                train_mod.optimizer(cfg).init(trainable))
    params = draft_mod.merge(trainable, frozen)
    folder = str(tmp_path / "draft")
    draft_mod.save_hf(folder, dcfg, params, _tiny_tokenizer())
    loaded = load_model(folder)
    assert loaded.cfg == dcfg
    tokens = held["tokens"][:4]
    np.testing.assert_allclose(_full_probs(loaded.cfg, loaded.params, tokens),
                               _full_probs(dcfg, params, tokens), atol=1e-5)

    sp = SamplingParams()
    prompts, seeds = [[1, 2, 3, 4], [5, 6, 7, 1, 2, 3]], [0, 1]
    ar = Engine(Program(tiny.TARGET, sp, None), tiny.target_params(), eos_ids=(), max_new_tokens=24)
    # The saved folder as a user's `--draft PATH`, through the one drafter factory.
    target = types.SimpleNamespace(cfg=tiny.TARGET, params=tiny.target_params(), tokenizer=loaded.tokenizer)
    drafter, draft_params = build_drafter(folder, 3, sp, tiny.TARGET, tiny.target_params(), file_loader(target))
    spec = Engine(Program(tiny.TARGET, sp, drafter), tiny.target_params(),
                  draft_params, eos_ids=(), max_new_tokens=24)
    a, b = ar.run(prompts, seeds), spec.run(prompts, seeds)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert sum(sum(r.accepted) for r in b) > 0  # the trained draft is actually accepted


def test_config_refuses_unknown_keys_and_bad_layers(tmp_path):
    bad = tmp_path / "distill_x.yaml"
    bad.write_text("train: {n_layers: 2, init_layers: [0]}\n")
    with pytest.raises(UserError, match="init_layers"):
        load_config(str(bad))
    bad.write_text("train: {learning_rte: 0.1}\n")
    with pytest.raises(UserError, match="learning_rte"):
        load_config(str(bad))
    cfg = load_config("configs/distill_wide2.yaml")
    assert cfg.train.init_layers == (0, 1) and cfg.data.dir.endswith("wide2/data")


def test_reduced_training_head_still_teaches_the_full_head(datasets, tmp_path):
    """Catches a subset head whose ids are mapped wrongly (the full-head alpha would not rise)."""
    train_data, held = datasets
    subset = train_mod.token_subset(train_data, 6)
    assert len(subset) == 6 and len(set(subset.tolist())) == 6
    cfg, dcfg, trainable, frozen = _setup(train_vocab=6)
    result = train_mod.train(cfg, dcfg, trainable, frozen, train_data, held, str(tmp_path), log=lambda s: None)
    first = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])["alpha_code"]
    assert result["alpha_code"] > first + 0.04, (first, result["alpha_code"])
