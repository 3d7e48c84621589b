"""Run configs: shipped examples load; every mistake is one UserError naming the problem."""

import dataclasses
import os

import pytest

from specsamp import runconfig
from specsamp.errors import UserError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = {"input": "p.parquet", "output": "out", "settings": [{"draft": "none"}, {"draft": "ngram", "k": 4}]}


def make(**changes):
    return runconfig.from_dict({**BASE, **changes}, where="test.yaml")


RUN_CONFIGS = ("humaneval", "xsum", "ksweep", "dataflow_tpu")  # configs/ also holds other tools' files


@pytest.mark.parametrize("name", RUN_CONFIGS)
def test_shipped_configs_load(name):
    """Catches a shipped example that no longer validates."""
    cfg = runconfig.load(os.path.join(ROOT, "configs", f"{name}.yaml"))
    assert cfg.settings and cfg.max_new_tokens >= 1


def test_ksweep_is_baseline_plus_k_1_to_8():
    cfg = runconfig.load(os.path.join(ROOT, "configs", "ksweep.yaml"))
    assert [(s.mode, s.k) for s in cfg.settings] == [("autoregressive", 0)] + [("speculative", k) for k in range(1, 9)]
    assert cfg.target is None or cfg.target == "smollm2"


def test_readme_config_is_small_and_runs_both_modes():
    """The README's main command must finish in minutes on 2 CPU cores."""
    cfg = runconfig.load(os.path.join(ROOT, "configs", "humaneval.yaml"))
    assert {s.mode for s in cfg.settings} == {"speculative", "autoregressive"}
    assert cfg.limit is not None and cfg.limit <= 20 and cfg.max_new_tokens <= 128
    assert cfg.builtin_input == "humaneval"


@pytest.mark.parametrize("changes, words", [
    ({"unknown_key": 1}, "unknown_key"),
    ({"settings": []}, "settings"),
    ({"settings": [{"draft": "ngram", "k": 0}]}, "K"),
    ({"settings": [{"draft": "ngram", "k": 40}]}, "32"),
    ({"settings": [{"draft": "none", "k": 3}]}, "baseline"),
    ({"settings": [{"draft": "ngram", "k": 4}, {"draft": "ngram", "k": [4]}]}, "twice"),
    ({"settings": [{"draft": "/no/such/draft", "k": 4}]}, "does not exist"),
    ({"settings": [{"draft": "early-exit", "k": 4}]}, "layer count"),
    ({"settings": [{"draft": "ngram+/no/such/draft", "k": 4}]}, "does not exist"),
    ({"settings": [{"draft": "ngram+ngram", "k": 4}]}, "hybrid"),
    ({"settings": [{"draft": "ngram", "kk": 4}]}, "setting"),
    ({"sampling": {"temperature": -1}}, "temperature"),
    ({"sampling": {"top_p": 0}}, "top-p"),
    ({"sampling": {"temp": 1}}, "sampling"),
    ({"limit": 0}, "limit"),
    ({"max_new_tokens": "many"}, "max_new_tokens"),
    ({"batch_size": True}, "batch_size"),
    ({"chat": "yes"}, "chat"),
    ({"stop": [""]}, "stop"),
    ({"input": "builtin:nope"}, "builtin"),
    ({"target": "/no/such/model"}, "does not exist"),
    ({"workers": {"model_copies": 0}}, "model_copies"),
    ({"workers": {"gpus": 1}}, "workers"),
    ({"weights": "fp8"}, "weights"),
    ({"weights": "stored-a8", "tensor_parallel": 2}, "stored-a8"),
    ({"kv_cache": "int8"}, "kv_cache"),
    ({"dtype": "float16"}, "dtype"),
])
def test_mistakes_are_user_errors(changes, words):
    with pytest.raises(UserError, match=words) as error:
        make(**changes)
    assert str(error.value).count("test.yaml") == 1  # where, said once


