"""Drafters: each proposes K tokens per row with the full distributions they came from.

- `ModelDrafter`: a separate draft model (the paper's setting) or the target's first L
  layers (early exit); tokens drawn from probs_from_logits of the draft's logits, the same
  transform as the target's.
- `FeatureDrafter`: one layer fed the token embedding and the target's hidden state at the
  previous position (EAGLE-style); chains K tokens on its own predicted features.
- `NgramDrafter` and `HybridDrafter` (prompt lookup, alone or before the feature draft):
  `specsamp.decoding.lookup`.

Every drafter follows the `Drafter` protocol below and owns its loop state (a pytree it
defines: a draft model's KV cache, the target's features a feature draft reads), kept in
`DecodeState.draft` and read by no one else: `init_state` makes it, `observe` records the
target's hidden states after each target call, `prefill` (re)builds it from tokens (after
the prompt, and after plain K = 0 rounds that did not feed it), `propose(params, state,
keys) -> Proposal` drafts a round and returns the state after it, and `with_k(k)` is the
same drafter at another K (the batch-aware policy switches K between chunks of rounds; the
state's layout does not depend on K).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Protocol

import flax.struct
import jax
import jax.numpy as jnp

from specsamp.decoding.config import SamplingParams
from specsamp.decoding.sampling import probs_from_logits, sample
from specsamp.decoding.state import (DecodeState, gather_window, prefix_positions, shifted_features,
                                     write_window)
from specsamp.decoding.tree import Tree
from specsamp.decoding.tree_draft import (FeatureSteps, ModelSteps, Reduced, TreeProposal, draft_tree,
                                          feature_head)
from specsamp.models import KVCache, Model, ModelConfig, init_cache
from specsamp.models.model import cache_attention, default_attention
from specsamp.models.argmax import first_argmax
from specsamp.models.feature_draft import FeatureModel


class Proposal(NamedTuple):
    draft: jax.Array  # [B, K] int32
    # [B, K, V] float32: the distributions the draft tokens came from; None: every row's
    # draft is the point mass on its tokens (prompt lookup), not built as arrays
    p: jax.Array | None
    draft_state: Any  # the drafter's loop state after the round (None: it has none)
    found: jax.Array | None = None  # [B] bool: rows with a real proposal (None: all)
    calls: jax.Array | None = None  # [B] int32 draft calls per row (None: calls_per_round)
    point: jax.Array | None = None  # [B] bool: rows whose draft is a point mass (p not read there)


class Drafter(Protocol):
    """What the decoding loop needs from a drafter.

    A drafter is a hashable frozen dataclass: it is a static argument of the compiled
    programs (`decode.Program`), so two equal drafters share one compiled program, and
    everything that changes between calls (weights, tokens, keys) comes in as arguments.
    Drafters are built from a draft string by `factory.build_drafter` only.

    Exactness rests on `propose`: for each row, `p[b, i]` must be the distribution
    `draft[b, i]` was drawn from (a point mass for a deterministic proposal), computed from
    that row's own tokens, the draft params and `keys[b]` only, never from its batch-mates
    or its slot; the rejection rule (`acceptance.py`) then makes the output the target's.
    """

    k: int  # draft tokens proposed per round
    kind: str  # for names and statistics: 'model', 'early-exit', 'feature', 'ngram', 'ngram+feature'

    @property
    def uses_cache(self) -> bool:
        """True when the drafter runs a draft model; it then has a `cfg` (ModelConfig) and
        a `forward` (one draft call, which the cost model times)."""

    @property
    def calls_per_round(self) -> int:
        """Draft model calls of one round (0 for lookup); Proposal.calls overrides it per
        row when rounds differ."""

    def init_state(self, batch: int, slots: int) -> Any:
        """The drafter's loop state for `batch` rows of `slots` positions (None: none).
        Leaves have the batch axis first, except KVCache leaves ([L, B, ...])."""

    def observe(self, draft_state, hidden: jax.Array, start: jax.Array) -> Any:
        """The state after a target call: hidden [B, W, D] are the target's final-normed
        hidden states at positions start[b]..start[b]+W-1 of each row."""

    def prefill(self, params, tokens: jax.Array, draft_state, start: jax.Array) -> Any:
        """The state after feeding tokens [B, W] at positions start[b]..start[b]+W-1 (after
        `observe` of the target's hidden states there); prefill feeds a prompt this way,
        a pass at a time, from position 0 on."""

    def propose(self, params, state: DecodeState, keys: jax.Array) -> Proposal:
        """K draft tokens per row, with their distributions, from the decode state at each
        row's current position (its own state is state.draft); `keys` [B] are the rows'
        draft keys of this round."""

    def with_k(self, k: int) -> "Drafter": ...

    def with_native(self, native: bool) -> "Drafter":
        """This drafter computing on the native kernels (True) or XLA (False): its
        program's choice (`decode.Program.with_backend`)."""

    # Optional: a drafter that drafts token trees (`Program.tree`) also has
    # propose_tree(params, state, keys, tree) -> tree_draft.TreeProposal: tokens [B, N]
    # (-1 absent), p [B, N+1, V] as `tree_acceptance` reads them, and the `Children` mode
    # that says truthfully how each node's children were chosen.


@dataclasses.dataclass(frozen=True)
class ModelDrafter:
    cfg: ModelConfig
    k: int
    sampling: SamplingParams
    kind: str = "model"  # 'model' or 'early-exit' (only for names and statistics)
    cache_dtype: str = "float32"  # its KV cache's type: that of its weights
    # The target's vocabulary size when the draft's head is smaller (a family whose larger
    # models pad their embedding further): the draft's logits are padded to it with the
    # least float, so the ids it lacks have draft probability 0 (never drafted; the
    # rejection rule's residual gives them the target's own mass). None: the same size.
    vocab_size: int | None = None
    native: bool | None = None  # the program's backend (`Drafter.with_native`); None: at trace time

    @property
    def uses_cache(self) -> bool:
        return True

    def init_state(self, batch: int, slots: int) -> KVCache:
        # the draft model's own KV cache
        return init_cache(self.cfg, batch, slots, jnp.dtype(self.cache_dtype))

    def observe(self, cache, hidden, start):
        return cache

    def prefill(self, params, tokens, cache: KVCache, start) -> KVCache:
        positions = start[:, None] + prefix_positions(tokens)
        _, cache = self._model().forward(params, self._known(tokens), positions, cache, head=False)
        return cache

    def _known(self, tokens):
        """Tokens as the draft reads them: an id past a smaller draft's embedding (the
        target may emit one, from the residual) read as its last id. Looked up as it is,
        it would read NaN (an out-of-range gather) into the draft's cache and every later
        draft of the row. What the draft reads never changes what the rule samples."""
        return jnp.minimum(tokens, self.cfg.vocab_size - 1) if self.vocab_size else tokens

    def forward(self, params, tokens, positions, cache, paths=None):
        """One draft call: (logits [B, T, V], cache) (also what the cost ratio times);
        paths: a tree block's (`Model.forward`)."""
        logits, cache = self._model().forward(params, self._known(tokens), positions, cache, paths=paths)
        missing = (self.vocab_size or self.cfg.vocab_size) - self.cfg.vocab_size
        if missing > 0:
            logits = jnp.pad(logits, ((0, 0), (0, 0), (0, missing)),
                             constant_values=jnp.finfo(jnp.float32).min)
        return logits, cache

    def with_k(self, k: int) -> "ModelDrafter":
        return dataclasses.replace(self, k=k)

    def with_native(self, native: bool) -> "ModelDrafter":
        return dataclasses.replace(self, native=native)

    def _model(self) -> Model:
        return Model(self.cfg, attention=default_attention(self.cfg, None, self.native))

    def propose(self, params, state: DecodeState, keys: jax.Array):
        t = state.current
        # First call feeds the pair (t-1, t): slot t-1 holds the previous round's last draft
        # token, which is missing from the cache when that round accepted all K.
        start = jnp.maximum(t - 1, 0)
        pair = gather_window(state.tokens, start, 2)
        positions = start[:, None] + jnp.arange(2)[None, :]
        logits, cache = self.forward(params, pair, positions, state.draft)
        logits = jnp.take_along_axis(logits, (t - start)[:, None, None], axis=1)[:, 0]

        def feed(tok, i, _, cache):
            logits, cache = self.forward(params, tok[:, None], (t + 1 + i)[:, None], cache)
            return logits[:, 0], cache

        return Proposal(*_chain(_drawer(self.sampling, keys, self.native), lambda x: x, feed, logits, cache, self.k))

    @property
    def calls_per_round(self) -> int:
        return self.k

    def propose_tree(self, params, state: DecodeState, keys: jax.Array, tree: Tree,
                     scored: bool = False) -> TreeProposal:
        """A token tree of `tree`'s shape per row (`tree_draft`): K = tree depth calls.
        scored: a `DynamicTree`'s candidates (`draft_tree`)."""
        return draft_tree(ModelSteps(self.forward, tree.max_depth), params, state, keys, tree,
                          self.sampling, scored)


def _drawer(sampling: SamplingParams, keys: jax.Array, native: bool | None):
    """draw(logits [B, V], i) -> (token [B], probs [B, V]): the i-th draft token of each row.
    A reduced head's rows (`tree_draft.Reduced`) are processed and drawn from over the
    head's own entries (its padding copies masked to probability 0), and only the
    probabilities are scattered into the vocabulary, for the acceptance rule: the same law
    as over the scattered logits, every other token at probability 0 either way, and the
    rule reads the very array the token was drawn from (a full row's softmax and draw cost
    ~0.25 ms a draft token against ~0.06, docs/measurements.md)."""

    def draw(logits, i):
        if isinstance(logits, Reduced):
            at, probs = draw(logits.unique(), i)
            return logits.ids[at], logits.scatter(probs)
        probs = probs_from_logits(logits, sampling)
        if sampling.greedy:  # a point mass: sample() would return its one token
            return first_argmax(logits.astype(jnp.float32), native), probs
        step_keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, i)
        return jax.vmap(sample)(step_keys, probs), probs

    return draw


