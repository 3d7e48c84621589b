"""A plain-Python reference of exact tree acceptance, written apart from the JAX code.

It knows the rule only as the docs state it (docs/paper.md, "Token trees") and shares no
code with `specsamp.decoding`: its own residual, its own tree bookkeeping, float64
throughout. It gives
  - `emitted`: the exact distribution of one round's emitted tokens (accepted path, then
    the next token), by enumerating every draw of every node's children and every
    accept/reject branch, with probabilities, not samples;
  - `extended`: that distribution continued by plain target sampling to a fixed length,
    which must equal the target's own distribution of that many tokens (`target`);
  - `walk`: one round with the uniforms given, for comparing the JAX rule case by case.

A world is a synthetic drafter and target over V tokens: `p(ctx)`, `q(ctx)` give the
distributions after the context ctx (a tuple of tokens after the root).
Two controls, rules that are not exact and that the checks must catch: variant "stale",
the target distribution not updated after a rejected sibling (each child is tested
against q itself); variant "topk_as_sampled", FIXED children (the draft's top tokens,
taken deterministically) tested as if they had been drawn without replacement from p.
"""

from __future__ import annotations

import itertools
from collections import defaultdict

import numpy as np

MODES = ("iid", "distinct", "fixed")


class World:
    """Random draft and target distributions for every context of up to `depth` tokens over
    V tokens, of one kind: "random", "zeros" (both with zeros), "point" (p a point mass),
    "same" (p = q), "greedy" (q a point mass), or "mixed" (each context picks one)."""

    KINDS = ("random", "zeros", "point", "same", "greedy")

    def __init__(self, kind, v=3, depth=3, seed=0):
        rng = np.random.default_rng([seed, v, depth, (self.KINDS + ("mixed",)).index(kind)])
        self.v, self.kind, self._p, self._q = v, kind, {}, {}
        for n in range(depth + 1):
            for ctx in itertools.product(range(v), repeat=n):
                pick = self.KINDS[rng.integers(len(self.KINDS))] if kind == "mixed" else kind
                self._p[ctx], self._q[ctx] = self._pair(rng, pick)

    def _pair(self, rng, kind):
        def dist(zeros=0):
            x = rng.gamma(0.7, size=self.v)
            x[rng.choice(self.v, zeros, replace=False)] = 0.0
            return [float(y) for y in x / x.sum()]

        if kind == "zeros":
            return dist(rng.integers(1, self.v)), dist(rng.integers(1, self.v))
        if kind == "point":
            return [float(y) for y in np.eye(self.v)[rng.integers(self.v)]], dist(rng.integers(0, 2))
        if kind == "same":
            q = dist()
            return list(q), q
        if kind == "greedy":
            return dist(), [float(y) for y in np.eye(self.v)[rng.integers(self.v)]]
        return dist(), dist()

    def p(self, ctx):
        return self._p[tuple(ctx)]

    def q(self, ctx):
        return self._q[tuple(ctx)]


def shapes(depth=3, width=3):
    """Every ordered tree of at most `depth` levels below the root and at most `width` nodes
    on a level (so at most `width` children a node), as parents tuples numbered level by
    level. Each level's nodes are spread over the level above in every way (in order)."""
    out = []

    def grow(parents, level, d):
        out.append(tuple(parents))
        if d == depth:
            return
        for count in range(1, width + 1):
            for spread in _spreads(count, len(level)):
                new = [level[j] for j, c in enumerate(spread) for _ in range(c)]
                first = len(parents)
                grow(parents + new, list(range(first, first + count)), d + 1)

    for count in range(1, width + 1):
        grow([-1] * count, list(range(count)), 1)
    return out


def _spreads(count, slots):
    """Every way to put `count` children under `slots` parents: tuples of counts."""
    if slots == 1:
        yield (count,)
        return
    for first in range(count + 1):
        for rest in _spreads(count - first, slots - 1):
            yield (first,) + rest


def kids_of(parents) -> dict[int, list[int]]:
    """Node -> its children in order; -1 is the root."""
    kids: dict[int, list[int]] = defaultdict(list)
    for i, parent in enumerate(parents):
        kids[parent].append(i)
    return kids


def residual(q, d):
    """(q - d)+ normalised; q itself where that is all zero (then a rejection has chance 0)."""
    diff = [max(a - b, 0.0) for a, b in zip(q, d)]
    total = sum(diff)
    return [x / total for x in diff] if total > 0 else list(q)


def fixed_children(p, m):
    """The drafter of FIXED children: the m most likely draft tokens, ties by token id."""
    return sorted(range(len(p)), key=lambda x: (-p[x], x))[:m]


