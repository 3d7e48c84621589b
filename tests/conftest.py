"""Shared fixtures. The real embedded model is loaded once per session (slow tests only).

The persistent compilation cache is on for the whole session (as the command line and the
pipeline's workers turn it on), so a second run of the suite, or a program that two tests
build separately, loads compiled programs instead of compiling them again."""

import pytest

from specsamp.compilation import enable_compilation_cache


def pytest_configure(config):
    enable_compilation_cache()


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct, downloaded into the user's cache on first use."""
    from specsamp.loading import load_model

    return load_model("smollm2")
