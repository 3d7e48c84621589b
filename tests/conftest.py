"""Shared fixtures. The real embedded model is loaded once per session (slow tests only).

The persistent compilation cache is on for the whole session (and, through the
environment, for the subprocesses and pipeline workers tests start), so a warm run reuses
every compiled program.

After each test module the compiled programs it made are dropped: each XLA:CPU executable
keeps memory mappings of its machine code, and a session that kept all of them reached the
kernel's limit (vm.max_map_count, 65530) near the end of the suite, where XLA then failed
inside a compile with a segmentation fault. Programs needed again come back from the
persistent cache. The summary line says how many mappings a test process held at most.

The fast lane (`./dev.sh quick`, i.e. `-m "not slow"`) leaves out the real-model tests
and the modules in OUTSIDE_FAST_LANE (pipelines, sandboxes, training, subprocess CLIs,
multi-device runs, remote storage emulators, the draft-agreement analysis tool), which
this file marks slow; it keeps every exactness test on the tiny models in one process
(greedy speculative == autoregressive, chi-square distribution tests, batch invariance,
near-ties, acceptance and tree-acceptance enumeration, sampling). CI runs everything."""

import gc

import pytest

from specsamp.compilation import enable_compilation_cache, forget_executables, memory_mappings

_PEAK = {"maps": 0, "module": ""}


OUTSIDE_FAST_LANE = frozenset({
    "test_pipeline", "test_pipeline_checks", "test_pipeline_dataflow", "test_pipeline_faults",
    "test_pipeline_slow", "test_pipeline_dask", "test_gcs", "test_sandbox_adversarial",
    "test_sandbox_isolation", "test_distill", "test_feature_distill", "test_cli", "test_eval",
    "test_bench", "test_throughput", "test_report", "test_download", "test_sharding",
    "test_loading_remote", "test_draft_agreement",
})


def pytest_configure(config):
    # Every program, however quickly it compiles: the module-end cache clear (below) would
    # otherwise compile each small one again in every module that uses it.
    enable_compilation_cache(min_compile_seconds=0.0)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.module.__name__.rsplit(".", 1)[-1] in OUTSIDE_FAST_LANE:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs(request):
    yield
    maps = memory_mappings() or 0
    if maps > _PEAK["maps"]:
        _PEAK.update(maps=maps, module=request.module.__name__)
    forget_executables()
    gc.collect()


def pytest_sessionfinish(session):
    output = getattr(session.config, "workeroutput", None)  # a pytest-xdist worker's report
    if output is not None:
        output["mappings"] = dict(_PEAK)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """pytest-xdist: a worker's peak, for the summary line of the process that reports."""
    peak = getattr(node, "workeroutput", {}).get("mappings", {})
    if peak.get("maps", 0) > _PEAK["maps"]:
        _PEAK.update(peak)


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
