"""``dsv4convert inspect``: the command line (what a checkpoint is, :mod:`dsv4convert.inspection`, loads when the
command runs)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dsv4convert.errors import CheckpointError


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "inspect",
        help="identify a checkpoint's variant and check it against the DeepSeek-V4 layout",
        description=(
            "Print which variant a checkpoint is (native FP8+MXFP4, fp8, nvfp4, w4a16, bf16 or mixed), a "
            "table per role (tensors, bytes, dtypes), the format of every module role, and whatever is "
            "missing, unexpected or of the wrong dtype/shape. With --config and --expected, print the "
            "native inventory a config implies, without any weights (to plan disk)."
        ),
    )
    p.add_argument("src", nargs="?", help="checkpoint directory or Hugging Face repo id")
    p.add_argument("--config", type=Path, help="config.json (with --expected)")
    p.add_argument("--expected", action="store_true", help="print the expected native inventory of --config")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from dsv4convert.checkpoint import Checkpoint, read_small_json
    from dsv4convert.inspection import check_routing, describe_drafter, expected_report, inspect_checkpoint, role_table
    from dsv4convert.inspection_v41 import inspect_v41, is_v41_checkpoint

    if args.expected:
        if not args.config:
            raise CheckpointError("--expected needs --config CONFIG")
        report = expected_report(read_small_json(args.config), str(args.config))
        if args.json:
            print(json.dumps(report))
        else:
            print(f"expected native inventory of {args.config}: {report['tensor_count']:,} tensors, "
                  f"{report['total_bytes']:,} bytes in {len(report['shard_bytes'])} layout groups; "
                  f"{report['drafter_description']}")
            _print_table(report["roles"])
        return 0
    if not args.src:
        raise CheckpointError("inspect needs a checkpoint (or --config CONFIG --expected)")
    ckpt = Checkpoint.open(args.src)
    if is_v41_checkpoint(ckpt):
        return _print_v41(inspect_v41(ckpt), args.json)
    check_routing(ckpt)
    result = inspect_checkpoint(ckpt)
    entries = [(n, e.dtype, e.shape, e.nbytes) for n, e in ckpt.tensors.items()]
    if args.json:
        print(json.dumps({
            "source": str(ckpt.root),
            "variant": result.variant,
            "drafter": result.drafter,
            "ok": result.ok,
            "tensor_count": len(result.tensors),
            "total_bytes": ckpt.total_bytes,
            "formats_by_role": result.formats_by_role(),
            "roles": role_table(entries),
            "missing": result.missing,
            "unexpected": result.unexpected,
            "mismatched": result.mismatched,
            "problems": result.problems,
            "tensors": result.tensors,
        }))
    else:
        print(f"{ckpt.root}: variant {result.variant}, {len(result.tensors):,} tensors, "
              f"{ckpt.total_bytes:,} bytes in {len(ckpt.shards)} shard(s); {describe_drafter(result.config)}")
        _print_table(role_table(entries))
        print("\nformats by role:")
        for role, fmts in result.formats_by_role().items():
            print(f"  {role:28s} " + ", ".join(f"{f} x{c}" for f, c in sorted(fmts.items())))
        unexpected = [f"{name}: {why}" if (why := result.why_unexpected(name)) else name for name in result.unexpected]
        for title, items in (("missing", result.missing), ("unexpected", unexpected),
                             ("mismatched", result.mismatched), ("problems", result.problems)):
            if items:
                print(f"\n{title} ({len(items)}):")
                for item in items[:20]:
                    print(f"  {item}")
                if len(items) > 20:
                    print(f"  ... and {len(items) - 20} more (see --json)")
        if result.ok:
            print("\nlayout check: OK")
    return 0 if result.ok else 1


def _print_v41(report: dict, as_json: bool) -> int:
    """A V4.1 checkpoint's report (:func:`dsv4convert.inspection_v41.inspect_v41`): 0 when its layout holds."""
    if as_json:
        print(json.dumps(report))
        return 0 if report["ok"] else 1
    print(f"{report['source']}: {report['release']}, variant {report['variant']}, {report['tensor_count']:,} tensors, "
          f"{report['total_bytes']:,} bytes in {report['shards']} shard(s), of which Engram tables "
          f"{report['engram_table_bytes']:,}; {report['drafter_description']}")
    _print_table(report["roles"])
    if report["problems"]:
        print(f"\nproblems ({len(report['problems'])}):")
        for item in report["problems"][:20]:
            print(f"  {item}")
        if len(report["problems"]) > 20:
            print(f"  ... and {len(report['problems']) - 20} more (see --json)")
    else:
        print(f"\nlayout check: OK (every tensor of a DeepSeek-V4.1 {report['variant']} checkpoint, nothing else)")
    return 0 if report["ok"] else 1


def _print_table(rows: list[dict]) -> None:
    print(f"{'role':28s} {'tensors':>8s} {'bytes':>16s}  dtypes")
    for r in rows:
        dts = ", ".join(f"{d} x{c}" for d, c in sorted(r["dtypes"].items()))
        print(f"{r['role']:28s} {r['tensors']:8d} {r['bytes']:16,d}  {dts}")
    print(f"{'total':28s} {sum(r['tensors'] for r in rows):8d} {sum(r['bytes'] for r in rows):16,d}")
