"""Checks of the tensor-parallel engine, run in a child process that simulates 8 CPU
devices (XLA_FLAGS must be set before JAX starts, so not in the pytest process).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m tests.sharded_checks greedy

prints one JSON object; tests/test_sharding.py asserts on it.
"""

from __future__ import annotations

import json
import sys

import jax
import numpy as np

from specsamp.decoding.config import SamplingParams
from specsamp.decoding.decode import Program
from specsamp.decoding.engine import Engine
from specsamp.mesh import make_mesh
from specsamp.models import Model
from specsamp.quant import int8_kernel
from tests import tiny

PROMPTS = [[1, 2, 3, 1, 2, 3, 1, 2], [5, 4], [7], [3, 3, 3, 3, 3, 3, 1]]
# (case, device counts): every count for the baseline; fewer for the rest (compile time).
GREEDY = (("none", (1, 2, 4, 8)), ("model", (1, 2, 8)), ("early-exit", (1, 4)), ("int8", (1, 2)))


def int8_params():
    """The tiny target with every Dense kernel as int8 per channel (XLA path)."""
    def convert(path, a):
        name = str(getattr(path[-1], "key", ""))
        return int8_kernel(a, "xla") if name == "kernel" else a

    return jax.tree_util.tree_map_with_path(convert, tiny.target_params())


def engine(n: int, sp: SamplingParams, drafter: str, target_params=None, max_new=24):
    """The tiny target split over n devices, with a draft model replicated on them (or the
    target's first layer, split as the target is)."""
    mesh = make_mesh(n)
    target = Model(tiny.TARGET, mesh)
    params = target.shard_params(target_params or tiny.target_params())
    name, k = {"model": ("tiny-draft", 2), "early-exit": ("early-exit:1", 3)}.get(drafter, ("none", 1))
    draft, draft_params = tiny.drafter(name, k, sp, mesh, params)
    return Engine(Program(tiny.TARGET, sp, draft), params, draft_params, eos_ids=(),
                  max_new_tokens=max_new, mesh=mesh)


def greedy() -> dict:
    """Token ids per (case, n): baseline, draft model, early exit, and int8 weights."""
    out = {}
    for case, sizes in GREEDY:
        for n in sizes:
            drafter = "none" if case == "int8" else case
            weights = int8_params() if case == "int8" else None
            eng = engine(n, SamplingParams(0.0), drafter, weights)
            out[f"{case}/{n}"] = [list(r.token_ids) for r in eng.run(PROMPTS, [0, 1, 2, 3])]
    return out


def _counts(eng, n_samples: int, rows: int = 2000) -> tuple[np.ndarray, float]:
    """Counts of the first three tokens over n_samples seeds, `rows` per call (one shape;
    smaller batches than tests/test_exactness.py: 8 simulated devices hold copies)."""
    from tests.test_exactness import N_TOKENS, PROMPT

    counts = np.zeros((tiny.TARGET.vocab_size,) * N_TOKENS)
    accepted = drafted = 0
    for start in range(0, n_samples, rows):
        for r in eng.run([PROMPT] * rows, list(range(start, start + rows))):
            counts[tuple(r.token_ids[:N_TOKENS])] += 1
            accepted += sum(r.accepted)
            drafted += eng.prog.k * r.loops
    return counts, accepted / max(drafted, 1)


def sampled(n_samples: int = 16_000) -> dict:
    """Chi-square p-values of the first three tokens' joint distribution, sampled with the
    target split over 2 devices (attention, MLP and vocabulary all split; the replicated
    attention of larger N is covered by the greedy check), against the exact joint from a
    one-device full forward."""
    from tests.test_exactness import N_TOKENS, chi_square_pvalue, exact_joint

    sp = SamplingParams(1.0)
    joint = exact_joint(sp)
    out = {}
    for n in (2,):
        counts, acceptance = _counts(engine(n, sp, "model", max_new=N_TOKENS), n_samples)
        out[f"model/{n}"] = {"p": chi_square_pvalue(counts, joint), "acceptance": acceptance}
    # Power: a sampler at temperature 1.1 must fail against the temperature-1 joint.
    counts, _ = _counts(engine(2, SamplingParams(1.1), "model", max_new=N_TOKENS), n_samples)
    out["power"] = {"p": chi_square_pvalue(counts, joint)}
    return out