def draft_dists(tokens, p, mode):
    """The distribution each child was drawn from given the ones before it (None: absent)."""
    out, left = [], list(p)
    for x in tokens:
        if x is None:
            out.append(None)
            continue
        if mode == "iid":
            d = list(p)
        elif mode == "fixed":
            d = [float(y == x) for y in range(len(p))]
        else:
            total = sum(left)
            d = [y / total for y in left] if total > 0 else [0.0] * len(p)
        if d[x] == 0:  # cannot have been drawn: absent
            out.append(None)
            continue
        out.append(d)
        if mode == "distinct":
            left[x] = 0.0
    return out


def tests(tokens, p, q, mode, variant="exact"):
    """The tests at one node given its children's tokens: (a_j, the chance child j is kept
    if it is reached, None for an absent child), and the distribution the next token is
    drawn from when every child is refused."""
    chances, cur = [], list(q)
    for x, d in zip(tokens, draft_dists(tokens, p, mode)):
        if d is None:
            chances.append(None)
            continue
        against = list(q) if variant == "stale" else cur
        chances.append(min(1.0, against[x] / d[x]))
        cur = residual(against, d)
    return chances, cur


def draws(p, m, mode):
    """Every draw of m children's tokens with its probability (None: an absent child)."""
    v = len(p)
    if mode == "fixed":
        yield fixed_children(p, m), 1.0
    elif mode == "iid":
        for xs in itertools.product(range(v), repeat=m):
            w = 1.0
            for x in xs:
                w *= p[x]
            if w > 0:
                yield list(xs), w
    else:
        yield from _without_replacement(list(p), m)


def _without_replacement(left, m):
    if m == 0:
        yield [], 1.0
        return
    total = sum(left)
    if total == 0:  # support used up: the remaining children are absent
        yield [None] * m, 1.0
        return
    for x, w in enumerate(left):
        if w > 0:
            rest = list(left)
            rest[x] = 0.0
            for xs, w2 in _without_replacement(rest, m - 1):
                yield [x] + xs, w / total * w2


def signature(parents, u=-1):
    """The shape below node u as nested tuples (children in order): equal signatures give
    equal output distributions in the same context, so the enumeration is shared."""
    kids = kids_of(parents)

    def sig(v):
        return tuple(sig(c) for c in kids[v])

    return sig(u)


class Enumerator:
    """Exact output distributions for one world and mode, over any number of tree shapes
    (subtrees met before in the same context are not enumerated again)."""

    def __init__(self, world, mode, variant="exact"):
        self.world, self.mode, self.variant, self.memo = world, mode, variant, {}

    def emitted(self, parents):
        """Exact distribution of one round's output: {tuple of emitted tokens: probability}."""
        return dict(self._from(signature(parents), ()))

    def _from(self, sig, ctx):
        if (sig, ctx) in self.memo:
            return self.memo[(sig, ctx)]
        p, q = self.world.p(ctx), self.world.q(ctx)
        kept = defaultdict(float)  # (child position, token) -> probability
        last = [0.0] * len(q)  # probability of every child refused and then token y
        tested_as = "distinct" if self.variant == "topk_as_sampled" else self.mode
        for tokens, w in draws(p, len(sig), self.mode):
            chances, final = tests(tokens, p, q, tested_as, self.variant)
            for j, (x, a) in enumerate(zip(tokens, chances)):
                if a is not None:
                    kept[(j, x)] += w * a
                    w *= 1 - a
            for y, f in enumerate(final):
                last[y] += w * f
        out = defaultdict(float)
        for (j, x), w in kept.items():
            for seq, w2 in self._from(sig[j], ctx + (x,)).items():
                out[(x,) + seq] += w * w2
        for y, w in enumerate(last):
            if w > 0:
                out[(y,)] += w
        self.memo[(sig, ctx)] = out
        return out


def extended(dist, world, length):
    """Each emitted sequence continued by sampling the target to `length` tokens."""
    out = defaultdict(float)
    stack = list(dist.items())
    while stack:
        seq, w = stack.pop()
        if len(seq) >= length:
            out[seq[:length]] += w
            continue
        for y, qy in enumerate(world.q(seq)):
            if qy > 0:
                stack.append((seq + (y,), w * qy))
    return dict(out)


def target(world, length):
    """The target's own distribution of its first `length` tokens."""
    return extended({(): 1.0}, world, length)


def walk(parents, tokens, p_rows, q_rows, r, mode):
    """One round with uniforms r (per node): keep child c when r[c] < a_c. Rows as the JAX
    rule's: row 0 the root, row i + 1 node i; tokens[i] None or -1 for absent. Returns
    (the last accepted node or -1, the distribution the next token is drawn from)."""
    kids = kids_of(parents)
    u = -1
    while True:
        mine = kids[u]
        toks = [None if tokens[c] is None or tokens[c] < 0 else int(tokens[c]) for c in mine]
        chances, final = tests(toks, list(p_rows[u + 1]), list(q_rows[u + 1]), mode)
        nxt = next((c for c, a in zip(mine, chances) if a is not None and r[c] < a), None)
        if nxt is None:
            return u, final
        u = nxt
