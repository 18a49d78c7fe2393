"""Every output byte the converters write, pinned.

Two fixed tiny sources, seed 0 — the preview's layout with its MTP block (``synth --preset tiny``) and
V4-Flash-0731's with a DSpark drafter under ``mtp.*`` (``synth --preset tiny --drafter dspark``, names
``0731/...``) — are converted to each shipped variant — fp8, nvfp4 for both engines and for SGLang alone,
nvfp4-mtp-mxfp4, w4a16, bf16; for 0731 also fp8 and w4a16 for SGLang alone, whose drafter layouts differ — and
the preview's to a mixed recipe in the form automix writes (``tests/data/mixed-automix.yaml``); the SHA-256 of every safetensors file and the quantization config
(``config.json``'s ``quantization_config`` and ``expert_dtype``/``topk_group``, ``hf_quant_config.json``) must
equal ``tests/data/output_hashes.json``. Refactors move code, never bytes: a change here is a change in what
users get, made on purpose and recorded in its own commit (``DSV4_UPDATE_HASHES=1`` rewrites the file).

The conversions run in a child process with torch's scalar CPU kernels (``ATEN_CPU_CAPABILITY=default``; MKL
in its compatible mode, one thread), so the pinned bytes do not depend on the vector instructions or the cores
of the machine running the suite: with AVX2 kernels the synthetic source itself rounds differently.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

DATA = Path(__file__).parent / "data"
HASHES = DATA / "output_hashes.json"
# name -> (recipe, engine); the recipe is a shipped name or a file under tests/data.
OUTPUTS = {
    "fp8": ("fp8", "both"),
    "nvfp4": ("nvfp4", "both"),
    "nvfp4@sglang": ("nvfp4", "sglang"),
    "nvfp4-mtp-mxfp4": ("nvfp4-mtp-mxfp4", "both"),
    "w4a16": ("w4a16", "both"),
    "bf16": ("bf16", "both"),
    "mixed-automix": (str(DATA / "mixed-automix.yaml"), "both"),
    # V4-Flash-0731's layout: the DSpark drafter carried by each engine's rules
    "0731/fp8": ("fp8", "both"),
    "0731/fp8@sglang": ("fp8", "sglang"),
    "0731/nvfp4": ("nvfp4", "both"),
    "0731/nvfp4@sglang": ("nvfp4", "sglang"),
    "0731/nvfp4-mtp-mxfp4": ("nvfp4-mtp-mxfp4", "both"),
    "0731/w4a16": ("w4a16", "both"),
    "0731/w4a16@sglang": ("w4a16", "sglang"),
    "0731/bf16": ("bf16", "both"),
}

_CHILD = """
import hashlib, json, sys
from pathlib import Path
from dsv4convert.convert.execute import ConvertOptions, convert
from dsv4convert.convert.recipe import load_recipe
from dsv4convert.models.deepseek_v4.layout import ModelConfig
from dsv4convert.models.deepseek_v4.configs import with_dspark, with_num_layers
from dsv4convert.synth import preset_config, synthesize

root, outputs = Path(sys.argv[1]), json.loads(sys.argv[2])
preview = preset_config("tiny")
layers = ModelConfig.from_dict(preview).num_hidden_layers
sources = {"": synthesize(root / "src", preview, seed=0),
           "0731/": synthesize(root / "src-0731", with_dspark(with_num_layers(preview, layers, mtp=False)), seed=0)}
digests = {}
for name, (recipe, engine) in outputs.items():
    src = sources["0731/" if name.startswith("0731/") else ""]
    dst = root / name.replace("/", "-")
    convert(ConvertOptions(src=str(src), dst=dst, recipe=load_recipe(recipe), max_shard_bytes=1_000_000,
                           progress=False, engine=engine))
    config = json.loads((dst / "config.json").read_text())
    quant = {key: config.get(key) for key in ("quantization_config", "expert_dtype", "topk_group")}
    extra = dst / "hf_quant_config.json"
    if extra.exists():
        quant["hf_quant_config.json"] = json.loads(extra.read_text())
    files = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(dst.glob("*.safetensors"))}
    files["quantization"] = hashlib.sha256(json.dumps(quant, sort_keys=True).encode()).hexdigest()
    digests[name] = files
print("DIGESTS " + json.dumps(digests, sort_keys=True))
"""


def _digests(tmp_path: Path) -> dict[str, dict[str, str]]:
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path), json.dumps(OUTPUTS)], env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("DIGESTS "))
    return json.loads(line.removeprefix("DIGESTS "))


def test_every_output_byte_is_pinned(tmp_path):
    digests = _digests(tmp_path)
    assert set(digests) == set(OUTPUTS) and all(len(files) >= 2 for files in digests.values())
    if os.environ.get("DSV4_UPDATE_HASHES") == "1":
        HASHES.write_text(json.dumps(digests, indent=1, sort_keys=True) + "\n")
    pinned = json.loads(HASHES.read_text())
    for name in OUTPUTS:
        assert digests[name] == pinned[name], f"{name}: the converter's output bytes changed"
