"""The Dataflow job graph builds offline (dry run) with TPU worker options, from the shipped
production config; nothing touches the network or looks for credentials."""

import os

import apache_beam as beam
from apache_beam.runners.dataflow.internal import apiclient

from pipelines.generate import pipeline_options, run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IMAGE = "us-docker.pkg.dev/my-project/specsamp/worker:0.1.0"
TPU = "worker_accelerator=type:tpu-v5-lite-podslice;topology:1x1"
ARGS = ["--runner", "DataflowRunner", "--dry_run=True", "--project", "my-project",
        "--region", "us-central1", "--temp_location", "gs://specsamp-test/tmp",
        "--worker_machine_type", "ct5lp-hightpu-1t", "--dataflow_service_options", TPU,
        "--sdk_container_image", IMAGE]


def test_dataflow_tpu_graph_builds_offline(capsys):
    p = beam.Pipeline(options=pipeline_options(ARGS))
    assert run(["--config", os.path.join(ROOT, "configs", "dataflow_tpu.yaml")] + ARGS, test_pipeline=p) is None
    assert "dry run" in capsys.readouterr().err
    proto = p.runner.proto_pipeline
    top = {t.unique_name for t in proto.components.transforms.values() if "/" not in t.unique_name}
    assert {"PromptBatches", "ReadPrompts", "Generate", "Commit"} <= top
    env = apiclient.Environment(packages=[], options=p.runner.job.options, environment_version="0",
                                proto_pipeline_staged_url="", proto_pipeline=proto)
    [pool] = env.proto.worker_pools
    assert pool.machine_type == "ct5lp-hightpu-1t"
    assert TPU in env.proto.service_options
    assert {i.container_image for i in pool.sdk_harness_container_images} == {IMAGE}


def test_local_runner_is_fnapi_not_prism():
    """Beam 2.77's DirectRunner first tries to download Prism from the internet."""
    from apache_beam.options.pipeline_options import StandardOptions

    for args in ([], ["--runner", "DirectRunner"]):
        assert pipeline_options(args).view_as(StandardOptions).runner == "FnApiRunner"
    assert pipeline_options(ARGS).view_as(StandardOptions).runner == "DataflowRunner"


def test_setup_file_builds_an_sdist_with_the_pipeline(tmp_path):
    """What `--setup_file ./setup.py` stages for Dataflow workers must hold every package
    the job imports (pipelines, schemas, specsamp) and the shipped draft."""
    import shutil
    import subprocess
    import sys
    import tarfile

    assert os.path.exists(os.path.join(ROOT, "README.md")), \
        "pyproject.toml names README.md as the readme: without it neither the sdist nor the Dockerfile builds"
    src = tmp_path / "src"
    src.mkdir()
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, name), src / name)
    for pkg in ("pipelines", "schemas", "specsamp"):
        shutil.copytree(os.path.join(ROOT, pkg), src / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "setup.py", "-q", "sdist", "--dist-dir", str(tmp_path / "dist")],
                   cwd=src, check=True, capture_output=True)
    [sdist] = list((tmp_path / "dist").iterdir())
    names = tarfile.open(sdist).getnames()
    for module in ("pipelines/generate.py", "pipelines/handler.py", "schemas/tables.py",
                   "specsamp/decoding/generator.py",
                   # the shipped draft (`auto`, `ngram+smollm2-feature`) travels with the code
                   "specsamp/decoding/drafts/smollm2_135m_instruct_feature/model.safetensors",
                   "specsamp/decoding/drafts/smollm2_135m_instruct_feature/specsamp_draft.json"):
        assert any(n.endswith(module) for n in names), module
