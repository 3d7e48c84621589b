"""A pipeline run's settings: a frozen dataclass loaded from YAML and checked up front.

YAML is only the input format: every key is known, every value is type-checked, and any
mistake is one `UserError` before a model is loaded or a worker starts. A config may list
several generation settings (e.g. the autoregressive baseline plus K = 1..8); the pipeline
runs each of them over every prompt, and each output row says which setting made it.

`config_hash()` covers what changes a sample (models, settings, sampling, lengths, seed,
chat template, stop strings), not where prompts come from or go to, so a re-run into the
same output with a larger `limit` resumes instead of being refused.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

from specsamp.decoding.config import (
    AUTO_K, BRANCH_DRAFTS, DRAFT_FORMS, TREE_AUTO, TREE_DRAFTS, SamplingParams, no_tree_drafter, parse_draft, parse_k, parse_tree,
    tree_text,
)
from specsamp.decoding.tree import DynamicTree
from specsamp.errors import UserError

BUILTIN_INPUTS = ("humaneval", "xsum")  # `input: builtin:NAME` is prepared on the fly


RUNNERS = ("local", "dask", "dataflow")  # `runner:` in a config (pipelines.runners)

K_AUTO = AUTO_K.table  # a setting's k for `k: auto` (an int, so that output tables keep an int column)


def k_label(k: int) -> str:
    """A k as people read it: `auto` for K_AUTO (the output tables' -1), else the number."""
    return "auto" if k == K_AUTO else str(k)


@dataclasses.dataclass(frozen=True)
class Setting:
    """One generation setting: a drafter and its K (`draft: none` is the baseline), or a
    drafter and a token tree (`tree: 2x1`; k is then the tree's depth), or `tree: auto`
    (k auto: the K policy weighs small trees beside the chains, `config.AUTO_TREES`)."""

    draft: str = "none"
    k: int = 0  # K_AUTO (-1): `k: auto`, the batch-aware policy (also in output tables' k column)
    tree: str = "off"  # 'off' (chains of k), widths per depth (`decoding.config.parse_tree`) or 'auto'

    @property
    def mode(self) -> str:
        return "autoregressive" if self.draft == "none" else "speculative"

    @property
    def key(self) -> str:
        """Identifies the setting in output rows (with the prompt id: the resume key); only
        a tree setting's key names its tree."""
        chain = f"{self.draft}|{k_label(self.k)}"
        return chain if self.tree == "off" else f"{chain}|{self.tree}"

    @property
    def label(self) -> str:
        if self.draft == "none":
            return "baseline"
        return f"{self.draft} K={k_label(self.k)}" if self.tree == "off" else f"{self.draft} tree={self.tree}"

    @property
    def span(self) -> int:
        """The most draft tokens one round scores: the tree's nodes, else K (0: none)."""
        if self.tree == "auto":
            return TREE_AUTO.span
        tree = parse_tree(self.tree)
        return tree.span if tree is not None else max(self.k, 0)


@dataclasses.dataclass(frozen=True)
class Workers:
    """How models sit on a worker (see Beam's ModelHandler `large_model`/`model_copies`).

    share_model_across_processes: one copy per machine, used by all SDK processes through
      a proxy. Needed on TPU hosts (only one process may open the chip) and for models
      that do not fit once per process; off by default (CPU: one copy per process).
    model_copies: with sharing, how many copies per machine (e.g. one per accelerator).
    """

    share_model_across_processes: bool = False
    model_copies: int | None = None


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Everything a run needs; see configs/*.yaml for commented examples."""

    name: str
    input: str
    output: str
    settings: tuple[Setting, ...]
    target: str | None = None
    sampling: SamplingParams = SamplingParams()
    max_new_tokens: int = 128
    chat: bool = True
    system: str | None = None
    stop: tuple[str, ...] = ()
    seed: int = 0
    batch_size: int = 1
    limit: int | None = None
    dataset: str | None = None
    workers: Workers = Workers()
    weights: str = "stored"  # stored | stored-a8 | float32 | int8 (specsamp.loading.WEIGHTS)
    tensor_parallel: int = 1  # split the target over each worker's first N devices
    kv_cache: str = "auto"  # auto (the dtype's) | float32 | float16 | bfloat16: the target's KV cache
    dtype: str = "auto"  # auto | float32 | bfloat16 (specsamp.loading.DTYPES): weights and activations
    verify: str = "block"  # block | token: how sampled chains test their drafts (both exact)
    runner: str | None = None  # local | dask | dataflow when --runner is not given (not in the hash)

    @property
    def target_name(self) -> str:
        return self.target or "smollm2"

    @property
    def builtin_input(self) -> str | None:
        return self.input.split(":", 1)[1] if self.input.startswith("builtin:") else None

    def config_hash(self) -> str:
        """sha256 (first 16 hex) of the settings that change a sample."""
        keys = ("settings", "target", "sampling", "max_new_tokens", "chat", "system", "stop", "seed",
                "weights", "kv_cache")
        full = dataclasses.asdict(self)
        body = {k: full[k] for k in keys}
        # A chain setting hashes without its tree (chain configs keep their hashes); a tree
        # joins where it is set.
        body["settings"] = [{k: v for k, v in s.items() if k != "tree" or v != "off"}
                            for s in body["settings"]]
        body["target"] = self.target_name
        # Configs from before `dtype` keep their hash: the defaults hash as they did then
        # (a float32 cache), and dtype joins only when set.
        if self.kv_cache == "auto":
            body["kv_cache"] = "float32" if self.dtype == "auto" else self.dtype
        if self.dtype != "auto":
            body["dtype"] = self.dtype
        # Likewise the per-token rule joins only when asked for (block verification is the
        # default; both sample the target exactly, with different draws for a seed).
        if self.verify != "block":
            body["verify"] = self.verify
        blob = json.dumps(body, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def with_overrides(self, **changes) -> "RunConfig":
        """A copy with command-line overrides (None values ignored), re-validated."""
        changes = {k: v for k, v in changes.items() if v is not None}
        return _validated(dataclasses.replace(self, **changes)) if changes else self


def add_override_arguments(parser) -> None:
    """The flags that override a config's input, output and limit, and --retry-errors
    (`specsamp run`)."""
    parser.add_argument("--config", required=True, help="run config (YAML), e.g. configs/humaneval.yaml")
    parser.add_argument("--input", help="prompt Parquet file or glob (local or gs://); overrides the config")
    parser.add_argument("--output", help="output folder (local or gs://); overrides the config")
    parser.add_argument("--limit", type=int, help="only the first N prompts; overrides the config")
    parser.add_argument("--retry-errors", nargs="?", const="all", default=None, metavar="KIND,...",
                        help="attempt the output's error rows again (all kinds, or the kinds named, "
                             "e.g. generation_failed); a retried row that succeeds supersedes its error row")


def load(path: str, **overrides) -> RunConfig:
    """Read and validate a YAML run config, with command-line overrides (None = not given)
    applied first, so a config may leave out what the command line supplies."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml.safe_load(f)
    except FileNotFoundError:
        raise UserError(f"config file not found: {path}") from None
    except yaml.YAMLError as e:
        raise UserError(f"config {path} is not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise UserError(f"config {path} must be a mapping of keys to values")
    raw.update({k: v for k, v in overrides.items() if v is not None})
    return from_dict(raw, where=path)


def from_dict(raw: dict, where: str = "config") -> RunConfig:
    """Build a RunConfig from plain data (as parsed from YAML), checking every key."""
    raw = dict(raw)
    fields = {f.name for f in dataclasses.fields(RunConfig)}
    unknown = sorted(set(raw) - fields)
    if unknown:
        raise UserError(f"{where}: unknown key(s) {unknown}; known keys: {sorted(fields)}")
    for required in ("input", "output", "settings"):
        if required not in raw:
            raise UserError(f"{where}: missing required key '{required}'")
    raw.setdefault("name", os.path.splitext(os.path.basename(where))[0])
    raw["settings"] = _parse_settings(raw["settings"], where)
    raw["sampling"] = _parse_sampling(raw.get("sampling") or {}, where)
    raw["workers"] = _parse_workers(raw.get("workers") or {}, where)
    stop = raw.get("stop") or ()
    raw["stop"] = tuple(stop) if isinstance(stop, (list, tuple)) else stop
    return _validated(RunConfig(**raw), where)


def _parse_settings(items, where: str) -> tuple[Setting, ...]:
    """`- {draft: ngram, k: [1, 2, 4]}` expands to one setting per K, `tree: [off, 2x1]` to
    one per tree (the chains at each K; a tree at its depth, which a given k must equal)."""
    if not isinstance(items, list) or not items:
        raise UserError(f"{where}: 'settings' must be a non-empty list of {{draft, k, tree}}")
    out = []
    for item in items:
        if not isinstance(item, dict) or set(item) - {"draft", "k", "tree"}:
            raise UserError(f"{where}: each setting is a mapping with 'draft', 'k' and 'tree', got {item!r}")
        draft = item.get("draft", "none")
        ks = item.get("k", 0 if draft == "none" else 4)
        trees = item.get("tree", "off")
        for tree in trees if isinstance(trees, list) else [trees]:
            tree = _tree_text(tree)
            if tree == "off":
                out += [_check_setting(draft, k, where) for k in (ks if isinstance(ks, list) else [ks])]
            else:
                out.append(_check_tree_setting(draft, tree, item.get("k"), where))
    if len(set(out)) != len(out):
        raise UserError(f"{where}: a setting is listed twice: {[s.label for s in out]}")
    return tuple(out)


def _tree_text(value):
    """A YAML tree value as `parse_tree` reads it: YAML reads `off` as false and `2` as 2."""
    if value is False:
        return "off"
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else value


def _check_setting(draft, k, where: str) -> Setting:
    if not isinstance(draft, str) or not draft:
        raise UserError(f"{where}: draft must be {DRAFT_FORMS}, got {draft!r}")
    if draft == "none":
        if k not in (0, None):
            raise UserError(f"{where}: the baseline (draft: none) takes no K, got k={k!r}")
        return Setting("none", 0)
    try:
        kind, arg = parse_draft(draft)
        setting = Setting(draft, parse_k(k).table)
    except UserError as e:
        raise UserError(f"{where}: {e}") from None
    if kind in ("model", "hybrid"):
        _check_path(arg if kind == "model" else arg[1], "draft", where)
    return setting


def _check_tree_setting(draft, tree: str, k, where: str) -> Setting:
    """A tree setting: K is the tree's depth; a k given must be that depth (never auto).
    `tree: auto`: k is auto (left out or given as auto)."""
    if draft == "none":
        raise UserError(f"{where}: the baseline (draft: none) takes no tree, got tree={tree!r}")
    if tree == "auto":
        if any(given not in (None, "auto") for given in (k if isinstance(k, list) else [k])):
            raise UserError(f"{where}: tree auto picks K itself (k auto): leave k out or give "
                            f"k: auto (draft {draft}), got k={k!r}")
        return dataclasses.replace(_check_setting(draft, "auto", where), tree="auto")
    try:
        parsed = parse_tree(tree)
    except UserError as e:
        raise UserError(f"{where}: {e}") from None
    depth = parsed.max_depth
    tree = tree_text(parsed)  # one spelling per tree: 2x01 is 2x1
    for given in k if isinstance(k, list) else [k]:
        if given == "auto":
            raise UserError(f"{where}: tree and k auto do not combine yet: give a tree or k auto "
                            f"(draft {draft}, tree {tree})")
        if given is not None and given != depth:
            raise UserError(f"{where}: tree {tree} drafts K = its depth {depth}, got k={given!r}; "
                            f"leave k out (list the tree as a setting of its own beside chains "
                            f"of other K) or give k: {depth}")
    return dataclasses.replace(_check_setting(draft, depth, where), tree=tree)


def _check_tree_drafter(setting: Setting, target: str | None, where: str) -> None:
    """A UserError unless the setting's drafter (draft `auto` as resolved for `target`)
    drafts its tree, as the generator would find when it loads."""
    from specsamp.decoding.drafts import default_draft

    draft = default_draft(target) if setting.draft == "auto" else setting.draft
    kind, _ = parse_draft(draft)
    shown = setting.draft if draft == setting.draft else f"{setting.draft} ({draft})"
    if kind not in TREE_DRAFTS:
        raise UserError(f"{where}: tree {setting.tree}: {no_tree_drafter(f'drafter {shown}')}")
    tree = None if setting.tree == "auto" else parse_tree(setting.tree)  # auto: branches only
    if kind in BRANCH_DRAFTS and tree is not None and not (kind == "hybrid" and isinstance(tree, DynamicTree)):
        from specsamp.decoding.lookup import NgramDrafter

        try:
            NgramDrafter.check_tree(tree)
        except UserError as e:
            raise UserError(f"{where}: tree {setting.tree} with drafter {shown}: {e}") from None


def _check_path(path: str, what: str, where: str) -> None:
    """Local paths must exist now; gs:// paths are checked when the run starts."""
    if "://" not in path and not os.path.exists(os.path.expanduser(path)):
        raise UserError(f"{where}: {what} path does not exist: {path}")


def _parse_sampling(raw, where: str) -> SamplingParams:
    if not isinstance(raw, dict) or set(raw) - {"temperature", "top_k", "top_p"}:
        raise UserError(f"{where}: 'sampling' takes temperature, top_k, top_p; got {raw!r}")
    try:
        return SamplingParams(**raw)
    except UserError as e:
        raise UserError(f"{where}: {e}") from None


def _parse_workers(raw, where: str) -> Workers:
    known = {f.name for f in dataclasses.fields(Workers)}
    if not isinstance(raw, dict) or set(raw) - known:
        raise UserError(f"{where}: 'workers' takes {sorted(known)}; got {raw!r}")
    return Workers(**raw)


def _validated(cfg: RunConfig, where: str = "config") -> RunConfig:
    """Type and range checks on the assembled config; returns it unchanged."""
    def fail(msg):
        raise UserError(f"{where}: {msg}")

    for name in ("name", "input", "output"):
        if not isinstance(getattr(cfg, name), str) or not getattr(cfg, name):
            fail(f"'{name}' must be a non-empty string")
    if cfg.builtin_input is not None and cfg.builtin_input not in BUILTIN_INPUTS:
        fail(f"unknown builtin input {cfg.input!r}; known: {['builtin:' + b for b in BUILTIN_INPUTS]}")
    if cfg.target not in (None, "smollm2"):
        if not isinstance(cfg.target, str):
            fail(f"'target' must be a path or 'smollm2', got {cfg.target!r}")
        _check_path(cfg.target, "target", where)
    for s in cfg.settings:
        if s.tree != "off":
            _check_tree_drafter(s, cfg.target, where)
    _check_int(cfg.max_new_tokens, "max_new_tokens", 1, fail)
    _check_int(cfg.batch_size, "batch_size", 1, fail)
    _check_int(cfg.tensor_parallel, "tensor_parallel", 1, fail)
    _check_int(cfg.seed, "seed", 0, fail)
    if cfg.limit is not None:
        _check_int(cfg.limit, "limit", 1, fail)
    if not isinstance(cfg.chat, bool):
        fail(f"'chat' must be true or false, got {cfg.chat!r}")
    if not isinstance(cfg.stop, tuple) or not all(isinstance(s, str) and s for s in cfg.stop):
        fail(f"'stop' must be a list of non-empty strings, got {cfg.stop!r}")
    if cfg.system is not None and not isinstance(cfg.system, str):
        fail(f"'system' must be a string (a system prompt for the chat template), got {cfg.system!r}")
    if cfg.dataset is not None and (not isinstance(cfg.dataset, str) or not cfg.dataset):
        fail(f"'dataset' must be a non-empty string, got {cfg.dataset!r}")
    from specsamp.loading import WEIGHTS

    if cfg.weights not in WEIGHTS:
        fail(f"'weights' must be one of {', '.join(WEIGHTS)}, got {cfg.weights!r}")
    if cfg.weights == "stored-a8" and cfg.tensor_parallel > 1:
        fail("'weights: stored-a8' runs on one CPU's native kernels, not split over devices: "
             "use weights: stored with tensor_parallel")
    from specsamp.decoding.config import KV_CACHES

    if cfg.kv_cache not in KV_CACHES:
        fail(f"'kv_cache' must be one of {', '.join(KV_CACHES)}, got {cfg.kv_cache!r}")
    if cfg.runner not in (None,) + RUNNERS:
        fail(f"'runner' must be one of {', '.join(RUNNERS)} (or left out: --runner decides), got {cfg.runner!r}")
    from specsamp.loading import DTYPES

    if cfg.dtype not in DTYPES:
        fail(f"'dtype' must be one of {', '.join(DTYPES)}, got {cfg.dtype!r}")
    if cfg.verify not in ("block", "token"):
        fail(f"'verify' must be block or token, got {cfg.verify!r}")
    w = cfg.workers
    if not isinstance(w.share_model_across_processes, bool):
        fail("workers.share_model_across_processes must be true or false")
    if w.model_copies is not None:
        _check_int(w.model_copies, "workers.model_copies", 1, fail)
    return cfg


def _check_int(value, name: str, minimum: int, fail) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        fail(f"'{name}' must be an integer >= {minimum}, got {value!r}")
