"""Shared fixtures. The real embedded model is loaded once per session (slow tests only).

The persistent compilation cache is on for the whole session (and, through the
environment, for the subprocesses and pipeline workers tests start), so a warm run reuses
every compiled program.

After each test module the compiled programs it made are dropped: each XLA:CPU executable
keeps memory mappings of its machine code, and a session that kept all of them reached the
kernel's limit (vm.max_map_count, 65530) near the end of the suite, where XLA then failed
inside a compile with a segmentation fault. Programs needed again come back from the
persistent cache. The summary line says how many mappings the process held at most."""

import gc

import pytest

from specsamp.compilation import enable_compilation_cache, forget_executables, memory_mappings

_PEAK = {"maps": 0, "module": ""}


def pytest_configure(config):
    enable_compilation_cache()


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs(request):
    yield
    maps = memory_mappings() or 0
    if maps > _PEAK["maps"]:
        _PEAK.update(maps=maps, module=request.module.__name__)
    forget_executables()
    gc.collect()


def pytest_terminal_summary(terminalreporter):
    if _PEAK["maps"]:
        terminalreporter.write_line(
            f"memory mappings: at most {_PEAK['maps']} at the end of a module "
            f"({_PEAK['module']}); the kernel's limit is vm.max_map_count")


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct, downloaded into the user's cache on first use."""
    from specsamp.loading import load_model

    return load_model("smollm2")
