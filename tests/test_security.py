"""Safety rules that hold for the whole package: no pickle, no remote code."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "dsv4convert"


def _calls(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            yield node, name


def test_no_pickle_and_no_remote_code_anywhere_in_the_package():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                if any(n.split(".")[0] in ("pickle", "dill", "cloudpickle", "joblib") for n in names):
                    offenders.append(f"{path}:{node.lineno}: imports a pickle library")
        for node, name in _calls(tree):
            if name == "load" and isinstance(node.func, ast.Attribute) and getattr(node.func.value, "id", "") == "torch":
                offenders.append(f"{path}:{node.lineno}: torch.load unpickles")
            for kw in node.keywords:
                if kw.arg == "trust_remote_code" and not (isinstance(kw.value, ast.Constant) and kw.value.value is False):
                    offenders.append(f"{path}:{node.lineno}: trust_remote_code")
        if "--trust-remote-code" in path.read_text():
            offenders.append(f"{path}: passes --trust-remote-code to a server")
    assert not offenders, "\n".join(offenders)


def test_generated_server_commands_never_trust_remote_code(tmp_path):
    from dsv4convert.serve.launch import LaunchOptions, server_settings

    for variant in ("native", "fp8", "nvfp4", "w4a16", "bf16"):
        options = LaunchOptions(model=str(tmp_path), variant=variant, gpu_family="sm90")
        for role in ("prefill", "decode", "server"):
            assert "--trust-remote-code" not in server_settings(options, role, 4, 30000, 29100).argv()
