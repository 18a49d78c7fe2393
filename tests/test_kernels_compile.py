"""Every config table compiles for the GPUs that get it and fits them, checked on CPU (tests/kernel_compile.py).

The kernel tests run in Triton's interpreter here and compiled only where a GPU is present (an
H200 so far), so a config that asks sm_120 for more than its 99 KB of shared memory per block, or
spills registers, or that B200's sm_100 (which takes the H200's tables) cannot compile, would
otherwise first fail on a user's GPU. The PTX also shows whether the M = 1 GEMV kept what makes it
fast (no shared-memory layout conversion, 16-byte code-word loads), and the M <= 16 tensor-core
GEMV its one chunk of eight MMAs per 8 tokens per loop step.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dsv4convert.kernels import configs
from dsv4convert.kernels._runtime import family_of_capability

HELPER = Path(__file__).resolve().parent / "kernel_compile.py"

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")


def _compiled_rows(arch: str) -> list[dict]:
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(HELPER), "--arch", arch], capture_output=True, text=True, env=env,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


@pytest.mark.parametrize("arch,capability", [("sm_120", 12), ("sm_90", 9), ("sm_100", 10)])
def test_every_table_config_compiles_and_fits(arch, capability):
    rows = _compiled_rows(arch)
    family = family_of_capability(capability)
    assert {row["family"] for row in rows} == {family}
    compiled = {row["config"] for row in rows}
    expected = {repr(cfg) for kind in ("weight_only", "fp8") for _, cfg in configs.GEMM_TABLES[kind][family]}
    expected |= {repr(cfg) for cfg in configs.SAFE_GEMM.values()}
    expected |= {repr(configs.dequant_config(family, fmt)) for fmt in ("fp8", "int4")}
    assert expected <= compiled, f"not compiled: {sorted(expected - compiled)}"
    kernels = {row["kernel"] for row in rows}
    assert {"fp8_block_gemm_kernel", "act_quant_kernel", "dequant_4bit_kernel", "dequant_fp8_kernel",
            "fp8_block_quant_kernel", "int4_quant_kernel", "mxfp4_to_nvfp4_kernel", "mxfp4_to_fp8_block_kernel"} <= kernels
    for row in rows:
        where = f"{row['kernel']} {row['format']} {row['config']}"
        assert 0 <= row["shared_bytes"] <= configs.SHARED_MEMORY_LIMIT[family], where
        assert row["local_bytes"] == 0, f"{where}: spills {row['local_bytes']} bytes per thread"
        assert 0 < row["registers"] <= 255, where
    # The GEMV's speed rests on two things a Triton upgrade or an edit could silently undo: no layout
    # conversion through shared memory (one barrier: the final cross-thread sum) and 16-byte code-word
    # loads (32-bit loads only for the expert offsets and NVFP4's global scale).
    gemv = [row for row in rows if row["kernel"] == "weight_only_gemv_kernel"]
    assert bool(gemv) == any(cfg.variant == "gemv" for _, cfg in configs.GEMM_TABLES["weight_only"][family])
    for row in gemv:
        where = f"GEMV {row['format']} {row['config']}"
        assert row["barriers"] <= 1, f"{where}: {row['barriers']} barriers"
        assert row["global_loads_32"] <= 3 and row["global_loads_128"] > 0, f"{where}: {row}"
    # The tensor-core GEMV: one 128-K chunk of 16 rows per loop step is eight MMAs per 8 tokens (two
    # per code word of a row pair), code words and activations in 16-byte loads (two rows' words,
    # four words' activations per token column, and the words of the prologue); its barriers are the
    # K shares' final sum only.
    mma = [row for row in rows if row["kernel"] == "weight_only_mma_kernel"]
    assert bool(mma) == any(cfg.variant == "mma" for _, cfg in configs.GEMM_TABLES["weight_only"][family])
    for row in mma:
        where = f"mma {row['format']} {row['config']}"
        token_cols = int(re.search(r"block_m=(\d+)", row["config"]).group(1)) // 8
        assert row["mma_sync"] == 8 * token_cols and row["global_loads_128"] >= 6 + 4 * token_cols, f"{where}: {row}"
