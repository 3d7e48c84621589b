"""Speculative decoding on the embedded SmolLM2-135M-Instruct: greedy output is
token-for-token the autoregressive output, with every drafter, in chains and in token
trees (slow: real weights)."""

import jax
import pytest

from specsamp.decoding.config import SamplingParams
from specsamp.decoding.decode import Program
from specsamp.decoding.engine import Engine
from specsamp.decoding.factory import DraftWeights, build_drafter, file_loader
from specsamp.decoding.tree import Tree

pytestmark = pytest.mark.slow

PROMPTS = [
    "<|im_start|>user\nWrite a Python function that checks whether a number is prime.<|im_end|>\n<|im_start|>assistant\n",
    "The history of the printing press begins in",
]
MAX_NEW = 48


def _prompt_ids(smollm2):
    return [smollm2.tokenizer.encode(p) for p in PROMPTS]


def _run(smollm2, drafter=None, draft_params=None, tree=None):
    sp = SamplingParams(0.0)
    engine = Engine(Program(smollm2.cfg, sp, drafter, tree=tree), smollm2.params, draft_params,
                    eos_ids=tuple(smollm2.tokenizer.eos_ids), max_new_tokens=MAX_NEW)
    return engine.run(_prompt_ids(smollm2), [0, 1])


@pytest.fixture(scope="module")
def baseline(smollm2):
    return _run(smollm2)


def _layers(params, idx):
    return {**params, "layers": jax.tree.map(lambda a: a[idx], params["layers"])}


@pytest.mark.parametrize("drafter", ["ngram", "early-exit:2", "separate:0,29", "self", "shipped"])
def test_greedy_speculative_equals_autoregressive(smollm2, baseline, drafter):
    cfg, params, sp = smollm2.cfg, smollm2.params, SamplingParams(0.0)
    in_memory = {  # draft models made of the target's own layers, by name
        "separate:0,29": DraftWeights("model", cfg.truncated(2), _layers(params, jax.numpy.array([0, 29]))),
        "self": DraftWeights("model", cfg, params),  # the target drafting for itself
    }
    from_files = file_loader(smollm2)

    def load(path, feature_only):
        return in_memory[path] if path in in_memory else from_files(path, feature_only)

    draft, k = {"ngram": ("ngram", 4), "early-exit:2": ("early-exit:2", 3), "separate:0,29": ("separate:0,29", 5),
                # lookup + the trained feature draft shipped in the package
                "shipped": ("ngram+smollm2-feature", 3), "self": ("self", 4)}[drafter]
    d, dp = build_drafter(draft, k, sp, cfg, params, load)
    spec = _run(smollm2, d, dp)
    for s, a in zip(spec, baseline):
        assert s.token_ids == a.token_ids
        assert len(a.token_ids) > 10
    if drafter == "self":
        assert all(n == 4 for s in spec for n in s.accepted[:-1])
    if drafter == "shipped":  # trained weights loaded right: far above an untrained draft's
        code = spec[0]
        assert len(code.token_ids) / code.calls > 1.5
        assert code.calls < code.draft_calls  # the model drafted in some rounds


@pytest.mark.parametrize("draft,widths", [
    ("ngram", (3, 1, 1)), ("early-exit:2", (2, 2)), ("smollm2-feature", (2, 2, 1)),
    ("ngram+smollm2-feature", (2, 1, 1)),  # the hybrid, `--draft auto`'s drafter here
])
def test_greedy_tree_equals_autoregressive(smollm2, baseline, draft, widths):
    """Every tree drafter on the real weights: the tree's greedy output is the
    autoregressive output token for token, and a tree round kept a node somewhere."""
    tree = Tree.full(widths)
    d, dp = build_drafter(draft, tree.max_depth, SamplingParams(0.0), smollm2.cfg, smollm2.params,
                          file_loader(smollm2))
    spec = _run(smollm2, d, dp, tree)
    for s, a in zip(spec, baseline):
        assert s.token_ids == a.token_ids
    assert sum(sum(s.accepted) for s in spec) > 0
