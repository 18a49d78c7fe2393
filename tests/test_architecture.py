"""The house, read by its imports (docs/architecture.md): layers bottom up, no circle, engine and format
knowledge in one home each, and the two paths the architecture promises, each walked once.

Layers: 0 the leaves (errors, dtypes, stop points, the formats' names, byte sizes); 1 ``layout``, ``formats/``,
``checkpoint/``; 2 what a checkpoint is (``variants``, ``inspection``, ``calibration``); 3 ``engines/``; 4 what
features share (``kernels/``, ``model/``, ``needle``, ``distributed``); 5 the features. An import may go down or
across, never up; features form no circle. A command line (a feature's ``cli.py``, ``synth_cli``,
``inspection_cli``) imports at its top only what its arguments show and the rest inside the function that runs
the command (tests/test_cli_startup.py checks that ``--help`` loads no torch): those imports are not counted as
hidden ones.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
from collections import defaultdict
from pathlib import Path

import pytest
import torch
import vllm_oracle

from dsv4convert import engines, formats, variants
from dsv4convert.checkpoint import Checkpoint
from dsv4convert.engines.config import servable_engines
from dsv4convert.formats import registry
from dsv4convert.inspection import inspect_checkpoint

PACKAGE = Path(__file__).resolve().parents[1] / "dsv4convert"
LAYERS = {"": 0, "errors": 0, "dtypes": 0, "stop_points": 0, "format_names": 0, "sizes": 0, "layout": 1, "formats": 1,
          "checkpoint": 1, "devices": 1, "variants": 2, "inspection": 2, "calibration": 2, "engines": 3, "kernels": 4, "model": 4,
          "needle": 4, "distributed": 4}
FEATURE = 5


def _module(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    path = PACKAGE.parent / name.replace(".", "/")
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _imports() -> dict[str, list[tuple[str, bool]]]:
    """Each module's imports of the package: (imported module, whether inside a function or class)."""
    found: dict[str, list[tuple[str, bool]]] = defaultdict(list)
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        inner = {id(n) for top in tree.body if isinstance(top, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
                 for n in ast.walk(top)}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("dsv4convert"):
                subs = [f"{node.module}.{a.name}" for a in node.names if _is_module(f"{node.module}.{a.name}")]
                targets = subs if len(subs) == len(node.names) else [node.module, *subs]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.startswith("dsv4convert")]
            else:
                continue
            found[_module(path)] += [(t, id(node) in inner) for t in targets]
    return found


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _layer(module: str) -> int:
    return LAYERS.get(_package(module), FEATURE)


def _is_command_line(module: str) -> bool:
    """A command's argument parser and the functions that run it (their imports load the implementation)."""
    return module.endswith((".cli", "_cli"))


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in list(graph):
        if v not in index:
            visit(v)
    return out


def test_imports_go_down_and_never_in_a_circle():
    imports = _imports()
    modules: dict[str, set[str]] = {m: {t for t, _ in ts if t != m} for m, ts in imports.items()}
    assert _cycles(modules) == [], "modules importing each other"
    packages: dict[str, set[str]] = defaultdict(set)
    for m, ts in modules.items():
        packages[_package(m)] |= {_package(t) for t in ts} - {_package(m)}
    assert _cycles(packages) == [], "packages importing each other"
    upward = sorted({(m, t) for m, ts in modules.items() for t in ts if _layer(m) < _layer(t)})
    assert len(upward) <= 1, upward
    inner = sorted(m for m, ts in imports.items() for _t, hidden in ts if hidden and not _is_command_line(m))
    assert len(inner) <= 10, inner


def test_format_dispatch_lives_in_the_registry():
    """Comparisons with ``Format.`` outside ``formats/`` and ``engines/``: at most 12 (the budget docs name)."""
    compare = re.compile(r"(==|is|!=) ?Format\.")
    outside = [f"{p.relative_to(PACKAGE.parent)}:{i}" for p in PACKAGE.rglob("*.py")
               if p.relative_to(PACKAGE).parts[0] not in ("formats", "engines")
               for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if compare.search(line)]
    assert len(outside) <= 12, outside


