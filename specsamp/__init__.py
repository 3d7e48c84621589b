"""specsamp: exact speculative sampling (Chen et al. 2023) in JAX, for batch generation.

The public API:
    SamplingParams, GeneratorSpec, load_generator, Generator, Completion, UserError
Lower layers: specsamp.models (the Flax decoder), specsamp.sampling (logits -> probs),
specsamp.acceptance (the rejection rule), specsamp.decode (compiled loops),
specsamp.engine (host orchestration on token ids).
"""

from specsamp.config import SamplingParams, seed_for
from specsamp.errors import UserError
from specsamp.results import Completion

__all__ = ["Completion", "Generator", "GeneratorSpec", "SamplingParams", "UserError", "load_generator",
           "seed_for"]


def __getattr__(name):
    # The generator pulls in JAX; import it only when asked for, so `specsamp --help` is fast.
    if name in ("Generator", "GeneratorSpec", "load_generator"):
        from specsamp import generator

        return getattr(generator, name)
    raise AttributeError(name)
