"""Shared fixtures. The real embedded model is loaded once per session (slow tests only)."""

import pytest


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct, downloaded into the user's cache on first use."""
    from specsamp.loading import load_model

    return load_model("smollm2")
