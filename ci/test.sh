#!/usr/bin/env bash
# The project's test command (README): the whole suite, CPU only, Triton kernels in the interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
export TRITON_INTERPRET="${TRITON_INTERPRET:-1}"
exec python -m pytest -q -p no:cacheprovider "$@"
