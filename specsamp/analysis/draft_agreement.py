"""Top-k agreement of a drafter with the target, by depth (issue 30, item 5).

What a token tree can gain depends on how often the target's token is among the draft's
top choices at each depth. This module counts it along a given token sequence (the
target's own greedy continuation of a prompt, teacher-forced), for every row t (the last
known token is x_t) and every depth d = 1..D:

- the draft chain: depth 1 reads x_0..x_t; depth d > 1 reads x_0..x_t and the draft's own
  top-1 tokens at depths 1..d-1 (and, for a feature draft, its own features), exactly as a
  chain drafter's `propose` feeds them (`drafters._chain`, the drafters' own loop);
- rank: the place of x_{t+d} in the draft's logits at depth d (0 = its top-1; ties go to
  the lower token id, as `first_argmax`), so "top-k hit" is rank < k;
- matched: the draft's top-1 tokens at depths 1..d-1 are x_{t+1}..x_{t+d-1} (always true at
  d = 1): where a greedy tree's path can reach depth d; the conditional figures count those
  rows only;
- at T = 1 (no top-k / top-p), with target p = the target's distribution of x_{t+d} and
  draft q = the draft's at depth d, both after the same prefix when matched (p and q the
  other way round from `tree_acceptance`'s names):
  iid[w]  = P(one of w children drawn i.i.d. from q is kept) by the multi-step rule of
            `tree_acceptance` (Children.IID): 1 - prod_i (1 - sum_x min(p_i, q)), p_1 = p,
            p_{i+1} = (p_i - q)+ normalised; iid[1] is the chain's sum_x min(p, q);
  fixed[w] = P(one of the draft's top-w tokens, taken without drawing, is kept)
            (Children.FIXED) = p's mass on them.
  They are exact per node; averaged over matched rows they describe the nodes a greedy
  path visits, not the path a sampled decoding takes.

Prompt lookup has no distribution: `lookup_candidates` counts its distinct candidates.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from specsamp.decoding.config import SamplingParams
from specsamp.decoding.drafters import FeatureDrafter, ModelDrafter, _chain
from specsamp.decoding.sampling import probs_from_logits, residual
from specsamp.models import Model, init_cache
from specsamp.models.argmax import first_argmax
from specsamp.models.feature_draft import FeatureModel

DEPTH = 4
WIDTHS = (1, 2, 4)
T1 = SamplingParams(temperature=1.0)


class Records(NamedTuple):
    """Per row r and depth index i (depth i + 1); rows [R], D = depth."""

    rank: np.ndarray  # [R, D] int32: the target token's rank in the draft's logits
    top1: np.ndarray  # [R, D] int32: the draft's top-1 token (what the next depth is fed)
    iid: np.ndarray  # [R, D, len(WIDTHS)] float32
    fixed: np.ndarray  # [R, D, len(WIDTHS)] float32


@functools.partial(jax.jit, static_argnames=("cfg",))
def target_pass(cfg, params, tokens):
    """(final-normed hidden [1, S, D] float32, logits [1, S, V]) of the target over
    tokens [1, S] at positions 0..S-1: logits[j] is its distribution of x_{j+1}."""
    model = Model(cfg)
    hidden = model.full_forward(params, tokens, head=False)
    return hidden.astype(jnp.float32), model.logits(params, hidden)


def _replicated(cache, rows: int):
    """The one-row cache [L, 1, ...] copied to `rows` rows: row r then overwrites slots from
    t_r + 1 on with its own chain; the causal mask (slot <= position) hides the later slots
    that still hold the true tokens' keys."""
    return jax.tree.map(lambda a: jnp.repeat(a, rows, axis=1), cache)


def _argmax_draw(logits, i):
    return first_argmax(logits), logits  # the chain feeds top-1 and keeps the logits


