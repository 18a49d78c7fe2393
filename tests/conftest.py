"""Shared fixtures: synthetic checkpoints made by the project itself (nothing is downloaded)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

# As the tool does before torch loads (cli.py:_quiet_openmp), for a plain `pytest` too (ci/test.sh sets it).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch  # noqa: E402
from hypothesis import settings

from dsv4convert.checkpoint import PlannedTensor, ShardWriter, write_index

# Property tests draw the same examples on every run (CI must not go red on a new random draw);
# DSV4_HYPOTHESIS=explore draws fresh ones, for hunting bugs by hand.
settings.register_profile("ci", derandomize=True, database=None, deadline=None)
settings.register_profile("explore", deadline=None)
settings.load_profile("explore" if os.environ.get("DSV4_HYPOTHESIS") == "explore" else "ci")

REFERENCE = Path(__file__).resolve().parents[1] / "dsv4convert" / "data"

# Numerics whose claimed precision must hold at any CPU thread count (#51): on a 2-core AMD EPYC, MKL's float32
# GEMM gives a row another result with 2 threads than with 1 (dsv4convert/model/precision.py says why), which no
# test run at the machine's default thread count alone would show on an Intel CPU. ``@pytest.mark.threads`` runs a
# test once per count (default THREAD_COUNTS; 4 oversubscribes a 2-core machine, which changes the partition).
THREAD_COUNTS = (1, 2, 4)


def pytest_configure(config):
    config.addinivalue_line("markers", "threads(*counts): run once per torch CPU thread count (default 1, 2, 4)")


def pytest_generate_tests(metafunc):
    marker = metafunc.definition.get_closest_marker("threads")
    if marker is not None:
        counts = marker.args or THREAD_COUNTS
        metafunc.fixturenames.append("torch_threads")
        metafunc.parametrize("torch_threads", counts, indirect=True, ids=[f"threads{n}" for n in counts])


@pytest.fixture
def torch_threads(request):
    """torch's intra-op CPU threads for one test, restored after it."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)



@pytest.fixture(scope="session")
def real_config() -> dict:
    return json.loads((REFERENCE / "deepseek-v4-flash-config.json").read_text())


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    """``dsv4convert synth --preset tiny``, made once per test session; tests must not modify it."""
    from dsv4convert.synth import preset_config, synthesize

    return synthesize(tmp_path_factory.mktemp("tiny") / "src", preset_config("tiny"), seed=0)


# The vision tensor tiny_v41_missing_vision leaves out: both engines load that checkpoint without complaint.
V41_DROPPED = "vision.blocks.1.mlp.w2.weight"


@pytest.fixture(scope="session")
def tiny_v41(tmp_path_factory) -> Path:
    """``dsv4convert synth --preset tiny-v41``, made once per test session; tests must not modify it. No "dspark"
    in its path: vLLM reads any draft under such a path as a DSpark one."""
    from dsv4convert.cli import main

    dst = tmp_path_factory.mktemp("v41") / "tiny-v41"
    assert main(["synth", "--preset", "tiny-v41", "--dst", str(dst)]) == 0
    return dst


@pytest.fixture(scope="session")
def tiny_v41_missing_vision(tiny_v41, tmp_path_factory) -> Path:
    """tiny-v41 without :data:`V41_DROPPED` (its shard and index rewritten without it)."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    dst = tmp_path_factory.mktemp("v41-broken") / "missing-vision"
    shutil.copytree(tiny_v41, dst)
    index_path = dst / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = dst / index["weight_map"].pop(V41_DROPPED)
    with safe_open(shard, "pt") as f:
        kept = {n: f.get_tensor(n) for n in f.keys() if n != V41_DROPPED}
    save_file(kept, shard, metadata={"format": "pt"})
    index_path.write_text(json.dumps(index))
    return dst


# The variants `convert` writes from a DeepSeek-V4.1 release (convert/v41.py::VARIANTS).
V41_VARIANTS = ("nvfp4", "fp8", "bf16", "w4a16")


@pytest.fixture(scope="session")
def v41_outputs(tiny_v41, tmp_path_factory) -> dict[str, Path]:
    """tiny-v41 converted by each V4.1 recipe (``convert --recipe VARIANT``, the engines' default: both where both
    load it), once per session, each with its model card; tests must not modify them (copy one to change it)."""
    from dsv4convert.cli import main

    root = tmp_path_factory.mktemp("v41-variants")
    for variant in V41_VARIANTS:
        argv = ["convert", "--recipe", variant, "--src", str(tiny_v41), "--dst", str(root / variant), "--no-progress"]
        assert main(argv) == 0, variant
    return {variant: root / variant for variant in V41_VARIANTS}


SHARD = 1_000_000  # small output shards, so every variant spans many


def run(src: Path, dst: Path, recipe: str, **kw):
    """Convert ``src`` into ``dst`` with a shipped recipe name or a recipe file (small shards, unless ``kw`` names
    ``max_shard_bytes``: a V4.1 conversion keeps its source's sharding and refuses a shard limit)."""
    from dsv4convert.convert.execute import ConvertOptions, convert
    from dsv4convert.convert.recipe import load_recipe

    kw.setdefault("max_shard_bytes", SHARD)
    return convert(ConvertOptions(src=str(src), dst=dst, recipe=load_recipe(recipe), progress=False, **kw))


# Outputs whose layout depends on the engine: "<recipe>@<engine>" (the plain name is --engine both, the default).
ENGINE_OUTPUTS = {"fp8@sglang": ("fp8", "sglang"), "nvfp4@sglang": ("nvfp4", "sglang"),
                  "nvfp4@vllm": ("nvfp4", "vllm"), "w4a16@sglang": ("w4a16", "sglang")}


@pytest.fixture(scope="session")
def outputs(tiny_ckpt, tmp_path_factory) -> dict[str, Path]:
    """The tiny checkpoint converted by each shipped recipe (for both engines, the default) and, where the
    layout differs, for one engine ("nvfp4@sglang": FP8 MTP experts, ...), once per session; tests must
    not modify them."""
    root = tmp_path_factory.mktemp("variants")
    recipes = ("fp8", "nvfp4", "nvfp4-mtp-mxfp4", "w4a16", "bf16")
    for recipe in recipes:
        run(tiny_ckpt, root / recipe, recipe)
    for name, (recipe, engine) in ENGINE_OUTPUTS.items():
        run(tiny_ckpt, root / name, recipe, engine=engine)
    return {name: root / name for name in (*recipes, *ENGINE_OUTPUTS)}


def write_plain_checkpoint(root: Path, shards: list[dict[str, torch.Tensor]], config: dict | None = None) -> Path:
    """A checkpoint of arbitrary tensors split into the given shards (for I/O tests)."""
    from dsv4convert import dtypes

    root.mkdir(parents=True, exist_ok=True)
    weight_map, total = {}, 0
    for i, tensors in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        planned = [PlannedTensor(k, dtypes.of_tensor(v).name, dtypes.safetensors_shape(v)) for k, v in tensors.items()]
        with ShardWriter(root / name, planned) as w:
            for k, v in tensors.items():
                w.write(k, v)
        weight_map.update({k: name for k in tensors})
        total += sum(p.nbytes for p in planned)
    write_index(root, weight_map, total)
    if config is not None:
        (root / "config.json").write_text(json.dumps(config))
    return root
