"""The one factory that turns a draft string into a drafter and the params it runs on.

Every place that builds a drafter goes through `build_drafter`: the generator (and with it
the command line, the Beam handler, `specsamp bench` and `specsamp audit`), and the tests.
The draft string's forms are `config.parse_draft`'s: 'none', 'ngram[:N]', 'early-exit:L',
a path or shipped name of a draft model or feature draft, 'ngram[:N]+<feature draft>';
'auto' is resolved first (`resolve_auto`).

Draft weights named by a path are read by a `Loader`: `file_loader` reads folders and files
(local or gs://); tests pass a loader of in-memory models, so that the drafter they check is
built exactly as a user's is.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from specsamp.decoding.config import SamplingParams, parse_draft
from specsamp.decoding.drafters import Drafter, FeatureDrafter, ModelDrafter
from specsamp.decoding.drafts import default_draft
from specsamp.decoding.lookup import HybridDrafter, NgramDrafter
from specsamp.errors import UserError
from specsamp.loading import check_draft_head
from specsamp.models import Model, ModelConfig


@dataclasses.dataclass(frozen=True)
class DraftWeights:
    """A draft model named by a path: 'model' (a decoder sharing the target's vocabulary)
    or 'feature' (conditioned on the target's hidden states, `specsamp distill`)."""

    kind: str
    cfg: ModelConfig
    params: Any


# (a draft's path, whether only a feature draft will do: the hybrid's) -> its weights
Loader = Callable[[str, bool], DraftWeights]


def resolve_auto(draft: str, target: str | None) -> str:
    """What 'auto' means for `target` (`drafts.default_draft`); any other draft as given."""
    return default_draft(target) if draft == "auto" else draft


def build_drafter(draft: str, k: int, sampling: SamplingParams, target_cfg: ModelConfig,
                  target_params, load: Loader, mesh=None, wide: int = 0) -> tuple[Drafter | None, Any]:
    """(drafter, draft params) for a resolved draft string at draft length k; (None, None)
    for 'none'. With a tensor-parallel mesh, a separate draft's params are copied to every
    device (it is small); an early exit shares the target's split layers. wide > 0 (`k
    auto`): a hybrid also runs rounds of `wide` lookup tokens on matches of its longest
    n-gram (`HybridDrafter.wide`)."""
    kind, arg = parse_draft(draft)
    if kind == "auto":
        raise ValueError("resolve 'auto' first (resolve_auto)")
    if kind == "none":
        return None, None
    if kind == "ngram":
        return NgramDrafter(k, target_cfg.vocab_size, arg), None
    if kind == "early-exit":
        if arg >= target_cfg.n_layers:
            raise UserError(f"early-exit:{arg} needs fewer layers than the target's {target_cfg.n_layers}")
        model, params = Model(target_cfg, mesh).first_layers(target_params, arg)
        return ModelDrafter(model.cfg, k, sampling, kind="early-exit",
                            cache_dtype=_dtype_name(params)), params
    if kind == "hybrid":
        n, path = arg
        weights = load(path, True)
        if weights.kind != "feature":
            raise _not_feature(path)
        # Lookup only for matches of 2 tokens or more: a 1-token match is a worse guess than
        # the feature draft's (docs/measurements.md).
        drafter = HybridDrafter(NgramDrafter(k, target_cfg.vocab_size, n, min_ngram=min(2, n)),
                                FeatureDrafter(weights.cfg, k, sampling),
                                NgramDrafter(wide, target_cfg.vocab_size, n, min_ngram=n) if wide else None)
    else:
        weights = load(arg, False)
        if weights.kind == "feature":
            drafter = FeatureDrafter(weights.cfg, k, sampling)
        else:
            drafter = ModelDrafter(weights.cfg, k, sampling, cache_dtype=_dtype_name(weights.params),
                                   vocab_size=_padded_vocab(weights.cfg, target_cfg, arg))
    return drafter, _replicated(weights.params, mesh)


def _dtype_name(params) -> str:
    from specsamp.models.llama import compute_dtype

    return compute_dtype(params).name


def _padded_vocab(draft: ModelConfig, target: ModelConfig, name: str) -> int | None:
    """The size a draft model's logits are padded to: the target's, when the draft's head
    is smaller (`ModelDrafter.vocab_size`); a larger head is refused
    (`loading.check_draft_head`)."""
    check_draft_head(draft.vocab_size, target.vocab_size, name)
    return target.vocab_size if draft.vocab_size < target.vocab_size else None


def _not_feature(path: str) -> UserError:
    return UserError(f"'ngram+<draft>' needs a feature-conditioned draft (a folder "
                     f"written by specsamp distill), got {path!r}")


def _replicated(params, mesh):
    if mesh is None:
        return params
    from specsamp.models.sharding import replicate_params

    return replicate_params(params, mesh)


def file_loader(target, load_model: Callable[[str], Any] | None = None) -> Loader:
    """A Loader of drafts on disk or gs:// for the loaded target `target` (a feature draft
    borrows its embedding rows; a draft model must share its vocabulary). `load_model`
    reads a draft model (default `specsamp.loading.load_model`; the generator passes its
    once-per-process cache)."""

    def load(path: str, feature_only: bool) -> DraftWeights:
        from specsamp.loading import check_same_vocab
        from specsamp.models.feature_draft import is_feature_draft, load_feature_draft

        if is_feature_draft(path):
            return DraftWeights("feature", *load_feature_draft(path, target))
        if feature_only:  # before reading a whole model that cannot be used
            raise _not_feature(path)
        if load_model is None:
            from specsamp.loading import load_model as read
        else:
            read = load_model
        draft = read(path)
        check_same_vocab(target, draft)
        return DraftWeights("model", draft.cfg, draft.params)

    return load