def test_missing_required_key():
    with pytest.raises(UserError, match="output"):
        runconfig.from_dict({"input": "x", "settings": [{"draft": "none"}]})


def test_k_list_expands_and_defaults():
    cfg = make(settings=[{"draft": "ngram", "k": [1, 3]}, {"draft": "early-exit:2"}, {"draft": "ngram:4", "k": 2}])
    assert [(s.draft, s.k) for s in cfg.settings] == [("ngram", 1), ("ngram", 3), ("early-exit:2", 4), ("ngram:4", 2)]


def test_hash_covers_what_changes_samples_only():
    """Resume relies on this: same samples -> same hash; output/limit/input do not count."""
    a = make()
    assert a.config_hash() == make().config_hash()
    assert a.config_hash() == make(output="elsewhere", limit=3, input="q.parquet", batch_size=4).config_hash()
    for changes in ({"seed": 1}, {"max_new_tokens": 64}, {"sampling": {"temperature": 1.0}},
                    {"settings": [{"draft": "ngram", "k": 5}]}, {"chat": False}, {"system": "Be brief."},
                    {"weights": "float32"}, {"kv_cache": "float16"}, {"dtype": "bfloat16"},
                    {"dtype": "bfloat16", "kv_cache": "float32"}, {"verify": "token"}):
        assert make(**changes).config_hash() != a.config_hash(), changes
    assert make(target="smollm2").config_hash() == a.config_hash()  # the default, spelled out


def test_configs_from_before_dtype_keep_their_hash():
    """Catches a dtype or kv_cache default that changes the hash of existing runs (their
    outputs would no longer be resumed): the hashes are those the version before `dtype`
    gave for the same configs."""
    assert make().config_hash() == "9618a6b44bc7b955"
    assert make(kv_cache="float16").config_hash() == "49c326d3ec875887"
    assert make(kv_cache="float32").config_hash() == make().config_hash()
    assert make(verify="block").config_hash() == make().config_hash()  # the default, spelled out


def test_verify_is_checked():
    assert make(verify="token").verify == "token"
    with pytest.raises(UserError, match="verify"):
        make(verify="blocks")


def test_frozen_and_overrides_revalidate():
    cfg = make()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.limit = 3
    assert cfg.with_overrides(limit=5, output=None).limit == 5
    with pytest.raises(UserError, match="limit"):
        cfg.with_overrides(limit=0)


