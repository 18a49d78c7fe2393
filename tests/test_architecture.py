"""The house, read by its imports (docs/architecture.md): layers bottom up, no circle, engine and format
knowledge in one home each, and the two paths the architecture promises, each walked once.

Layers: 0 the leaves (errors, dtypes, stop points, the formats' names, byte sizes); 1 ``models/`` (each release), ``formats/``,
``checkpoint/``; 2 what a checkpoint is (``variants``, ``inspection``, ``calibration``); 3 ``engines/``; 4 what
features share (``kernels/``, ``model/``, ``needle``, ``distributed``); 5 the features. An import may go down or
across, never up; features form no circle. A command line (a feature's ``cli.py``, ``synth_cli``,
``inspection_cli``) imports at its top only what its arguments show and the rest inside the function that runs
the command (tests/test_cli_startup.py checks that ``--help`` loads no torch): those imports are counted apart.
Relative imports are resolved to the modules they name before any of this is checked. Every number below is
today's count, a limit: a change that adds one fails here, and docs/architecture.md states the same numbers.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
from collections import Counter, defaultdict
from pathlib import Path

import pytest
import torch
import vllm_oracle

from dsv4convert import engines, formats, variants
from dsv4convert.checkpoint import Checkpoint
from dsv4convert.engines.config import servable_engines
from dsv4convert.formats import registry
from dsv4convert.inspection import inspect_checkpoint
from dsv4convert.models.deepseek_v4.names import DSparkNames

PACKAGE = Path(__file__).resolve().parents[1] / "dsv4convert"
LAYERS = {"": 0, "errors": 0, "dtypes": 0, "stop_points": 0, "format_names": 0, "sizes": 0, "models": 1, "formats": 1,
          "checkpoint": 1, "devices": 1, "variants": 2, "inspection": 2, "calibration": 2, "engines": 3, "kernels": 4, "model": 4,
          "needle": 4, "distributed": 4}
FEATURE = 5
# Today's counts, as limits (docs/architecture.md states them): imports of the package inside functions outside
# the command lines (kernels/ loads Triton's launchers when a kernel first runs), the same inside the command
# lines (what a command loads when it runs), and comparisons with a Format member outside formats/ and engines/.
HIDDEN_IMPORTS = 2
COMMAND_IMPORTS = 84   # automix/cli.py: the V4.1 path (automix/v41.py)
FORMAT_COMPARISONS = 15

def _module(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    path = PACKAGE.parent / name.replace(".", "/")
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _absolute(path: Path, node: ast.ImportFrom) -> str | None:
    """The module an ``ImportFrom`` names, ``from . import x`` and ``from ..x import y`` resolved against the
    importing module's package (a relative import of the package is still an import of it)."""
    if not node.level:
        return node.module
    package = _module(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def _imports() -> dict[str, list[tuple[str, bool]]]:
    """Each module's imports of the package: (imported module, whether inside a function or class)."""
    found: dict[str, list[tuple[str, bool]]] = defaultdict(list)
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        inner = {id(n) for top in tree.body if isinstance(top, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
                 for n in ast.walk(top)}
        for node in ast.walk(tree):
            source = _absolute(path, node) if isinstance(node, ast.ImportFrom) else None
            if source and source.split(".")[0] == "dsv4convert":
                subs = [f"{source}.{a.name}" for a in node.names if _is_module(f"{source}.{a.name}")]
                targets = subs if len(subs) == len(node.names) else [source, *subs]
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
    assert upward == []
    inner = sorted((m, t) for m, ts in imports.items() for t, hidden in ts if hidden and not _is_command_line(m))
    assert len(inner) <= HIDDEN_IMPORTS, inner
    in_commands = Counter(m for m, ts in imports.items() for _t, hidden in ts if hidden and _is_command_line(m))
    assert sum(in_commands.values()) <= COMMAND_IMPORTS, in_commands


def test_the_docs_state_these_limits():
    """docs/architecture.md says the numbers this file asserts."""
    text = " ".join((PACKAGE.parent / "docs" / "architecture.md").read_text(encoding="utf-8").split())
    for said in (f"at most {HIDDEN_IMPORTS} imports of the package hide inside functions",
                 f"are counted apart: at most {COMMAND_IMPORTS}.", f"at most {FORMAT_COMPARISONS} comparisons with"):
        assert said in text, said


def test_relative_imports_are_resolved_before_the_layers_are_read(tmp_path):
    """``from . import x`` and ``from ..x import y`` name the modules they import, so the checks above see them."""
    def resolved(path: str, code: str) -> str | None:
        return _absolute(PACKAGE / path, ast.parse(code).body[0])

    assert resolved("formats/specs.py", "from . import registry") == "dsv4convert.formats"
    assert resolved("formats/__init__.py", "from .registry import Format") == "dsv4convert.formats.registry"
    assert resolved("formats/specs.py", "from ..engines import GPUS") == "dsv4convert.engines"
    assert resolved("engines/sglang/rules.py", "from ...fit import cli") == "dsv4convert.fit"
    assert resolved("formats/specs.py", "from dsv4convert import layout") == "dsv4convert"


def _on_format(node: ast.AST) -> bool:
    """``Format.X`` or ``formats.Format.X``: a member of the formats' enum."""
    return isinstance(node, ast.Attribute) and (
        (isinstance(node.value, ast.Name) and node.value.id == "Format")
        or (isinstance(node.value, ast.Attribute) and node.value.attr == "Format"))


def test_format_dispatch_lives_in_the_registry():
    """Comparisons with a ``Format`` member outside ``formats/`` and ``engines/`` (``==``, ``is not``, ``in``,
    ``== {Format.X}``, any operator, the member anywhere in an operand): at most today's count."""
    outside = [f"{p.relative_to(PACKAGE.parent)}:{n.lineno}" for p in PACKAGE.rglob("*.py")
               if p.relative_to(PACKAGE).parts[0] not in ("formats", "engines")
               for n in ast.walk(ast.parse(p.read_text(encoding="utf-8"))) if isinstance(n, ast.Compare)
               and any(_on_format(x) for operand in (n.left, *n.comparators) for x in ast.walk(operand))]
    assert len(outside) <= FORMAT_COMPARISONS, outside


def test_format_comparisons_are_found_however_written():
    """The count above sees every spelling the old line pattern missed."""
    spellings = ["a is not Format.BF16", "Format.FP8 in formats", "kinds == {Format.NVFP4}",
                 "f in (Format.FP8, Format.BF16)", "x.fmt != formats.Format.INT4"]
    found = [any(_on_format(x) for operand in (n.left, *n.comparators) for x in ast.walk(operand))
             for code in spellings for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Compare)]
    assert found == [True] * len(spellings)
    assert not any(_on_format(n) for n in ast.walk(ast.parse("fmt == spec.format")))


# ------------------------------------------------------------------------------ the FP8 block is the release's

_FP8_BLOCK_NAME = re.compile(r"FP8_(BLOCK|TILE)")
# Each FP8 kernel and the constexprs it takes its block (or, for the activations, the block's columns) as.
FP8_KERNELS = {
    "kernels/triton_fp8_gemm.py": {"fp8_block_gemm_kernel": ("WEIGHT_BLOCK_N", "WEIGHT_BLOCK_K"),
                                   "act_quant_kernel": ("GROUP",)},
    "kernels/triton_kernels.py": {"dequant_fp8_kernel": ("WEIGHT_BLOCK_N", "WEIGHT_BLOCK_K")},
    "kernels/triton_quantize.py": {"fp8_block_quant_kernel": ("WEIGHT_BLOCK_N", "WEIGHT_BLOCK_K"),
                                   "mxfp4_to_fp8_block_kernel": ("WEIGHT_BLOCK_N", "WEIGHT_BLOCK_K")},
}


def _fp8_block_names(tree: ast.AST) -> list[tuple[int, str]]:
    """Names matching ``FP8_BLOCK``/``FP8_TILE`` a module defines (assigned) or imports."""
    found = []
    for n in ast.walk(tree):
        if isinstance(n, (ast.Assign, ast.AnnAssign)):
            targets = n.targets if isinstance(n, ast.Assign) else [n.target]
            found += [(n.lineno, t.id) for target in targets for t in ast.walk(target) if isinstance(t, ast.Name)]
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            found += [(n.lineno, name) for a in n.names for name in (a.name, a.asname) if name]
    return [(line, name) for line, name in found if _FP8_BLOCK_NAME.search(name)]


def test_the_fp8_block_is_the_releases():
    """#52: the FP8 block is a release's answer (``models/<release>/release.py::fp8_block``), handed to formats,
    kernels, tune and engines as a parameter: no module outside ``models/`` defines or imports an
    ``FP8_BLOCK``-style constant, and each FP8 kernel takes its block as a ``tl.constexpr`` with no literal 128."""
    outside = [f"{p.relative_to(PACKAGE.parent)}:{line} {name}" for p in PACKAGE.rglob("*.py")
               if p.relative_to(PACKAGE).parts[0] != "models"
               for line, name in _fp8_block_names(ast.parse(p.read_text(encoding="utf-8")))]
    assert outside == [], outside
    assert _fp8_block_names(ast.parse("from x import FP8_BLOCK\nSAFE_FP8_TILE = 1\nFP8 = 2")) == [
        (1, "FP8_BLOCK"), (2, "SAFE_FP8_TILE")]
    for path, kernels in FP8_KERNELS.items():
        tree = ast.parse((PACKAGE / path).read_text(encoding="utf-8"))
        defs = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name in kernels}
        assert set(defs) == set(kernels), path
        for name, block_params in kernels.items():
            constexprs = {a.arg for a in defs[name].args.args
                          if a.annotation is not None and ast.unparse(a.annotation) == "tl.constexpr"}
            assert set(block_params) <= constexprs, (path, name, constexprs)
            literals = [n.lineno for n in ast.walk(defs[name]) if isinstance(n, ast.Constant) and n.value == 128]
            assert literals == [], (path, name, literals)