def chain_logits(drafter, params, tokens, hidden, rows, depth: int):
    """Draft logits [R, depth, V] of the chain from each row t = rows[r] of tokens [1, S]
    (hidden: the target's, for a feature draft's true features). One pass over the whole
    sequence fills the draft's cache; each row then chains depth - 1 steps on its copy."""
    slots = tokens.shape[1]
    positions = jnp.arange(slots, dtype=jnp.int32)[None, :]
    n = rows.shape[0]
    if isinstance(drafter, FeatureDrafter):
        model = FeatureModel(drafter.cfg)
        # The feature at position j is the target's hidden state at j - 1 (zeros at 0).
        feats = jnp.pad(hidden, ((0, 0), (1, 0), (0, 0)))[:, :slots]
        g, cache = model.forward(params, tokens, feats, positions, init_cache(drafter.cfg, 1, slots))
        x = g[0, rows][:, None]  # [R, 1, D]: the draft's guess of h_t

        def head(g):
            return model.logits(params, g)[:, 0]

        def feed(tok, i, g, cache):  # chained steps read the draft's own features
            return model.forward(params, tok[:, None], g, (rows + 1 + i)[:, None], cache)
    elif isinstance(drafter, ModelDrafter):
        logits, cache = drafter.forward(params, tokens, positions, init_cache(drafter.cfg, 1, slots))
        x = logits[0, rows]  # [R, V]: depth 1 from x_0..x_t

        def head(logits):
            return logits

        def feed(tok, i, _, cache):
            logits, cache = drafter.forward(params, tok[:, None], (rows + 1 + i)[:, None], cache)
            return logits[:, 0], cache
    else:
        raise TypeError(f"no distribution to rank for a {type(drafter).__name__}")
    _, logits, _ = _chain(_argmax_draw, head, feed, x, _replicated(cache, n), depth)
    return logits


def node_records(draft_logits, target_logits, truth):
    """rank [..], top1 [..], iid [.., W], fixed [.., W] from draft logits [.., V], the
    target's logits of the same node [.., V] and its token truth [..]."""
    own = jnp.take_along_axis(draft_logits, truth[..., None], axis=-1)
    ids = jnp.arange(draft_logits.shape[-1])
    ahead = (draft_logits > own) | ((draft_logits == own) & (ids < truth[..., None]))
    rank = jnp.sum(ahead, axis=-1, dtype=jnp.int32)
    p, q = probs_from_logits(target_logits, T1), probs_from_logits(draft_logits, T1)
    rejected, iid = jnp.ones(p.shape[:-1]), {}
    for w in range(1, max(WIDTHS) + 1):
        rejected = rejected * (1.0 - jnp.sum(jnp.minimum(p, q), axis=-1))
        iid[w] = 1.0 - rejected
        p = residual(p, q)
    _, top = jax.lax.top_k(draft_logits, max(WIDTHS))
    mass = jnp.cumsum(jnp.take_along_axis(probs_from_logits(target_logits, T1), top, axis=-1), axis=-1)
    return (rank, first_argmax(draft_logits), jnp.stack([iid[w] for w in WIDTHS], axis=-1),
            jnp.stack([mass[..., w - 1] for w in WIDTHS], axis=-1))


@functools.partial(jax.jit, static_argnames=("drafter", "depth"))
def _measure(drafter, params, tokens, hidden, target_logits, rows, depth: int):
    draft = chain_logits(drafter, params, tokens, hidden, rows, depth)
    at = rows[:, None] + jnp.arange(depth)[None, :]  # [R, depth]: the node's position
    return node_records(draft, target_logits[0][at], tokens[0][at + 1])


def measure(drafter, params, tokens, hidden, target_logits, rows, depth: int = DEPTH) -> Records:
    """Records of `drafter` (a FeatureDrafter or ModelDrafter, from `factory.build_drafter`)
    for rows t = rows[r] of tokens [1, S]; every rows[r] + depth must be < S."""
    out = _measure(drafter, params, jnp.asarray(tokens), hidden, target_logits,
                   jnp.asarray(rows, jnp.int32), depth)
    return Records(*(np.asarray(a) for a in out))


