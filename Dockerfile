# Dataflow worker image: Beam's Python SDK container plus specsamp and JAX for TPU.
#   docker build -t us-docker.pkg.dev/MY_PROJECT/specsamp/worker:0.1.0 .
#   docker push us-docker.pkg.dev/MY_PROJECT/specsamp/worker:0.1.0
#   specsamp run --config configs/dataflow_tpu.yaml --runner DataflowRunner ... \
#     --sdk_container_image us-docker.pkg.dev/MY_PROJECT/specsamp/worker:0.1.0
# The Beam and Python versions must match the launcher's (apache-beam 2.77.0, Python 3.11).
FROM apache/beam_python3.11_sdk:2.77.0

WORKDIR /opt/specsamp
COPY pyproject.toml setup.py README.md ./
COPY specsamp specsamp
COPY pipelines pipelines
COPY schemas schemas

# The project with its pinned stack, and the TPU build of the same JAX release (libtpu).
RUN pip install --no-cache-dir . "jax[tpu]==0.10.2"

# Bake the embedded default model and the compilation cache location into the image, so
# workers neither download at start nor recompile what an earlier worker compiled.
ENV SPECSAMP_CACHE=/opt/specsamp/cache
RUN python -c "from specsamp.loading.download import ensure_smollm2; ensure_smollm2()"

# The base image's entrypoint (/opt/apache/beam/boot) starts the SDK harness; keep it.