def _gpu_family_lists(tree: ast.AST) -> list[int]:
    """Lines of a tuple, list or set of strings naming two or more GPU families: a list of choices."""
    return [n.lineno for n in ast.walk(tree) if isinstance(n, (ast.Tuple, ast.List, ast.Set))
            and len({e.value for e in n.elts if isinstance(e, ast.Constant)} & set(engines.GPU_FAMILIES)) >= 2]


def test_gpu_families_are_listed_only_in_engines():
    """No module outside ``engines/`` writes the GPU families out as choices: they read ``GPU_FAMILIES``."""
    found = [f"{p.relative_to(PACKAGE).as_posix()}:{line}" for p in sorted(PACKAGE.rglob("*.py"))
             if p.relative_to(PACKAGE).parts[0] != "engines"
             for line in _gpu_family_lists(ast.parse(p.read_text(encoding="utf-8")))]
    assert found == []
    assert _gpu_family_lists(ast.parse('choices=("sm90", "sm100", "sm120")')) != []


def test_a_default_gpu_family_is_written_once():
    """Outside ``engines/`` a family is named alone in two defaults, each once: the numerics compare, automix and
    the demo emulate (``compare.DEFAULT_GPU_FAMILY``), and the rules ``fit`` applies to a GPU given as a size."""
    found = sorted(path for path, tree in _outside("engines") for n in _code_strings(tree)
                   if n.value in engines.GPU_FAMILIES)
    assert found == ["compare/__init__.py", "fit/verdict.py"]



