#!/usr/bin/env bash
# Packs what the lent GPU machine's Python lacks (Ray, Optuna and their needs; it has torch, pandas,
# pyarrow, pytest, ...) into .whl/ (git-ignored) for the device tool's `carry`, at the versions of
# this project's virtual environment, for CPython 3.12 on x86-64.
#
#   bash bench/gpu_wheels.sh           # here, once (a few minutes: xz)
#   then, on the GPU machine: bash bench/gpu_check.sh   (it installs .whl/ into /tmp/site first)
#
# The Ray wheel (79 MB) is over the tool's 64 MiB a call: it travels unpacked as ray.tar.xz without
# what a sweep never loads (its Java jars, RLlib, the dashboard's web client), about 30 MB.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
# missing there (KINDS.md's package list of the device image, 2026-11-17), with what they need
NAMES="ray optuna alembic mako sqlalchemy colorlog jsonschema jsonschema-specifications referencing rpds-py tensorboardx pydantic pydantic-core annotated-types typing-inspection"
rm -rf .whl && mkdir -p .whl
pins=$("$PYTHON" -m pip list --format=freeze 2>/dev/null | awk -F== -v names=" $NAMES " '{n = tolower($1); gsub(/_/, "-", n)} index(names, " " n " ") {print n "==" $2}')
for name in $NAMES; do
    echo "$pins" | grep -qi "^$name==" || { echo "gpu_wheels.sh: $name is not installed in $PYTHON's environment (pip install -e '.[test]' first)" >&2; exit 2; }
done
# shellcheck disable=SC2086
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl $pins
ray_wheel=$(ls .whl/ray-*.whl)
unpacked=$(mktemp -d)
trap 'rm -rf "$unpacked"' EXIT
unzip -q "$ray_wheel" -d "$unpacked"
rm -rf "$unpacked"/ray/jars "$unpacked"/ray/rllib "$unpacked"/ray/dashboard/client/build
tar -C "$unpacked" -cf - . | xz -6 -T0 > .whl/ray.tar.xz
rm "$ray_wheel"
du -sh .whl
ls -la .whl