def _chain(draw, head, feed, x, cache, k: int):
    """Draw K draft tokens: token i from head(x), then x, cache = feed(token, i, x, cache)
    for all but the last. Returns (draft [B, K], p [B, K, V], cache)."""

    def step(carry, i):
        x, cache = carry
        tok, probs = draw(head(x), i)
        x, cache = feed(tok, i, x, cache)
        return (x, cache), (tok, probs)

    (x, cache), (toks, probs) = jax.lax.scan(step, (x, cache), jnp.arange(k - 1))
    last_tok, last_probs = draw(head(x), k - 1)
    draft = jnp.concatenate([toks.T, last_tok[:, None]], axis=1)
    p = jnp.concatenate([jnp.swapaxes(probs, 0, 1), last_probs[:, None]], axis=1)
    return draft, p, cache


@flax.struct.dataclass
class FeatureState:
    """A feature draft's loop state: its KV cache, and the target's final hidden state at
    every position so far (what each draft call reads for the position before it)."""

    cache: KVCache
    features: jax.Array  # [B, S, D]


@dataclasses.dataclass(frozen=True)
class FeatureDrafter:
    cfg: ModelConfig  # the target's config with the draft's layer count
    k: int
    sampling: SamplingParams
    kind: str = "feature"
    native: bool | None = None  # the program's backend (`Drafter.with_native`); None: at trace time

    @property
    def uses_cache(self) -> bool:
        return True

    def _attention(self, cache: KVCache) -> str:
        return cache_attention(default_attention(self.cfg, None, self.native), cache)

    @property
    def calls_per_round(self) -> int:
        return self.k

    def init_state(self, batch: int, slots: int) -> FeatureState:
        return FeatureState(init_cache(self.cfg, batch, slots),
                            jnp.zeros((batch, slots, self.cfg.d_model), jnp.float32))

    def observe(self, fs: FeatureState, hidden, start) -> FeatureState:
        return fs.replace(features=write_window(fs.features, hidden.astype(jnp.float32), start))

    def prefill(self, params, tokens, fs: FeatureState, start) -> FeatureState:
        feats = shifted_features(fs.features, start, tokens.shape[1])
        _, cache = FeatureModel(self.cfg).forward(
            params, tokens, feats, start[:, None] + prefix_positions(tokens), fs.cache,
            self._attention(fs.cache))
        return fs.replace(cache=cache)

    def with_k(self, k: int) -> "FeatureDrafter":
        return dataclasses.replace(self, k=k)

    def with_native(self, native: bool) -> "FeatureDrafter":
        return dataclasses.replace(self, native=native)

    def forward(self, params, tokens, positions, cache, features=None):
        """One draft call: (logits [B, T, V], cache); features default to zeros (what the
        cost ratio times: the same work whatever the features are)."""
        if features is None:
            features = jnp.zeros(tokens.shape + (self.cfg.d_model,), jnp.float32)
        model = FeatureModel(self.cfg)
        g, cache = model.forward(params, tokens, features, positions, cache, self._attention(cache))
        return model.logits(params, g), cache

    def refresh(self, params, state: DecodeState):
        """The first call of a round: the window of K+1 positions ending at t, with the
        target's true features. It (re)writes every position accepted since the last round
        (at most K+1) with true features, replacing the draft's own guesses from that round.
        Returns (g [B, 1, D] at t, the state with that cache)."""
        t, fs = state.current, state.draft
        start = jnp.maximum(t - self.k, 0)
        width = self.k + 1
        tokens = gather_window(state.tokens, start, width)
        feats = shifted_features(fs.features, start, width)
        positions = start[:, None] + jnp.arange(width)[None, :]
        g, cache = FeatureModel(self.cfg).forward(params, tokens, feats, positions, fs.cache,
                                                  self._attention(fs.cache))
        return jnp.take_along_axis(g, (t - start)[:, None, None], axis=1), fs.replace(cache=cache)

    def propose(self, params, state: DecodeState, keys: jax.Array):
        model = FeatureModel(self.cfg)
        t = state.current
        g, fs = self.refresh(params, state)

        def feed(tok, i, g, cache):  # chained steps read the draft's own features
            return model.forward(params, tok[:, None], g, (t + 1 + i)[:, None], cache,
                                 self._attention(cache))

        if self.sampling.greedy:  # the argmax straight from a reduced head's logits
            vocab = self.cfg.vocab_size
            head = lambda g: model.greedy_tokens(params, g, self.native)[:, 0]
            draw = lambda tok, i: (tok, jax.nn.one_hot(tok, vocab, dtype=jnp.float32))
        else:  # a reduced head's rows stay reduced (`_drawer`)
            def head(g):
                rows = feature_head(self.cfg, params, g)
                return rows._replace(logits=rows.logits[:, 0]) if isinstance(rows, Reduced) else rows[:, 0]

            draw = _drawer(self.sampling, keys, self.native)
        draft, p, cache = _chain(draw, head, feed, g, fs.cache, self.k)
        return Proposal(draft, p, fs.replace(cache=cache))

    def propose_tree(self, params, state: DecodeState, keys: jax.Array, tree: Tree,
                     scored: bool = False) -> TreeProposal:
        """A token tree of `tree`'s shape per row (`tree_draft`): K = tree depth calls.
        scored: a `DynamicTree`'s candidates (`draft_tree`)."""
        return draft_tree(FeatureSteps(self, tree), params, state, keys, tree, self.sampling, scored)
