"""The tuned-config folder: SGLang's shipped configs plus the tuned files, where SGLang looks.

``SGLANG_MOE_CONFIG_DIR`` *replaces* SGLang's shipped folder (``<DIR>/configs/triton_X_Y_Z/``),
so the folder starts as a copy of every file SGLang ships, and the tuned files go into the
folder of the Triton that tuned them, replacing a shipped file of the same name. A new folder
is built under a temporary name and renamed when complete; adding to an existing one writes
each file atomically and the manifest (``dsv4convert-tune.json``, what was tuned, for which
model, from which SGLang) last. This module imports neither torch nor SGLang (``serve`` uses it).
"""

from __future__ import annotations

import json
import os
import shutil
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as dist_version
from pathlib import Path

from dsv4convert.checkpoint import atomic_write_json
from dsv4convert.tune.problem import TuneError

MANIFEST = "dsv4convert-tune.json"
MANIFEST_FORMAT = "dsv4convert.tune/1"
CONFIG_DIR_ENV = "SGLANG_MOE_CONFIG_DIR"


def read_manifest(folder: Path) -> dict | None:
    path = folder / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise TuneError(f"unreadable tune manifest: {exc}", file=path) from None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise TuneError(f"not a {MANIFEST_FORMAT} manifest", file=path)
    return manifest


def check_destination(out: Path, sglang_version: str) -> dict | None:
    """Refuse an ``--out`` that tune cannot write (before any work); the existing manifest, if any."""
    if out.exists() and not out.is_dir():
        raise TuneError("exists and is not a folder; --out names the folder to write", file=out)
    if not out.exists() or not any(out.iterdir()):
        return None
    manifest = read_manifest(out)
    if manifest is None:
        raise TuneError(f"exists, is not empty and is not a tune folder (no {MANIFEST}); choose another --out",
                        file=out)
    if manifest.get("sglang") != sglang_version:
        raise TuneError(f"holds SGLang {manifest.get('sglang')}'s shipped configs, and SGLang {sglang_version} is "
                        "installed here; write to a new --out", file=out)
    return manifest


def write_tuned(out: Path, *, shipped_configs: Path, files: dict[str, dict[int, dict]], entries: dict[str, dict],
                sglang_version: str, triton_version: str) -> list[Path]:
    """Write ``files`` ({"triton_X_Y_Z/<SGLang's name>": {batch size: config}}) into ``out``, merged with
    the shipped configs; ``entries`` say how each was made. Returns the written files' paths."""

    manifest = check_destination(out, sglang_version)
    fresh = manifest is None
    root = out.with_name(f".{out.name}.partial-{os.getpid()}") if fresh else out
    if fresh:
        shutil.rmtree(root, ignore_errors=True)
        try:
            shutil.copytree(shipped_configs, root / "configs")
        except OSError as exc:
            shutil.rmtree(root, ignore_errors=True)
            raise TuneError(f"cannot copy SGLang's shipped configs from {shipped_configs}: {exc}", file=out) from None
        manifest = {"format": MANIFEST_FORMAT, "sglang": sglang_version, "shipped_from": str(shipped_configs),
                    "shipped_files": sum(1 for p in (root / "configs").rglob("*") if p.is_file()), "tuned": {}}
    written = []
    try:
        for relative, table in files.items():
            path = root / "configs" / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            key = f"configs/{relative}"
            previous = manifest["tuned"].get(key)
            merged: dict[int, dict] = {}
            if previous is not None and path.is_file():  # our own earlier tune of this file: keep other sizes
                merged = {int(m): cfg for m, cfg in json.loads(path.read_text()).items()}
            replaced_shipped = previous["replaced_shipped"] if previous else path.is_file()
            merged.update(table)
            atomic_write_json(path, {str(m): merged[m] for m in sorted(merged)})
            manifest["tuned"][key] = {**entries[relative], "triton": triton_version,
                                      "batch_sizes": sorted(merged), "replaced_shipped": replaced_shipped}
            written.append(out / "configs" / relative)
        atomic_write_json(root / MANIFEST, manifest)
        if fresh:
            if out.exists():
                out.rmdir()  # empty (checked above)
            os.replace(root, out)
    except BaseException as exc:
        if fresh:
            shutil.rmtree(root, ignore_errors=True)
        if isinstance(exc, OSError):
            raise TuneError(f"cannot write the tuned configs: {exc.strerror or exc}", file=exc.filename or out) from None
        raise
    return written


def write_log(out: Path, up_file: str, log: dict) -> Path:
    """Every candidate of a tune (config, status, time, difference from the default) and the comparison,
    as ``tune-logs/<the up file's name>``: why the written configs were chosen."""

    path = out / "tune-logs" / Path(up_file).name
    path.parent.mkdir(exist_ok=True)
    atomic_write_json(path, log)
    return path


def shipped_files(configs: Path) -> set[str]:
    """Every file under a ``configs/`` folder, relative to it."""
    return {str(p.relative_to(configs)) for p in configs.rglob("*") if p.is_file()}


def tuned_config_env(folder: Path) -> tuple[dict[str, str], list[str]]:
    """``SGLANG_MOE_CONFIG_DIR`` for servers, after checking SGLang's lookup can use ``folder``
    (it lists ``<folder>/configs`` on every miss, and fails without it); and warnings."""
    configs = folder / "configs"
    if not configs.is_dir() or not any(p.is_dir() and p.name.startswith("triton_") for p in configs.iterdir()):
        raise TuneError("no configs/triton_*/ folder inside: SGLang's MoE config lookup would fail on it "
                        "(make one with `dsv4convert tune --out DIR`)", file=folder)
    warnings = []
    manifest = read_manifest(folder)
    try:
        installed = dist_version("triton")
    except PackageNotFoundError:
        installed = None
    tuned_with = {entry.get("triton") for entry in (manifest or {}).get("tuned", {}).values()} - {None}
    if installed and tuned_with and installed not in tuned_with:
        warnings.append(f"{folder}: configs were tuned with Triton {', '.join(sorted(tuned_with))} and Triton "
                        f"{installed} is installed here; SGLang falls back to them with a warning, but tile "
                        "speeds change between Triton versions: retune")
    return {CONFIG_DIR_ENV: str(folder.resolve())}, warnings
