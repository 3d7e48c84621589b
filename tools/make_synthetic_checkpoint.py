"""Write a synthetic Hugging Face checkpoint of a real model's shape, in bfloat16, with
random weights and the tiny test tokenizer (its 300 tokens; the embedding is padded to the
shape's vocabulary): for measuring loading (peak memory, time) at scale without a download.

    python tools/make_synthetic_checkpoint.py /tmp/llama3-1b            # Llama 3.2 1B's shape
    python tools/make_synthetic_checkpoint.py /tmp/small --layers 2 --shards 3

Tensors are generated and written one at a time (a bounded slice of rows at a time), so
writing takes little memory whatever the size. Shards follow Hugging Face's layout
(model-0000i-of-0000n.safetensors and model.safetensors.index.json).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from specsamp.testing import write_bf16_checkpoint  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--ff", type=int, default=8192)
    p.add_argument("--untied", action="store_true")
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    total = write_bf16_checkpoint(a.out, vocab=a.vocab, d=a.hidden, layers=a.layers, heads=a.heads,
                                  kv_heads=a.kv_heads, head_dim=a.head_dim, ff=a.ff,
                                  tied=not a.untied, shards=a.shards, seed=a.seed)
    print(f"{a.out}: {total / 1e9:.3f}B parameters, {total * 2 / 1e9:.3f} GB in bfloat16, "
          f"{a.shards} shards")


if __name__ == "__main__":
    main()
