"""specsamp: exact speculative sampling (Chen et al. 2023) in JAX, for batch generation.

The public API:
    SamplingParams, GeneratorSpec, load_generator, Generator, Completion, UserError
Layers: specsamp.models (the Flax decoder, `Model`), specsamp.quant (stored quantized
weights), specsamp.loading (checkpoints, tokenizers, local and gs:// files),
specsamp.decoding (the whole decoding loop: sampling, the rejection rule, drafters, the
compiled rounds, the engine, the generator), specsamp.analysis (reports, evaluation,
benchmarks, the audit), specsamp.distill (training drafts), specsamp.commands (the CLI).
"""

from specsamp.decoding.config import SamplingParams, seed_for
from specsamp.decoding.results import Completion
from specsamp.errors import UserError

__all__ = ["Completion", "Generator", "GeneratorSpec", "SamplingParams", "UserError", "load_generator",
           "seed_for"]


def __getattr__(name):
    # The generator pulls in JAX; import it only when asked for, so `specsamp --help` is fast.
    if name in ("Generator", "GeneratorSpec", "load_generator"):
        from specsamp.decoding import generator

        return getattr(generator, name)
    raise AttributeError(name)
