"""Frozen, validated settings shared by the engine, the command line and the pipeline.

Settings that change the compiled program (K, sampling filters, lengths) are hashable
dataclasses, so they can be static arguments of `jax.jit`.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from specsamp.decoding.drafts import resolve
from specsamp.decoding.tree import DynamicTree, Tree
from specsamp.errors import UserError


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How logits become a distribution (see `specsamp.decoding.sampling.probs_from_logits`).

    temperature: 0 means greedy (argmax); otherwise logits are divided by it.
    top_k: keep the k most likely tokens; 0 disables the filter.
    top_p: nucleus; keep the smallest set of most likely tokens whose mass reaches top_p;
      1.0 disables the filter.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        t, k, p = self.temperature, self.top_k, self.top_p
        if not isinstance(t, (int, float)) or math.isnan(t) or t < 0 or math.isinf(t):
            raise UserError(f"temperature must be a finite number >= 0, got {t!r}")
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            raise UserError(f"top-k must be an integer >= 0 (0 disables it), got {k!r}")
        if not isinstance(p, (int, float)) or math.isnan(p) or not 0.0 < p <= 1.0:
            raise UserError(f"top-p must be in (0, 1], got {p!r}")
        object.__setattr__(self, "temperature", float(t))
        object.__setattr__(self, "top_p", float(p))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def check_k(k: int) -> int:
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise UserError(f"K (draft tokens per loop) must be an integer >= 1, got {k!r}")
    if k > 32:
        raise UserError(f"K must be at most 32, got {k}")
    return k


@dataclasses.dataclass(frozen=True)
class KChoice:
    """Draft tokens per round, the one form K takes inside decoding.

    ks: the K values rounds may run at (0: plain autoregressive rounds); one for a fixed K.
    auto: a K policy picks one of ks before each chunk of rounds (`kpolicy`, `--k auto`).
    wide: a hybrid drafter's wide rounds score this many lookup tokens in chunks of a
      smaller K (0: none).
    trees: token tree shapes the policy may pick beside the chains (`--tree auto`); a
      shape's rounds draft K = its depth.
    """

    ks: tuple[int, ...]
    auto: bool = False
    wide: int = 0
    trees: tuple[Tree, ...] = ()

    @property
    def largest(self) -> int:
        """The K the drafter is built for (every other K is `Drafter.with_k` of it)."""
        return max(self.ks + tuple(t.max_depth for t in self.trees))

    @property
    def shapes(self) -> tuple:
        """What a policy's index points into: the chains' K values, then the trees."""
        return self.ks + self.trees

    @property
    def span(self) -> int:
        """The most draft tokens one round of these shapes scores."""
        return max(self.ks + tuple(t.size for t in self.trees))

    @property
    def table(self) -> int:
        """The output tables' k column: -1 for auto, else the fixed K."""
        return -1 if self.auto else self.ks[0]

    def __str__(self) -> str:
        return "auto" if self.auto else str(self.ks[0])


def fixed_k(k: int) -> KChoice:
    return KChoice((k,))


# `--k auto`: the K values the policy switches between (one compiled round program each),
# and wide lookup rounds of 3 tokens on 3-token matches in chunks of a smaller K
# (`HybridDrafter.wide`; docs/measurements.md gives the replay behind these values). K = 3
# is the best fixed chain at T = 0.7 top-p 0.9 on this CPU (docs/throughput.md).
AUTO_K = KChoice((0, 1, 2, 3, 4), auto=True, wide=3)


# `--tree auto`: the tree shapes the policy weighs beside AUTO_K's chains (one compiled
# round program each). Small trees only: at most 6 nodes, so a round scores no more rows
# than a chain of K = 4 plus two, and at most 3 deep, below AUTO_K's deepest chain. Width
# goes where a chain most often fails, the first draft token (2x1, 3x1) or the first two
# (2x2), with a longer branch (2x1x1) for drafts that keep deep positions. Every shape but
# 2x2 is a tree of branches, which n-gram lookup drafts too (`NgramDrafter.check_tree`).
# A hybrid's wide rounds as under `--k auto`: without them `--tree auto` ran 3-5% below
# `--k auto` at batch 1 whatever it chose (docs/measurements.md).
AUTO_TREES = tuple(Tree.full(w) for w in ((2, 1), (2, 1, 1), (3, 1), (2, 2)))
TREE_AUTO = KChoice(AUTO_K.ks, auto=True, wide=AUTO_K.wide, trees=AUTO_TREES)