def test_yaml_errors(tmp_path):
    with pytest.raises(UserError, match="not found"):
        runconfig.load(str(tmp_path / "missing.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("input: [unclosed\n")
    with pytest.raises(UserError, match="YAML"):
        runconfig.load(str(bad))
    bad.write_text("- just a list\n")
    with pytest.raises(UserError, match="mapping"):
        runconfig.load(str(bad))


def test_k_auto_is_a_setting_of_its_own(tmp_path):
    """`k: auto` parses to the batch-aware policy's setting (an int in output tables),
    labelled and keyed 'auto', next to fixed K values of the same drafter."""
    from specsamp.runconfig import K_AUTO, _parse_settings

    s = _parse_settings([{"draft": "ngram", "k": ["auto", 4]}], "cfg.yaml")
    assert [x.k for x in s] == [K_AUTO, 4]
    assert s[0].key == "ngram|auto" and s[0].label == "ngram K=auto" and s[1].key == "ngram|4"


def test_kv_cache_reaches_the_generator():
    """kv_cache: float16 and dtype: bfloat16 in a run config reach the generators (the
    handler passes them on); the defaults stay 'auto' (float32 on a CPU)."""
    from pipelines.handler import generator_spec

    cfg = make(kv_cache="float16")
    assert cfg.kv_cache == "float16"
    assert {generator_spec(cfg, s).kv_cache for s in cfg.settings} == {"float16"}
    assert {generator_spec(make(), s).kv_cache for s in make().settings} == {"auto"}
    cfg = make(dtype="bfloat16")
    assert {generator_spec(cfg, s).dtype for s in cfg.settings} == {"bfloat16"}


TREE_YAML = """
input: p.parquet
output: out
settings:
  - {draft: none}
  - {draft: ngram, k: 2, tree: [off, 2x1]}
  - {draft: ngram, tree: 1-2-3}
  - {draft: early-exit:1, tree: 2x01, k: 2}
  - {draft: early-exit:1, tree: [1-2-11, 3]}
"""


def test_tree_settings_expand_and_are_settings_of_their_own(tmp_path):
    """`tree: [off, 2x1]` expands like a k list (YAML reads `off` as false, `3` as 3); a
    tree's K is its depth, and its key and label differ from the chain's of the same K."""
    path = tmp_path / "trees.yaml"
    path.write_text(TREE_YAML)
    cfg = runconfig.load(str(path))
    assert [(s.draft, s.k, s.tree) for s in cfg.settings] == [
        ("none", 0, "off"), ("ngram", 2, "off"), ("ngram", 2, "2x1"), ("ngram", 1, "1-2-3"),
        ("early-exit:1", 2, "2x1"), ("early-exit:1", 2, "1-2-11"), ("early-exit:1", 3, "dyn3")]
    chain, tree = cfg.settings[1], cfg.settings[2]
    assert chain.key == "ngram|2" and tree.key != chain.key and "2x1" in tree.key
    assert tree.label == "ngram tree=2x1" and chain.label == "ngram K=2"
    assert len({s.key for s in cfg.settings}) == len(cfg.settings)
    assert (tree.span, chain.span, cfg.settings[3].span) == (4, 2, 3)
    assert cfg.settings[6].span == 6  # a dynamic tree's drafter writes all its candidates


def test_tree_changes_the_hash_and_a_chain_keeps_its_own():
    chain = make(settings=[{"draft": "ngram", "k": 2}]).config_hash()
    tree = make(settings=[{"draft": "ngram", "tree": "2x1"}]).config_hash()
    other = make(settings=[{"draft": "ngram", "tree": "3x1"}]).config_hash()
    assert len({chain, tree, other}) == 3
    assert make(settings=[{"draft": "ngram", "k": 2, "tree": "off"}]).config_hash() == chain
    assert make(settings=[{"draft": "ngram", "k": 2, "tree": False}]).config_hash() == chain


@pytest.mark.parametrize("setting, words", [
    ({"draft": "ngram", "k": "auto", "tree": "2x1"}, "k auto do not combine"),
    ({"draft": "ngram", "k": ["auto"], "tree": ["off", "2x1"]}, "k auto do not combine"),
    ({"draft": "ngram", "k": 3, "tree": "2x1"}, "depth 2, got k=3"),
    ({"draft": "none", "tree": "2x1"}, "baseline"),
    ({"draft": "ngram", "tree": "2y1"}, "widths per depth"),
    ({"draft": "ngram", "tree": "0x1"}, "widths per depth"),
    ({"draft": "ngram", "tree": True}, "widths per depth"),
    ({"draft": "ngram", "tree": "8x8"}, "at most 64"),
    ({"draft": "ngram", "tree": "2x2"}, "branches"),
    ({"draft": "ngram", "tree": ["2x1", "2x1"]}, "twice"),
    ({"draft": "ngram", "tree": "auto", "k": 2}, "tree auto picks K"),
    ({"draft": "none", "tree": "auto"}, "baseline"),
    ({"draft": "ngram", "tree": ["auto", "auto"]}, "twice"),
    ({"draft": "early-exit:1", "tree": ["3", "dyn3"]}, "twice"),
    ({"draft": "early-exit:1", "tree": 40}, "1 to 32 nodes"),
])
def test_tree_mistakes_are_one_user_error(setting, words):
    with pytest.raises(UserError, match=words) as error:
        make(settings=[setting])
    assert str(error.value).count("test.yaml") == 1 and "\n" not in str(error.value)


def test_tree_auto_is_a_k_auto_setting_of_its_own():
    """`tree: auto` (k left out or auto): the K policy with trees, k -1 (auto) in the
    tables, tree 'auto', keyed apart from `k: auto`; n-gram takes it (branches only); the
    generator spec it makes is tree auto."""
    from pipelines.handler import generator_spec

    cfg = make(settings=[{"draft": "ngram", "k": "auto"}, {"draft": "ngram", "tree": "auto"},
                         {"draft": "early-exit:1", "k": "auto", "tree": "auto"}])
    chain, tree, early = cfg.settings
    assert (tree.k, tree.tree) == (runconfig.K_AUTO, "auto") == (early.k, early.tree)
    assert tree.key == "ngram|auto|auto" != chain.key and tree.label == "ngram tree=auto"
    assert tree.span == 6
    spec = generator_spec(cfg, tree)
    assert (spec.k, spec.tree, spec.draft_k.auto, len(spec.draft_k.trees)) == ("auto", "auto", True, 4)


def test_tree_needs_a_drafter_that_drafts_trees(tmp_path, monkeypatch):
    """A hybrid drafts the lookup's trees of branches (and no other shape); the config
    refuses the others up front, also where `draft: auto` resolves to a hybrid."""
    from specsamp.decoding import drafts

    (tmp_path / "feature").mkdir()
    hybrid = f"ngram+{tmp_path / 'feature'}"
    assert make(settings=[{"draft": hybrid, "tree": "2x1"}]).settings[0].tree == "2x1"
    assert make(settings=[{"draft": hybrid, "tree": "auto"}]).settings[0].tree == "auto"
    with pytest.raises(UserError, match="trees of branches"):
        make(settings=[{"draft": hybrid, "tree": "2x2"}])
    monkeypatch.setattr(drafts, "default_draft", lambda target: hybrid)
    with pytest.raises(UserError, match=r"drafter auto \(ngram\+.*trees of branches"):
        make(settings=[{"draft": "auto", "tree": "2x2"}])
    assert make(settings=[{"draft": "auto", "tree": "3x1"}]).settings[0].tree == "3x1"
    monkeypatch.setattr(drafts, "default_draft", lambda target: "ngram")
    assert make(settings=[{"draft": "auto", "tree": "2x1"}]).settings[0].tree == "2x1"


def test_tree_drafts_are_the_drafters_that_draft_trees():
    """TREE_DRAFTS (what a config accepts) names the drafter kinds with propose_tree, and
    BRANCH_DRAFTS those whose check_tree allows trees of branches only."""
    from specsamp.decoding.config import BRANCH_DRAFTS, TREE_DRAFTS
    from specsamp.decoding.drafters import FeatureDrafter, ModelDrafter
    from specsamp.decoding.lookup import HybridDrafter, NgramDrafter

    assert set(TREE_DRAFTS) == {"model", "early-exit", "ngram", "hybrid"}
    assert all(hasattr(c, "propose_tree") for c in (ModelDrafter, FeatureDrafter, NgramDrafter, HybridDrafter))
    assert set(BRANCH_DRAFTS) == {"ngram", "hybrid"}
    assert all(hasattr(c, "check_tree") for c in (NgramDrafter, HybridDrafter))
    assert not any(hasattr(c, "check_tree") for c in (ModelDrafter, FeatureDrafter))


def test_tree_reaches_the_generator():
    from pipelines.handler import generator_spec

    cfg = make(settings=[{"draft": "none"}, {"draft": "ngram", "k": 2}, {"draft": "ngram", "tree": "3x1"}])
    specs = [generator_spec(cfg, s) for s in cfg.settings]
    assert [s.tree for s in specs] == ["off", "off", "3x1"]
    assert specs[2].draft_tree.size == 6 and specs[2].draft_k.table == cfg.settings[2].k == 2
