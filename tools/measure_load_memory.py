"""Peak resident memory of loading a checkpoint, against its bytes and the runtime's own.

    python tools/make_synthetic_checkpoint.py /tmp/llama3-1b
    python tools/measure_load_memory.py /tmp/llama3-1b --dtype bfloat16

Each measurement runs in a fresh process (the peak, ru_maxrss, only grows): first the
runtime alone (JAX and specsamp imported, a tiny checkpoint of the same tokenizer loaded
and a few tokens generated, i.e. everything but the big weights), then the checkpoint:
loaded, then a few tokens generated. Prints one JSON object: the weights' bytes at the
run's dtype, each peak, and (peak - runtime) / bytes, the ratio the loader bounds.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def child(path: str, dtype: str, tokens: int) -> None:
    """In the measuring process: load, generate, print the peaks."""
    import jax

    from specsamp.decoding.generator import GeneratorSpec, load_generator

    gen = load_generator(GeneratorSpec(target=path, draft="none", dtype=dtype,
                                       max_new_tokens=tokens))
    jax.block_until_ready(gen.target.params)
    loaded = _peak_bytes()
    gen.generate(["hello there"], [0])
    print(json.dumps({"after_load": loaded, "after_generate": _peak_bytes(),
                      "weight_bytes": gen.target.weight_bytes, "dtype": gen.target.dtype}))


def measure(path: str, dtype: str, tokens: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", path, "--dtype", dtype,
                          "--tokens", str(tokens)], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": ROOT}, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        return child(a.path, a.dtype, a.tokens)
    sys.path.insert(0, ROOT)
    from specsamp.testing import make_tiny_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        runtime = measure(make_tiny_checkpoint(os.path.join(tmp, "tiny")), a.dtype, a.tokens)
    model = measure(a.path, a.dtype, a.tokens)
    base, size = runtime["after_generate"], model["weight_bytes"]
    print(json.dumps({
        "path": a.path, "dtype": model["dtype"], "weight_bytes": size,
        "runtime_alone_peak": base, "load_peak": model["after_load"],
        "generate_peak": model["after_generate"],
        "load_ratio": round((model["after_load"] - base) / size, 3),
        "generate_ratio": round((model["after_generate"] - base) / size, 3),
    }, indent=1))


if __name__ == "__main__":
    main()