def collectives() -> dict:
    """The collectives in the compiled decode program of the split target, per n."""
    from specsamp.decoding.decode import generate, new_state, prefill

    out = {}
    for n in (2, 8):
        eng = engine(n, SamplingParams(0.0), "none")
        hlo = _compiled_decode_text(eng, generate, new_state, prefill)
        out[str(n)] = {op: hlo.count(op) for op in ("all-reduce", "all-gather", "reduce-scatter",
                                                    "all-to-all", "collective-permute")}
        out[str(n)]["devices"] = len(eng.target_params["final_norm"]["scale"].sharding.device_set)
    return out


def pipeline() -> dict:
    """The Beam pipeline (DirectRunner) on a tiny checkpoint with tensor_parallel: 2
    (attention, MLP and vocabulary all split) and a replicated draft model: its rows, and
    the same prompts' greedy completions from a one-device Generator."""
    import os
    import tempfile

    from pipelines.generate import run
    from specsamp.decoding.generator import GeneratorSpec, load_generator
    from tests.pipeline_support import GOOD, read, tiny_models, write_config, write_prompts

    root = tempfile.mkdtemp(prefix="specsamp-tp-")
    target, draft = tiny_models(os.path.join(root, "models"))
    expected = write_prompts(os.path.join(root, "prompts"))
    config = write_config(os.path.join(root, "run.yaml"), target, draft, tensor_parallel=2,
                          settings=[{"draft": draft, "k": 3}], batch_size=4)
    run(["--config", config, "--runner", "DirectRunner"])
    done = read(os.path.join(root, "out"), "completions").to_pylist()
    failed = read(os.path.join(root, "out"), "errors").to_pylist()
    gen = load_generator(GeneratorSpec(target=target, draft=draft, k=3, chat=True,
                                       max_new_tokens=16, batch_size=4))
    reference = {f"good/{i}": list(c.token_ids)
                 for i, c in enumerate(gen.generate(GOOD, [0] * len(GOOD)))}
    return {"completions": {r["id"]: list(r["completion_token_ids"]) for r in done},
            "errors": sorted([r["id"], r["error_kind"]] for r in failed),
            "one_device": reference, "expected": expected}


def _compiled_decode_text(eng, decode, new_state, prefill) -> str:
    import jax.numpy as jnp

    state = new_state(eng.prog, jnp.asarray([PROMPTS[0]]), jnp.asarray([8]), 4,
                      jnp.asarray([0], jnp.uint32), 128)
    state = eng.place(state)
    eos = jnp.asarray([-1]); stops = jnp.asarray([-1])
    lowered = decode.lower(eng.prog, eng.prog.k, eng.target_params, None, state, eos, stops,
                           jnp.int32(4), jnp.int32(2))
    return lowered.compile().as_text()


def load() -> dict:
    """For each checkpoint form and device count: does loading onto the mesh (each weight
    split as it is read) give the arrays, and the shardings, of loading on one device and
    then splitting? A Hugging Face folder (bfloat16 and float32) and a Q8_0 GGUF (stored
    blocks)."""
    import os
    import tempfile

    from specsamp.loading import load_model
    from specsamp.testing import make_tiny_checkpoint, write_gguf

    tmp = tempfile.mkdtemp()
    os.environ["SPECSAMP_CACHE"] = os.path.join(tmp, "cache")
    folder = make_tiny_checkpoint(os.path.join(tmp, "hf"), tied=False, qkv_bias=True)
    gguf = write_gguf(folder, os.path.join(tmp, "m.gguf"), "Q8_0")
    out = {}
    for case, path, dtype in (("hf-bf16", folder, "bfloat16"), ("hf-f32", folder, "float32"),
                              ("gguf-q8", gguf, "float32")):
        for n in (2, 4):
            mesh = make_mesh(n)
            direct = load_model(path, dtype=dtype, mesh=mesh)
            base = load_model(path, dtype=dtype)
            split = Model(base.cfg, mesh).shard_params(base.params)
            a, b = jax.tree.leaves(direct.params), jax.tree.leaves(split)
            out[f"{case}/{n}"] = len(a) == len(b) and all(
                x.dtype == y.dtype and x.sharding == y.sharding
                and np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(a, b))
    return out


if __name__ == "__main__":
    from specsamp.compilation import enable_compilation_cache

    enable_compilation_cache()
    assert len(jax.devices()) >= 8, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"
    checks = {"greedy": greedy, "sampled": sampled, "collectives": collectives, "pipeline": pipeline,
              "load": load}
    print(json.dumps({name: checks[name]() for name in sys.argv[1:]}, default=float))
