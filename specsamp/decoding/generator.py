"""Text in, completions out: the API the command line and the Beam handler use.

    gen = load_generator(GeneratorSpec(draft="ngram", k=4, chat=True))
    [c] = gen.generate(["Write a function that reverses a string."], seeds=[0])
"""

from __future__ import annotations

import dataclasses
import math
import platform
import threading
from typing import Callable, Sequence

import jax

from specsamp.decoding.acceptance import check_verify
from specsamp.decoding.config import (
    TREE_AUTO, KChoice, SamplingParams, check_kv_cache, check_max_new_tokens, fixed_k,
    parse_draft, parse_k, parse_tree, resolve_kv_cache, seed_for, tree_text, trees_for,
)
from specsamp.decoding.costs import measure_cost_ratio
from specsamp.decoding.decode import Program
from specsamp.decoding.engine import Continuous, Engine, Static
from specsamp.decoding.factory import build_drafter, file_loader, resolve_auto
from specsamp.decoding.kpolicy import auto_policy
from specsamp.decoding.results import Completion
from specsamp.decoding.tree import Tree
from specsamp.errors import UserError
from specsamp.mesh import check_tensor_parallel, make_mesh
from specsamp.models import Model


@dataclasses.dataclass(frozen=True)
class GeneratorSpec:
    """target: None or 'smollm2' (the embedded default), or a local / gs:// path to a .gguf
    file or a Hugging Face folder. draft: 'none' (plain autoregressive sampling, the
    baseline), 'ngram' (prompt lookup, 'ngram:N' for n-grams up to N), 'early-exit:L' (the
    target's first L layers), a path to a draft model sharing the target's vocabulary or to
    a feature draft (or a shipped draft's name, `specsamp.decoding.drafts`), 'ngram+<feature draft>'
    (lookup where it matches, the draft elsewhere), or 'auto' (`drafts.default_draft`).
    weights: 'stored' (the file's own quantized blocks), 'stored-a8' (the same blocks with
    8-bit activations, native kernels only), 'float32' or 'int8' (see `specsamp.loading`),
    for the target and a separate draft model alike. dtype: the float weights' and
    activations' type, 'float32', 'bfloat16' or 'auto' (`specsamp.loading.
    DTYPES`: float32 on a CPU); a draft model runs at the target's. kv_cache: what the
    target's KV cache holds, 'auto' (the run's dtype), 'float32', 'float16' (half the
    memory, faster attention at large batches; keys and values rounded to half, a slightly
    different model) or 'bfloat16'.
    tensor_parallel: split the target over this many of the worker's devices
    (`specsamp.models.sharding`); the draft runs on the same devices, replicated (an
    early-exit draft shares the target's split weights)."""

    target: str | None = None
    draft: str = "none"
    k: int | str = 4  # 1..32, or 'auto' (the batch-aware policy, `kpolicy`)
    sampling: SamplingParams = SamplingParams()
    max_new_tokens: int = 256
    chat: bool = False
    system: str | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    batch_size: int = 1
    weights: str = "stored"
    # 'continuous': the batch_size slots are refilled as rows finish (`specsamp.decoding.batching`),
    # so one generate call keeps them busy over all its prompts; k 'auto' implies it.
    batching: str = "static"
    tensor_parallel: int = 1
    kv_cache: str = "auto"
    dtype: str = "auto"
    # 'off' (chains of k) or a token tree's widths per depth, 'W1xW2x...', rank paths or N
    # nodes chosen per row ('dynN') (`config.parse_tree`, kept as `config.tree_text` spells it):
    # every drafted round drafts and scores that tree, K = its depth (k is then not read);
    # or 'auto': the K policy picks a chain's K or one of `config.AUTO_TREES` per chunk
    # (k is then auto; n-gram lookup and a hybrid weigh the trees of branches only).
    tree: str = "off"
    # How sampled chains test their drafts: 'block' (block verification, default) or
    # 'token' (the per-token rule); both exact (`specsamp.decoding.acceptance`).
    verify: str = "block"
    draft_k: KChoice = dataclasses.field(init=False, repr=False, compare=False)  # k, parsed
    draft_tree: Tree | None = dataclasses.field(init=False, repr=False, compare=False)  # tree, parsed

    def __post_init__(self):
        if self.tree == "auto":
            kind = parse_draft(self.draft)[0]
            if kind == "none":
                raise UserError("--tree auto needs a drafter: give --draft (a draft model, early-exit:L, ngram or ngram+<draft>)")
            object.__setattr__(self, "k", "auto")
        object.__setattr__(self, "draft_tree", None if self.tree == "auto" else parse_tree(self.tree))
        if self.draft_tree is not None:
            if self.draft == "none":
                raise UserError("a token tree needs a drafter: give --draft (a draft model, early-exit:L, ngram or ngram+<draft>)")
            if self.k == "auto":
                raise UserError("--tree and --k auto do not combine yet: give a tree or k auto")
            object.__setattr__(self, "k", self.draft_tree.max_depth)
            object.__setattr__(self, "tree", tree_text(self.draft_tree))  # one spelling: '3' is dyn3
        object.__setattr__(self, "draft_k", TREE_AUTO if self.tree == "auto" else parse_k(self.k))
        if self.batching not in ("static", "continuous"):
            raise UserError(f"batching must be 'static' or 'continuous', got {self.batching!r}")
        check_max_new_tokens(self.max_new_tokens)
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise UserError(f"batch size must be an integer >= 1, got {self.batch_size!r}")
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(i) for i in self.stop_token_ids))
        parse_draft(self.draft)
        from specsamp.loading import check_dtype, check_weights

        check_weights(self.weights)
        check_dtype(self.dtype)
        check_tensor_parallel(self.tensor_parallel)
        check_kv_cache(self.kv_cache)
        check_verify(self.verify)

    @property
    def mode(self) -> str:
        return "autoregressive" if self.draft == "none" else "speculative"

    @property
    def continuous(self) -> bool:
        return self.batching == "continuous" or (self.draft_k.auto and self.draft != "none")