def test_engine_versions_are_written_once():
    """The pinned versions appear in code only in ``engines/`` (docstrings may cite them); the wheels CI installs
    are exactly those versions."""
    pattern = re.compile("|".join(re.escape(v) for v in engines.VERSIONS.values()))
    found = []
    for path in PACKAGE.rglob("*.py"):
        if path.relative_to(PACKAGE).parts[0] == "engines":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                      if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)) and n.body
                      and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        found += [f"{path.name}:{n.lineno}" for n in ast.walk(tree) if isinstance(n, ast.Constant)
                  and isinstance(n.value, str) and id(n) not in docstrings and pattern.search(n.value)]
    assert found == []
    assert importlib.metadata.version("sglang") == engines.VERSIONS[engines.SGLANG]
    assert vllm_oracle.VLLM_VERSION == engines.VERSIONS[engines.VLLM]


def test_variants_and_gpu_families_are_defined_once():
    """Every list of variants and GPU families the features show is the catalogue's."""
    from dsv4convert.convert.recipe import SHIPPED
    from dsv4convert.fit.source import SHIPPED as PLANNED
    from dsv4convert.inspection import VARIANTS
    from dsv4convert.serve.launch import SERVED_VARIANTS

    assert SHIPPED is variants.SHIPPED_RECIPES and PLANNED is variants.PLANNED and VARIANTS is variants.NAMES
    assert SERVED_VARIANTS is variants.SERVED
    assert sorted(g.family for g in engines.GPUS.values()) == sorted(engines.GPU_FAMILIES)   # one card per family


# ------------------------------------------------------------------------------------ "add a weight format"

@pytest.mark.parametrize("fmt", list(formats.Format))
def test_every_format_is_one_complete_spec(fmt, tiny_ckpt):
    """The first path of docs/architecture.md, checked for every format: its spec stores and recognises a linear,
    decodes what it encodes (from BF16, where a recipe may ask for it), the recipe schema offers it, and each
    engine has a verdict on routed experts stored in it (a MoE method, or a refusal naming the module), never a
    missing table entry. A format added without one of these fails here, by name."""
    from dsv4convert.convert.recipe import TARGETS
    from dsv4convert.engines.sglang.rules import EXPERT_METHOD

    spec = formats.spec(fmt)
    assert spec.format is fmt and spec.weight_params == tuple(p.suffix for p in spec.storage(256, 512))
    stored = {p.suffix: (p.dtype, p.shape) for p in spec.storage(256, 512)}
    found = formats.detect_format(stored, 256, 512)
    assert found is not None and found[0] is fmt
    assert set(spec.kernel_params) <= set(spec.weight_params)
    assert (fmt.value in TARGETS) == spec.recipe_target
    if spec.recipe_target:
        w = torch.randn(256, 512, generator=torch.Generator().manual_seed(0))
        source = {"weight": w.to(torch.bfloat16)}
        encoded = spec.encode(registry.EncodeInput(formats.Format.BF16, source, dict(spec.recipe_defaults), "m",
                                                   input_scale=torch.tensor(1.0)))
        assert [suffix for suffix, _ in encoded.tensors] == list(spec.weight_params)
        decoded = spec.decode(dict(encoded.tensors), "m")
        error = (decoded - source["weight"].float()).norm() / source["weight"].float().norm()
        assert error < 0.2, (fmt, float(error))
    assert fmt in EXPERT_METHOD
    ckpt = Checkpoint.open(tiny_ckpt)
    module_formats = {m.module: (m.format, m.params) for m in inspect_checkpoint(ckpt).modules.values()}
    experts = {m: (fmt, {"group_size": 32} if fmt is formats.Format.INT4 else {}) for m in module_formats
               if ".ffn.experts." in m and not m.startswith("mtp.")}
    verdicts = servable_engines(ckpt.config, {**module_formats, **experts})
    assert set(verdicts) == set(engines.ENGINES)
    assert all(v is None or ".ffn.experts." in v or "layers." in v for v in verdicts.values()), verdicts
