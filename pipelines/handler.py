"""The RunInference ModelHandler: loads the generators once per worker and calls the library.

Failures are caught per element, not per batch (Beam's `with_exception_handling` would
drop a whole batch for one bad prompt): a prompt that is too long or that the engine
rejects becomes an error row, and a batch whose generation fails is retried one prompt
at a time so that only the failing prompt lands in the error table.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import threading
import time
from typing import Iterable, Sequence

from apache_beam.metrics import Metrics
from apache_beam.ml.inference.base import ModelHandler, PredictionResult

from pipelines import rows
from pipelines.rows import Example, RunInfo, Work
from specsamp.decoding import stats
from specsamp.errors import UserError
from specsamp.runconfig import RunConfig, Setting

NAMESPACE = "specsamp"
DEFAULT_LOADER = "specsamp:load_generator"
_LOADED: dict = {}  # (loader, spec) -> generator: reused by later pipelines in a process
_LOAD_LOCK = threading.Lock()


def _not_resource_warning(record: logging.LogRecord) -> bool:
    # Beam 2.77 logs this on every batch when its optional model manager does not import;
    # it concerns a memory statistic specsamp does not use.
    return not str(record.msg).startswith("Resource module is not available")


logging.getLogger().addFilter(_not_resource_warning)


def generator_spec(cfg: RunConfig, setting: Setting):
    """The engine's GeneratorSpec for one setting of the run."""
    from specsamp import GeneratorSpec
    from specsamp.runconfig import K_AUTO

    # Continuous batching: a generate call keeps its batch_size slots busy over all the
    # prompts it is given (rows that finish make room for the next prompts).
    return GeneratorSpec(target=cfg.target, draft=setting.draft,
                         k="auto" if setting.k == K_AUTO else max(setting.k, 1),
                         sampling=cfg.sampling, max_new_tokens=cfg.max_new_tokens,
                         chat=cfg.chat, system=cfg.system, stop=cfg.stop,
                         batch_size=cfg.batch_size, weights=cfg.weights,
                         tensor_parallel=cfg.tensor_parallel, kv_cache=cfg.kv_cache,
                         dtype=cfg.dtype, tree=setting.tree, verify=cfg.verify,
                         batching="continuous")


class Generators:
    """The per-worker model: one loaded generator per setting, addressed by setting key.

    Only methods, no attribute access, so it also works behind the proxy Beam puts in
    front of a model shared across processes (`share_model_across_processes`).
    """

    def __init__(self, cfg: RunConfig, loader: str = DEFAULT_LOADER):
        load = _resolve(loader)
        self._gens = {}
        for s in cfg.settings:
            spec = generator_spec(cfg, s)
            with _LOAD_LOCK:
                if (loader, spec) not in _LOADED:
                    _LOADED[(loader, spec)] = load(spec)
            self._gens[s.key] = _LOADED[(loader, spec)]

    def count_tokens(self, key: str, text: str) -> int:
        return self._gens[key].prompt_tokens(text)

    def max_prompt_tokens(self, key: str) -> int:
        return self._gens[key].max_prompt_tokens

    def generate(self, key: str, prompts: list[str], seeds: list[int]) -> list:
        return self._gens[key].generate(prompts, seeds)

    def describe(self, key: str) -> tuple[str, float]:
        """(device kind, draft/target cost ratio) of the setting's generator."""
        gen = self._gens[key]
        return gen.device_kind, gen.cost_ratio