def _code_strings(tree: ast.AST) -> list[ast.Constant]:
    """The string constants of a module that are code, not prose: every one but a statement of its own (a
    docstring, a bare string), f-strings' pieces included."""
    prose = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    return [n for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in prose]


def _outside(*homes: str) -> list[tuple[str, ast.AST]]:
    return [(p.relative_to(PACKAGE).as_posix(), ast.parse(p.read_text(encoding="utf-8")))
            for p in sorted(PACKAGE.rglob("*.py")) if p.relative_to(PACKAGE).parts[0] not in homes]


def _release_names(tree: ast.AST) -> list[int]:
    """Lines of code strings that write a DSpark module's name (``DSparkNames.LOCAL``: ``main_proj``,
    ``markov_head``, vLLM's ``markov_w1``...) or build a draft block's name (``"mtp."``, ``"mtp.0"``)."""
    return [n.lineno for n in _code_strings(tree)
            if any(local in n.value for local in DSparkNames.LOCAL) or re.fullmatch(r"mtp\.\d*", n.value)]


def test_model_types_are_read_only_by_the_releases():
    """A feature asks ``models/registry.py`` which release a config is; no code outside ``models/`` reads or
    compares ``model_type`` (the engines' rules need none: they are keyed by release)."""
    found = [f"{path}:{n.lineno}" for path, tree in _outside("models") for n in _code_strings(tree)
             if n.value == "model_type"]
    assert found == []
    caught = [n.lineno for code in ('if c.get("model_type") == "deepseek_v4": pass', 'ok = cfg["model_type"] in K')
              for n in _code_strings(ast.parse(code)) if n.value == "model_type"]
    assert caught == [1, 1]
    assert not _code_strings(ast.parse('def f():\n    """Reads model_type."""'))


