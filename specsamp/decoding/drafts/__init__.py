"""Drafts shipped with the package (their own weights only; the target's embedding rows are
borrowed at load time), by name. Each folder is what `specsamp distill` writes to
`<out_dir>/draft`; its recipe is the config named in its `specsamp_draft.json`."""

from __future__ import annotations

import os

SHIPPED = {
    # Feature-conditioned draft for the embedded SmolLM2-135M-Instruct: the first draft
    # (configs/distill_wide2.yaml + configs/distill_feature.yaml) trained on further with
    # 2.5x the data (configs/distill_feature2.yaml).
    "smollm2-feature": "smollm2_135m_instruct_feature",
}


def resolve(draft: str) -> str:
    """A shipped draft's folder for its name; anything else is returned as given (a path)."""
    if draft in SHIPPED:
        return os.path.join(os.path.dirname(os.path.abspath(__file__)), SHIPPED[draft])
    return draft


def default_draft(target: str | None) -> str:
    """What 'auto' means: for the embedded default target, prompt lookup with the shipped
    feature draft where lookup finds nothing (measured to pay, README "Benchmarks");
    for any other target, prompt lookup alone (it needs no training)."""
    from specsamp.loading import DEFAULT_MODEL

    if (target or DEFAULT_MODEL) == DEFAULT_MODEL and os.path.isdir(resolve("smollm2-feature")):
        return "ngram+smollm2-feature"
    return "ngram"
