#!/usr/bin/env bash
# The project's test command (README): the whole suite, CPU only, Triton kernels in the interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
export TRITON_INTERPRET="${TRITON_INTERPRET:-1}"
# OpenMP threads that spin while they wait starve everything else on a busy 2-core machine; the tool sets this
# before torch loads (cli.py:_quiet_openmp), and so must the test process: torch loads before any command runs.
# Measured: the README path test 124 s -> 33 s beside two busy loops.
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
exec python -m pytest -q -p no:cacheprovider "$@"