def tree_widths(tree: Tree) -> tuple[int, ...]:
    """A full tree's children per node at each depth (`Tree.full`'s argument; 1 for every
    depth of a chain)."""
    per_depth = np.bincount(tree.depth)[1:]
    return tuple(int(n // m) for n, m in zip(per_depth, np.concatenate([[1], per_depth[:-1]])))


def tree_text(tree: Tree | DynamicTree) -> str:
    """A tree as `parse_tree` reads it: a full tree's widths per depth, '2x1'; any other,
    its nodes' rank paths, '1-2-11'; a dynamic tree 'dyn' and its nodes, 'dyn4' (a bare
    '4' would read as a chain's K in statistics and cost curves)."""
    if isinstance(tree, DynamicTree):
        return f"dyn{tree.nodes}"
    widths = tree_widths(tree)
    if len(widths) > 1 and tree == Tree.full(widths):
        return "x".join(map(str, widths))
    # one level is its rank paths ('3' reads as a dynamic tree): '1-2-3'; one node '1-'
    return "-".join("".join(map(str, p)) for p in tree.rank_paths) + ("-" if tree.size == 1 else "")


def shape_key(shape) -> int | str:
    """A round shape (a chain's K or a Tree) as statistics and cost curves name it: the K,
    or the tree's widths ('2x1')."""
    return shape if isinstance(shape, int) else tree_text(shape)


def trees_for(drafter, trees: tuple[Tree, ...]) -> tuple[Tree, ...]:
    """The shapes of `trees` that `drafter` drafts (n-gram lookup: branches only); a
    UserError for a drafter that drafts no trees."""
    if not hasattr(drafter, "propose_tree"):
        raise UserError(no_tree_drafter(f"drafter {drafter.kind!r}") + " (--tree auto)")
    check = getattr(drafter, "check_tree", None)
    if check is None:
        return trees
    ok = []
    for tree in trees:
        try:
            check(tree)
            ok.append(tree)
        except UserError:
            pass
    return tuple(ok)


def parse_k(value) -> KChoice:
    """A user's K ('auto' or an integer 1..32) as a KChoice."""
    if isinstance(value, KChoice):
        return value
    return AUTO_K if value == "auto" else fixed_k(check_k(value))


# What the target's KV cache holds: "auto" (the run's dtype, `specsamp.loading.DTYPES`:
# float32 unless the model runs in bfloat16), float32, float16 (half the memory; at batch
# 32 the cache attention is bound by reading it, `docs/throughput.md`) or bfloat16. Keys
# and values are rounded to the cache's type when written; every sample depends on it as
# on the weights, and speculative and plain sampling with the same cache give the same
# outputs. The native attention kernel reads float32 and float16 caches; a bfloat16 cache
# runs XLA's attention (`specsamp.models.model.cache_attention`).
KV_CACHES = ("auto", "float32", "float16", "bfloat16")


def check_kv_cache(kv_cache: str) -> str:
    if kv_cache not in KV_CACHES:
        raise UserError(f"kv cache must be one of {', '.join(KV_CACHES)}, got {kv_cache!r}")
    return kv_cache


def resolve_kv_cache(kv_cache: str, dtype: str) -> str:
    """The cache's type for a model run at `dtype` (a resolved `loading.DTYPES` entry)."""
    return dtype if check_kv_cache(kv_cache) == "auto" else kv_cache


def check_max_new_tokens(n: int) -> int:
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise UserError(f"max-new-tokens must be an integer >= 1, got {n!r}")
    return n


# A token tree per round (`--tree`): 'off' (chains of K, the paper's form) or the widths
# per depth, 'W1xW2x...' (`tree.Tree.full`): 3x1x1 is three children of the root, each the
# start of a chain of two more. Its depth is the round's K. A number N: a dynamic tree of
# N nodes per row (`tree.DynamicTree`), at most MAX_DYNAMIC_NODES.
MAX_TREE_NODES = 64
MAX_DYNAMIC_NODES = 32


def parse_tree(value) -> Tree | DynamicTree | None:
    """A user's tree as a Tree, or None for chains: 'off'; 'W1xW2x...', the widths per
    depth (each >= 1) of two depths or more; or its nodes, each the ranks of the drafter's
    choices on its path from the root, joined by '-' ('1-2-11': the top two choices, and
    the top choice after the first; ranks 1-9; a single level '1-2-3'). At most
    MAX_TREE_NODES nodes and 32 deep. A number N (or 'dynN'): the DynamicTree of N nodes
    (each row scores the N nodes its draft finds likeliest)."""
    if value is None or isinstance(value, (Tree, DynamicTree)):
        return value
    if value == "off":
        return None
    if isinstance(value, str) and value.startswith("dyn"):
        value = value[3:]
    if isinstance(value, int) and not isinstance(value, bool) or isinstance(value, str) and value.isdigit():
        nodes = int(value)
        if not 1 <= nodes <= MAX_DYNAMIC_NODES:
            raise UserError(f"a dynamic tree (--tree N) has 1 to {MAX_DYNAMIC_NODES} nodes, got {value!r}")
        return DynamicTree.of(nodes)
    if isinstance(value, str) and "-" in value:
        return _tree_from_paths(value)
    parts = value.split("x") if isinstance(value, str) else []
    if not parts or not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise UserError(f"tree must be 'off' or widths per depth like 3x1x1 (each >= 1), rank paths "
                        f"like 1-2-11 or a number of nodes N, got {value!r}")
    widths = tuple(int(p) for p in parts)
    if len(widths) > 32:
        raise UserError(f"a tree may be at most 32 deep, got {len(widths)}")
    size = sum(math.prod(widths[: d + 1]) for d in range(len(widths)))
    if size > MAX_TREE_NODES:
        raise UserError(f"tree {value} has {size} nodes; at most {MAX_TREE_NODES}")
    return Tree.full(widths)


def _tree_from_paths(value: str) -> Tree:
    """'1-2-11' as a Tree (`parse_tree`)."""
    nodes = value[:-1].split("-") if value.endswith("-") else value.split("-")  # '1-': one node
    if not all(n and n.isdigit() and "0" not in n for n in nodes):
        raise UserError(f"tree nodes must be rank paths of digits 1-9 joined by '-', like 1-2-11, got {value!r}")
    if len(nodes) > MAX_TREE_NODES or max(map(len, nodes)) > 32:
        raise UserError(f"tree {value} has {len(nodes)} nodes, {max(map(len, nodes))} deep; "
                        f"at most {MAX_TREE_NODES} nodes, 32 deep")
    if len(set(nodes)) != len(nodes):
        raise UserError(f"tree {value} lists a node twice")
    try:
        return Tree.from_paths(tuple(int(c) for c in n) for n in nodes)
    except ValueError as e:
        raise UserError(f"tree {value}: {e}") from None


# The `parse_draft` kinds whose drafters draft token trees (`propose_tree`): every kind
# but the baseline. N-gram lookup, and so a hybrid, drafts branches only
# (`NgramDrafter.check_tree`).
TREE_DRAFTS = ("model", "early-exit", "ngram", "hybrid")
BRANCH_DRAFTS = ("ngram", "hybrid")


def no_tree_drafter(what: str) -> str:
    """The message for a token tree asked of `what` (a drafter that drafts no trees)."""
    return (f"token trees need a drafter that drafts trees (a draft model, early exit, feature "
            f"draft, ngram or ngram+<draft>); {what} does not")


DRAFT_FORMS = "'auto', 'none', 'ngram[:N]', 'early-exit:L', a path, a shipped draft name, or 'ngram+<draft>'"


def parse_draft(draft: str) -> tuple[str, object]:
    """'auto' (the best known drafter for the target) | 'none' | 'ngram[:N]' | 'early-exit:L' | path | shipped name | 'ngram[:N]+<path or name>'
    -> (kind, argument); the hybrid's argument is (N, path). A shipped draft's name comes
    back as its folder (`specsamp.decoding.drafts.resolve`): callers see paths only."""
    if not isinstance(draft, str) or not draft:
        raise UserError(f"draft must be {DRAFT_FORMS}, got {draft!r}")
    if draft in ("none", "auto"):
        return draft, None
    if draft.startswith("ngram") and "+" in draft:
        lookup, _, model = draft.partition("+")
        kind, n = parse_draft(lookup)
        if kind != "ngram" or not model or parse_draft(model)[0] != "model":
            raise UserError(f"a hybrid drafter is 'ngram[:N]+<feature draft path or name>', got {draft!r}")
        return "hybrid", (n, resolve(model))
    if draft == "ngram" or draft.startswith("ngram:"):
        n = draft.partition(":")[2] or "3"
        if not n.isdigit() or not 1 <= int(n) <= 8:
            raise UserError(f"ngram size must be 1..8, got {draft!r}")
        return "ngram", int(n)
    if draft.startswith("early-exit"):
        layers = draft.partition(":")[2]
        if not layers.isdigit() or int(layers) < 1:
            raise UserError(f"early exit needs a layer count, e.g. early-exit:2, got {draft!r}")
        return "early-exit", int(layers)
    return "model", resolve(draft)


def seed_for(base_seed: int, prompt_id: str) -> int:
    """A sample's seed from the run's seed and the prompt id: reproducible wherever and in
    whatever batch the prompt runs."""
    import hashlib

    digest = hashlib.sha256(f"{base_seed}:{prompt_id}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


