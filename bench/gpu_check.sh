#!/usr/bin/env bash
# On the lent GPU machine: install what its Python lacks from .whl/ (made here by
# bench/gpu_wheels.sh and carried), then run bench/gpu_check.py with the arguments given.
#
#   device run, carry [".whl"]:  bash bench/gpu_check.sh --steps environment,gpu_tests,train
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python3 -c "import ray.tune, optuna" 2>/dev/null; then
    if [ ! -d .whl ]; then
        echo "gpu_check.sh: Ray or Optuna is missing here and there is no .whl/ to install them from (run bench/gpu_wheels.sh where pip works; carry .whl)" >&2
        exit 2
    fi
    mkdir -p /tmp/site
    if [ -f .whl/ray.tar.xz ]; then tar -xJf .whl/ray.tar.xz -C /tmp/site; fi
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# the package from this checkout: the machine has no install of it
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
exec python3 bench/gpu_check.py "$@"