class GeneratorHandler(ModelHandler[Work, tuple, Generators]):
    """A Work (one planned batch) in; one PredictionResult out whose inference is the
    batch's (completion rows, error rows), every input sample in exactly one of them."""

    def __init__(self, cfg: RunConfig, info: RunInfo, total: int = 0, loader: str = DEFAULT_LOADER):
        w = cfg.workers
        super().__init__(large_model=w.share_model_across_processes,
                         model_copies=w.model_copies if w.share_model_across_processes else None)
        self._cfg, self._info, self._total, self._loader = cfg, info, total, loader

    def should_skip_batching(self) -> bool:
        # Batches are fixed by the plan (pipelines.plan.Batch), not by Beam's BatchElements,
        # whose last batch of a bundle comes out in finish_bundle (dropped on some runners)
        # and whose batches differ on a retry (a redone batch must rewrite its own shards).
        return True

    def load_model(self) -> Generators:
        from pipelines.stop import ignore_interrupts_in_worker
        from specsamp.compilation import enable_compilation_cache

        ignore_interrupts_in_worker()
        enable_compilation_cache()  # a worker reuses the programs earlier runs compiled
        start = time.time()
        fresh = not all((self._loader, generator_spec(self._cfg, s)) in _LOADED for s in self._cfg.settings)
        model = Generators(self._cfg, self._loader)
        if fresh:  # some runners set a DoFn up once per bundle; the models load once per process
            _progress(self._info.run_id, self._total).note(f"models ready in {time.time() - start:.1f} s")
        return model

    def run_inference(self, batch: Work, model: Generators, inference_args=None) -> Iterable[PredictionResult]:
        out = self.infer(batch.examples, model)
        completions = [row for tag, row in out if tag == "completion"]
        errors = list(batch.errors) + [row for tag, row in out if tag == "error"]
        return [PredictionResult(batch, (completions, errors))]

    def infer(self, batch: Sequence[Example], model: Generators) -> list[tuple]:
        """("completion", row) or ("error", row) for each Example, in order."""
        out: list = [None] * len(batch)
        for key in dict.fromkeys(ex.key for ex in batch):  # a batch may mix settings
            where = [i for i, ex in enumerate(batch) if ex.key == key]
            for i, result in zip(where, self._run_group(model, key, [batch[i] for i in where])):
                out[i] = result
        return out

    def _run_group(self, model: Generators, key: str, group: list[Example]) -> list[tuple]:
        device, ratio = model.describe(key)
        out: list = [None] * len(group)
        ready = []
        for i, ex in enumerate(group):
            problem = _length_problem(model, key, ex)
            if problem:
                out[i] = ("error", rows.example_error(self._info, ex, *problem, device_kind=device))
            else:
                ready.append(i)
        for i, result in zip(ready, self._generate(model, key, [group[i] for i in ready])):
            ex = group[i]
            if isinstance(result, Exception):
                out[i] = ("error", rows.example_error(
                    self._info, ex, "generation_failed", f"{type(result).__name__}: {result}", device))
            else:
                out[i] = ("completion", rows.completion_row(self._info, ex, result, device, ratio))
        for tag, row in out:
            count_row(tag, row)
        _progress(self._info.run_id, self._total).update(out)
        return out

    def _generate(self, model: Generators, key: str, group: list[Example]) -> list:
        """Completions, or the exception for each prompt whose generation failed."""
        if not group:
            return []
        try:
            return model.generate(key, [ex.prompt for ex in group], [ex.seed for ex in group])
        except Exception as e:
            if len(group) == 1:
                return [e]
        # One prompt broke the batch: run them one by one to find it.
        return [r for ex in group for r in self._generate(model, key, [ex])]

    def get_metrics_namespace(self) -> str:
        return NAMESPACE


def _length_problem(model: Generators, key: str, ex: Example) -> tuple[str, str] | None:
    try:
        n = model.count_tokens(key, ex.prompt)
    except UserError as e:
        return ("empty_prompt" if "empty" in str(e).lower() else "bad_row"), str(e)
    except Exception as e:
        return "bad_row", f"cannot tokenize the prompt: {type(e).__name__}: {e}"
    limit = model.max_prompt_tokens(key)
    if n > limit:
        return "too_long", f"prompt has {n} tokens; the model takes at most {limit}"
    return None


def count_row(tag: str, row: dict) -> None:
    """Beam counters for one output row ("completion" or "error")."""
    Metrics.counter(NAMESPACE, "samples").inc()
    if tag == "error":
        Metrics.counter(NAMESPACE, "errors").inc()
        Metrics.counter(NAMESPACE, f"errors_{row['error_kind']}").inc()
        return
    Metrics.counter(NAMESPACE, "completions").inc()
    Metrics.counter(NAMESPACE, "generated_tokens").inc(row["generated_tokens"])
    Metrics.counter(NAMESPACE, "target_calls").inc(row["target_calls"])
    if row["mode"] == "speculative":
        accepted, drafted, _ = stats.loop_counts(row["accepted_per_loop"], row["drafted_per_loop"])
        Metrics.counter(NAMESPACE, "accepted_tokens").inc(accepted)
        Metrics.counter(NAMESPACE, "drafted_tokens").inc(drafted)


def _resolve(loader: str):
    module, _, name = loader.partition(":")
    return getattr(importlib.import_module(module), name)


class Progress:
    """Periodic one-line reports to stderr from each worker process (a long local run
    otherwise prints nothing for minutes). Counts are this process's; the job total is
    given so a reader can judge how far along the job is."""

    def __init__(self, total: int, every_s: float = 10.0):
        self.total, self.every_s = total, every_s
        self.done = self.errors = self.tokens = 0
        self.start = self.last = time.time()

    def note(self, text: str) -> None:
        print(f"specsamp [pid {os.getpid()}]: {text}", file=sys.stderr, flush=True)

    def update(self, out: list[tuple]) -> None:
        self.done += len(out)
        self.errors += sum(tag == "error" for tag, _ in out)
        self.tokens += sum(row.get("generated_tokens", 0) for tag, row in out if tag == "completion")
        now = time.time()
        if now - self.last >= self.every_s:
            self.last = now
            rate = self.tokens / max(now - self.start, 1e-9)
            self.note(f"{self.done} of {self.total} samples done here ({self.errors} errors), "
                      f"{self.tokens} tokens, {rate:.1f} tokens/s")


_PROGRESS: dict[str, Progress] = {}  # run id -> this process's progress in that run


def _progress(run_id: str, total: int) -> Progress:
    return _PROGRESS.setdefault(run_id, Progress(total))
