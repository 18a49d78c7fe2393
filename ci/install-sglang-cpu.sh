#!/usr/bin/env bash
# Install SGLang (the version dsv4convert/engines/__init__.py pins) and sglang-router 0.3.2 into the *active*
# Python environment, CPU only,
# so tests can run SGLang's real argument parsers, server-arg resolution and quant-config
# classes (tests/sglang_oracle.py). Idempotent: pip skips what is already at the pinned version.
#
# Why --no-deps: the sglang wheel pins torch 2.14.1 (CUDA, ~5.5 GB), flashinfer, sglang-kernel,
# deep_gemm and tilelang; none of them is needed to parse arguments or build quant configs, and
# torch 2.13 CPU (the project's torch) is enough. The list below is what those imports need,
# found by importing until nothing was missing.
#
# torchvision: PyPI only has CUDA builds, whose C++ ops cannot load next to CPU torch; its
# Python part imports fine (see the module docstring of tests/sglang_oracle.py), and SGLang
# needs it importable only because its config package imports multimodal helpers.
set -euo pipefail

PYTHON="${PYTHON:-python}"
# The one place the version is written: the engine rules follow it (dsv4convert/engines/__init__.py).
SGLANG_VERSION="$("$PYTHON" -c 'from dsv4convert.engines import VERSIONS; print(VERSIONS["sglang"])')"
pip_install() { "$PYTHON" -m pip install --disable-pip-version-check --quiet "$@"; }

torch_version="$("$PYTHON" -c 'import torch; print(torch.__version__.split("+")[0])')"
case "$torch_version" in
  2.13.*) torchvision_pin="torchvision==0.28.0" ;;
  2.14.*) torchvision_pin="torchvision==0.29.1" ;;
  *) echo "install-sglang-cpu: no torchvision pin for torch $torch_version" >&2; exit 1 ;;
esac

# The two packages under test, without their GPU dependency tree.
pip_install --no-deps "sglang==$SGLANG_VERSION" "sglang-router==0.3.2" "$torchvision_pin"

# Pure-Python (or small binary) imports of sglang.srt.server_args, the quant configs,
# srt/models/deepseek_v4.py (and its loader, which tests/test_sglang_loading.py runs: einops for
# the wo_a dequant, openai and partial-json-parser for the FusedMoE layer's protocol imports) and
# sglang_router.launch_router.
pip_install \
  "transformers==5.19.0" \
  "compressed-tensors==0.18.0" \
  "apache-tvm-ffi==0.1.11" \
  "gguf==0.19.0" \
  "msgspec==0.23.0" \
  "orjson==3.13.0" \
  "pybase64==1.5.1" \
  "pyzmq==27.3.0" \
  "requests==2.34.2" \
  "pillow==13.0.0" \
  "aiohttp==3.14.5" \
  "IPython==9.18.1" \
  "dill==0.4.1" \
  "sentencepiece==0.2.1" \
  "einops==0.8.2" \
  "openai==2.8.0" \
  "partial-json-parser==0.2.1.1.post7" \
  "setproctitle==1.3.8" \
  "fastapi==0.165.0" \
  "uvicorn==0.54.0"

# SGLang imports triton at module level; keep whatever the project pinned, else install one.
if ! "$PYTHON" -c 'import triton' 2>/dev/null; then
  pip_install "triton==3.6.0"
fi

"$PYTHON" - <<'EOF'
import sys
sys.path.insert(0, "tests")
import sglang_oracle  # noqa: F401  (imports SGLang's parser, quant configs, V4 model and router)
# What sglang_oracle.load_checkpoint builds the real model and its MTP draft with, on CPU.
import sglang.srt.models.deepseek_v4_nextn, sglang.srt.platforms.cpu  # noqa: E401,F401
import sglang.srt.model_executor.model_runner_components.load_model_utils  # noqa: F401
import einops, openai, partial_json_parser  # noqa: E401,F401  (wo_a dequant; SGLang's protocol imports)
import sglang, sglang_router
from dsv4convert.engines import VERSIONS
assert sglang.__version__ == VERSIONS["sglang"], sglang.__version__
print(f"install-sglang-cpu: sglang {sglang.__version__}, sglang-router {sglang_router.__version__}: OK")
EOF
