"""Speculative decoding on the embedded SmolLM2-135M-Instruct: greedy output is
token-for-token the autoregressive output, with every drafter (slow: real weights)."""

import jax
import pytest

from specsamp.decoding.config import SamplingParams
from specsamp.decoding.decode import Program
from specsamp.decoding.drafters import FeatureDrafter, HybridDrafter, ModelDrafter, NgramDrafter
from specsamp.decoding.drafts import resolve
from specsamp.decoding.engine import Engine
from specsamp.models.feature_draft import load_feature_draft

pytestmark = pytest.mark.slow

PROMPTS = [
    "<|im_start|>user\nWrite a Python function that checks whether a number is prime.<|im_end|>\n<|im_start|>assistant\n",
    "The history of the printing press begins in",
]
MAX_NEW = 48


def _prompt_ids(smollm2):
    return [smollm2.tokenizer.encode(p) for p in PROMPTS]


def _run(smollm2, drafter=None, draft_params=None):
    sp = SamplingParams(0.0)
    engine = Engine(Program(smollm2.cfg, sp, drafter), smollm2.params, draft_params,
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
    if drafter == "ngram":
        d, dp = NgramDrafter(4, cfg.vocab_size), None
    elif drafter == "early-exit:2":
        d, dp = ModelDrafter(cfg.truncated(2), 3, sp), _layers(params, slice(0, 2))
    elif drafter == "separate:0,29":  # a separate 2-layer model (target layers 0 and 29)
        d, dp = ModelDrafter(cfg.truncated(2), 5, sp), _layers(params, jax.numpy.array([0, 29]))
    elif drafter == "shipped":  # lookup + the trained feature draft shipped in the package
        dcfg, dp = load_feature_draft(resolve("smollm2-feature"), smollm2)
        d = HybridDrafter(NgramDrafter(3, cfg.vocab_size), FeatureDrafter(dcfg, 3, sp))
    else:  # the target drafting for itself: every draft token must be accepted
        d, dp = ModelDrafter(cfg, 4, sp), params
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