_MODELS: dict = {}
_MODELS_LOCK = threading.Lock()


def load_model_once(spec: str | None, weights: str = "stored", mesh=None, dtype: str = "auto"):
    """load_model, once per process, weight format, dtype and mesh: generators of several
    settings (a K sweep) share one copy of the weights, which are never modified. With a
    mesh, the weights are split over it (`Model.shard_params`)."""
    from specsamp.loading import DEFAULT_MODEL, load_model

    key = (spec or DEFAULT_MODEL, weights, dtype, mesh)
    with _MODELS_LOCK:
        if key not in _MODELS:
            base = _MODELS.get(key[:3] + (None,))
            if mesh is None or base is None:  # placed (and split) as it is read
                _MODELS[key] = load_model(spec, weights, dtype, mesh)
            else:
                params = Model(base.cfg, mesh).shard_params(base.params)
                _MODELS[key] = dataclasses.replace(base, params=params)
        return _MODELS[key]


class Generator:
    """A target (and drafter) loaded once, ready to generate for text prompts."""

    def __init__(self, spec: GeneratorSpec):
        self.spec = spec
        self.mesh = make_mesh(spec.tensor_parallel)
        self.target = load_model_once(spec.target, spec.weights, self.mesh, spec.dtype)
        self.tokenizer = self.target.tokenizer
        self.draft = resolve_auto(spec.draft, spec.target)
        k = spec.draft_k
        cfg = self.target.cfg
        load = file_loader(self.target, lambda path: load_model_once(path, spec.weights,
                                                                     dtype=self.target.dtype))
        self.drafter, draft_params = build_drafter(self.draft, k.largest, spec.sampling, cfg,
                                                   self.target.params, load, self.mesh, wide=k.wide)
        if k.trees and self.drafter is not None:  # `--tree auto`: the shapes this drafter drafts
            k = dataclasses.replace(k, trees=trees_for(self.drafter, k.trees))
        self.engine = Engine(
            Program(cfg, spec.sampling, self.drafter, resolve_kv_cache(spec.kv_cache, self.target.dtype),
                    tree=spec.draft_tree if self.drafter is not None else None, verify=spec.verify),
            self.target.params, draft_params,
            eos_ids=tuple(self.tokenizer.eos_ids), max_new_tokens=spec.max_new_tokens, mesh=self.mesh,
            k=k if self.drafter is not None else fixed_k(0),
        )
        self._cost_ratio: float | None = None

    # Identity of what runs, for tables and reports.
    @property
    def mode(self) -> str:
        return self.spec.mode

    @property
    def target_id(self) -> str:
        return self.target.name

    @property
    def draft_id(self) -> str:
        return self.draft  # 'auto' resolved

    @property
    def device_kind(self) -> str:
        dev = jax.devices()[0]
        return dev.device_kind if dev.platform != "cpu" else f"cpu ({platform.machine()})"

    @property
    def max_prompt_tokens(self) -> int:
        return self.engine.max_prompt_tokens

    def encode_prompt(self, text: str) -> list[int]:
        if not isinstance(text, str) or not text.strip():
            raise UserError("empty prompt")
        if self.spec.chat:
            text = self.tokenizer.chat(text, system=self.spec.system)
        return self.tokenizer.encode(text)

    def prompt_tokens(self, text: str) -> int:
        return len(self.encode_prompt(text))

    def generate(
        self, prompts: Sequence[str], seeds: Sequence[int],
        progress: Callable[[int], None] | None = None,
    ) -> list[Completion]:
        """Completions for `prompts`, in batches of spec.batch_size, one seed per prompt."""
        if len(prompts) != len(seeds):
            raise UserError(f"{len(prompts)} prompts but {len(seeds)} seeds")
        if self.spec.continuous:
            return self._generate_continuous(prompts, seeds, progress)
        out: list[Completion] = []
        bs = self.spec.batch_size
        for i in range(0, len(prompts), bs):
            out.extend(self._generate_batch(prompts[i : i + bs], seeds[i : i + bs]))
            if progress is not None:
                progress(len(out))
        return out

    def _generate_batch(self, prompts, seeds) -> list[Completion]:
        ids = [self.encode_prompt(p) for p in prompts]
        stop_check = self._stop_check if self.spec.stop else None
        raws = self.engine.run(ids, seeds, stop_ids=self.spec.stop_token_ids, should_stop=stop_check,
                               batching=Static(chunk_rounds=16 if self.spec.stop else 1 << 30))
        return [self._to_completion(r) for r in raws]

    def _generate_continuous(self, prompts, seeds, progress) -> list[Completion]:
        ids = [self.encode_prompt(p) for p in prompts]
        eng, batch = self.engine, self.spec.batch_size
        if eng.policy is None and len(eng.k.shapes) > 1:
            eng.policy = auto_policy(eng, batch, ids)
        # Chunks of 16 rounds at most for stop strings, and under a K policy so that it
        # re-decides K as acceptance estimates move.
        chunk = 16 if (self.spec.stop or eng.k.auto) else 1 << 30
        stop_check = self._stop_check if self.spec.stop else None
        raws = eng.run(ids, seeds, stop_ids=self.spec.stop_token_ids, should_stop=stop_check,
                       progress=progress, batching=Continuous(batch, chunk_rounds=chunk))
        return [self._to_completion(r) for r in raws]

    def _stop_check(self, row: int, generated: list[int]) -> bool:
        text = self.tokenizer.decode(generated)
        return any(s in text for s in self.spec.stop)

    def _to_completion(self, raw) -> Completion:
        ids = list(raw.token_ids)
        ends = set(self.tokenizer.eos_ids) | set(self.spec.stop_token_ids)
        body = ids[:-1] if raw.stop_reason in ("eos", "stop") and ids and ids[-1] in ends else ids
        text = self.tokenizer.decode(body)
        reason = raw.stop_reason
        cut = min((text.find(s) for s in self.spec.stop if s in text), default=-1)
        if cut >= 0:
            # The loop may have run past the stop string: keep the tokens up to the one
            # that completes it, and the statistics of exactly those.
            text, reason, raw = text[:cut], "stop", raw.cut(self._stop_token_count(body))
        k = self.drafter.k if self.drafter is not None else 0  # auto: the largest K it may use
        return Completion(
            text=text, token_ids=raw.token_ids, prompt_tokens=raw.prompt_tokens,
            stop_reason=reason, mode=self.mode, target_calls=raw.calls,
            draft_calls=raw.draft_calls, accepted_per_loop=raw.accepted,
            drafted_per_loop=raw.drafted, prefill_s=raw.prefill_s, decode_s=raw.decode_s, k=k,
            compile_s=raw.compile_s, tree=self.spec.tree if self.drafter is not None else "off",
        )

    def _stop_token_count(self, ids: list[int]) -> int:
        """The fewest leading tokens of `ids` whose text contains a stop string (binary
        search: once a prefix's text contains one, every longer prefix's does)."""
        lo, hi = 1, len(ids)
        while lo < hi:
            mid = (lo + hi) // 2
            text = self.tokenizer.decode(ids[:mid])
            if any(s in text for s in self.spec.stop):
                hi = mid
            else:
                lo = mid + 1
        return hi

    @property
    def cost_ratio(self) -> float:
        """Measured draft step time / target step time on this machine (0 for n-gram,
        NaN for the baseline). Measured once, lazily."""
        if self._cost_ratio is None:
            self._cost_ratio = measure_cost_ratio(self.engine) if self.drafter else math.nan
        return self._cost_ratio


def load_generator(spec: GeneratorSpec) -> Generator:
    return Generator(spec)