def test_dspark_names_are_written_only_by_the_release_and_the_engines():
    """DSpark's module names and the draft blocks' are the release's (``models/deepseek_v4/layout.py``
    ``DSparkNames``, ``draft_block``, ``in_draft``); features ask them, and the model's own modules (``model/``),
    whose attributes mirror SGLang's (``main_proj``, ``markov_w1``), read their parameter paths off the modules
    themselves. Docstrings and comments may name them."""
    found = [f"{path}:{line}" for path, tree in _outside("models", "engines") for line in _release_names(tree)]
    assert found == []
    written = ['x = f"mtp.{i}.ffn"', 'n = "mtp.0"', 'set_tensor(head, "markov_w1.weight", w)',
               'name = f"{last}.confidence_head.proj"', 'a = b.startswith("mtp.")']
    assert [len(_release_names(ast.parse(code))) for code in written] == [1] * len(written)
    assert _release_names(ast.parse('"""The stage\'s main_proj under mtp.0."""\nhelp = "the drafter under mtp.*"')) == []

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
    for block in ((128, 128), (32, 32)):   # DeepSeek-V4's FP8 block and V4.1's: detection reads it off the shapes
        stored = {p.suffix: (p.dtype, p.shape) for p in spec.storage(256, 512, fp8_block=block)}
        assert spec.weight_params == tuple(stored)
        found = formats.detect_format(stored, 256, 512)
        assert found is not None and found[0] is fmt and found[1].get("fp8_block", block) == block
    assert set(spec.kernel_params) <= set(spec.weight_params)
    assert (fmt.value in TARGETS) == spec.recipe_target
    if spec.recipe_target:
        w = torch.randn(256, 512, generator=torch.Generator().manual_seed(0))
        source = {"weight": w.to(torch.bfloat16)}
        params = {**spec.recipe_defaults, "fp8_block": (32, 32)}
        encoded = spec.encode(registry.EncodeInput(formats.Format.BF16, source, params, "m",
                                                   input_scale=torch.tensor(1.0)))
        assert [suffix for suffix, _ in encoded.tensors] == list(spec.weight_params)
        decoded = spec.decode(dict(encoded.tensors), "m", params)
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
