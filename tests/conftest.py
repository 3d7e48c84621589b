"""Shared fixtures. The real embedded model is loaded once per session (slow tests only).

The persistent compilation cache is on for the whole session (and, through the
environment, for the subprocesses and pipeline workers tests start), so a warm run reuses
every compiled program.

Compiled programs are kept across tests and modules (a program traced once is not traced
again in this process), until the process holds more than MAPS_HIGH memory mappings after a
test: then they are dropped. Each XLA:CPU executable keeps memory mappings of its machine
code, and a session that kept all of them reached the kernel's limit (vm.max_map_count,
65530) near the end of the suite, where XLA then failed inside a compile with a
segmentation fault. Programs needed again come back from the persistent cache (but are
traced and lowered again: that, not compiling, is most of a tiny-model test's time). The
summary line (one process only) says how many mappings the process held at most.

The fast lane (`./dev.sh quick`, i.e. `-m "not slow"`) leaves out the real-model tests
and the modules in OUTSIDE_FAST_LANE (pipelines, sandboxes, training, subprocess CLIs,
multi-device runs, remote storage emulators, the draft-agreement analysis tool), which
this file marks slow; it keeps every exactness test on the tiny models (greedy
speculative == autoregressive, chi-square distribution tests, batch invariance, near-ties,
acceptance and tree-acceptance enumeration, sampling). CI runs everything."""

import gc

import pytest

from specsamp.compilation import enable_compilation_cache, forget_executables, memory_mappings

_PEAK = {"maps": 0, "module": "", "releases": 0}


OUTSIDE_FAST_LANE = frozenset({
    "test_pipeline", "test_pipeline_checks", "test_pipeline_dataflow", "test_pipeline_faults",
    "test_pipeline_slow", "test_pipeline_dask", "test_gcs", "test_sandbox_adversarial",
    "test_sandbox_isolation", "test_distill", "test_feature_distill", "test_cli", "test_eval",
    "test_bench", "test_throughput", "test_report", "test_download", "test_sharding",
    "test_loading_remote", "test_draft_agreement",
})


def pytest_configure(config):
    enable_compilation_cache()


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.module.__name__.rsplit(".", 1)[-1] in OUTSIDE_FAST_LANE:
            item.add_marker(pytest.mark.slow)


# Mappings at which the compiled programs are dropped after a test: the largest module
# adds about 38,000 mappings and one test a few thousand, so this leaves room below 65,530.
MAPS_HIGH = 40_000


@pytest.fixture(autouse=True)
def _release_compiled_programs(request):
    yield
    maps = memory_mappings() or 0
    if maps > _PEAK["maps"]:
        _PEAK.update(maps=maps, module=request.module.__name__)
    if maps > MAPS_HIGH:
        forget_executables()
        gc.collect()
        _PEAK["releases"] += 1


def pytest_terminal_summary(terminalreporter):
    if _PEAK["maps"]:
        terminalreporter.write_line(
            f"memory mappings: at most {_PEAK['maps']} at the end of a module "
            f"({_PEAK['module']}), programs dropped {_PEAK['releases']} times; the kernel's "
            "limit is vm.max_map_count")


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct, downloaded into the user's cache on first use."""
    from specsamp.loading import load_model

    return load_model("smollm2")