def lookup_candidates(tokens: np.ndarray, rows, max_ngram: int = 3, min_ngram: int = 1):
    """For each row t: (distinct next tokens after earlier occurrences of the longest
    n-gram ending at x_t that has one (min_ngram <= n <= max_ngram), as `NgramDrafter`
    picks n; whether x_{t+1} is among them; whether the latest occurrence's next token,
    the lookup's proposal, is x_{t+1}). No match: (0, False, False)."""
    counts, any_hit, top1_hit = [], [], []
    for t in rows:
        follow = []
        for n in range(max_ngram, min_ngram - 1, -1):
            if t + 1 < n:
                continue
            gram = list(tokens[t - n + 1 : t + 1])
            follow = [tokens[e + 1] for e in range(n - 1, t) if list(tokens[e - n + 1 : e + 1]) == gram]
            if follow:
                break
        counts.append(len(set(follow)))
        any_hit.append(tokens[t + 1] in follow)
        top1_hit.append(bool(follow) and follow[-1] == tokens[t + 1])
    return np.array(counts), np.array(any_hit), np.array(top1_hit)


def matched(records: Records, truth: np.ndarray) -> np.ndarray:
    """[R, D] bool: the top-1 tokens of depths 1..d-1 were the target's (true at depth 1)."""
    ok = np.cumprod(records.top1 == truth, axis=1).astype(bool)
    return np.concatenate([np.ones_like(ok[:, :1]), ok[:, :-1]], axis=1)


def concat(parts: list[Records]) -> Records:
    return Records(*(np.concatenate(field) for field in zip(*parts)))


def _mean(x) -> float:
    return float(np.mean(x)) if np.size(x) else float("nan")


def summarize(records: Records, truth: np.ndarray, valid: np.ndarray) -> list[dict]:
    """One dict per depth over the rows where valid [R] (truth [R, D]: x_{t+1..t+D}):
    rows, matched (rows whose top-1 chain reached the depth), reach = matched / rows,
    top[k] {conditional (over matched rows), unconditional (over all rows)}, and over
    matched rows the mean iid[w] and fixed[w] (T = 1)."""
    reach = matched(records, truth) & valid[:, None]
    out = []
    for i in range(truth.shape[1]):
        cond, rank = reach[:, i], records.rank[:, i]
        out.append({
            "depth": i + 1, "rows": int(valid.sum()), "matched": int(cond.sum()),
            "reach": _mean(cond[valid]),
            "top": {k: {"conditional": _mean(rank[cond] < k), "unconditional": _mean(rank[valid] < k)}
                    for k in WIDTHS},
            "iid": {w: _mean(records.iid[cond, i, j]) for j, w in enumerate(WIDTHS)},
            "fixed": {w: _mean(records.fixed[cond, i, j]) for j, w in enumerate(WIDTHS)},
        })
    return out


def format_table(name: str, depths: list[dict]) -> str:
    """A markdown table of `summarize`'s dicts."""
    ks = [str(k) for k in WIDTHS]
    head = (["depth", "rows", "reached"] + [f"top{k} cond" for k in ks] + [f"top{k} all" for k in ks]
            + [f"T=1 iid{k}" for k in ks] + [f"T=1 top{k} mass" for k in ks if k != "1"])
    lines = [f"{name}", "", "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for d in depths:
        cells = [str(d["depth"]), str(d["rows"]), f"{d['matched']} ({d['reach']:.2f})"]
        cells += [f"{d['top'][k]['conditional']:.3f}" for k in WIDTHS]
        cells += [f"{d['top'][k]['unconditional']:.3f}" for k in WIDTHS]
        cells += [f"{d['iid'][w]:.3f}" for w in WIDTHS]
        cells += [f"{d['fixed'][w]:.3f}" for w in WIDTHS if w != 1]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
