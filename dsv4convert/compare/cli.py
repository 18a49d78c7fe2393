"""``dsv4convert compare``: how far the model a variant serves is from the base, layer by layer."""

from __future__ import annotations

import argparse
from pathlib import Path

from dsv4convert.convert.plan import human_bytes


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "compare",
        help="model-level fidelity of a variant against its base, with the numerics the server runs",
        description=(
            "Streams the base and the variant through transformers' DeepSeek-V4 layers in lockstep, one block "
            "at a time on one device (long inputs in query chunks through each layer's cache), each side "
            "with the numerics its SGLang server computes with (--numerics served: W8A8 dense linears, the "
            "routed experts' W4A4/W4A8/W8A8 activations, the FP8 KV cache, the FP8/FP4 indexer, per GPU "
            "family and MoE runner, as `dsv4convert serve` would launch it) or weights only. Reports "
            "llama.cpp's KLD set (mean +- SE, percentiles), same top-1, delta-p, perplexity ratio, "
            "expected acceptance, the MTP draft's agreement, and per block the free-running and local "
            "error. Writes compare.json, compare.md and PNGs; exits 1 above --fail-above-kld, 2 on bad input."
        ),
    )
    p.add_argument("--base", required=True, metavar="SRC", help="the checkpoint the variant was made from")
    p.add_argument("--variant", required=True, metavar="DST", help="the checkpoint to judge")
    data = p.add_argument_group("data (nothing is downloaded: bring the text)")
    data.add_argument("--text", type=Path, action="append", default=[], metavar="FILE",
                      help="UTF-8 text, or JSONL with a \"text\" field; repeatable; tokenized with the base's tokenizer")
    data.add_argument("--random-tokens", action="store_true",
                      help="uniform random token ids instead of text (synthetic models and smoke tests only: "
                           "a real model's KLD on random ids says little)")
    data.add_argument("--tokens", type=int, default=65536, help="evaluation tokens (default: 65536)")
    data.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence (default: 4096)")
    num = p.add_argument_group("numerics")
    num.add_argument("--numerics", choices=("served", "weights"), default="served",
                     help="served: what the server computes with (default); weights: stored weights only, "
                          "activations as computed")
    num.add_argument("--base-numerics", choices=("served", "weights"),
                     help="the base side's numerics, when they should differ from --numerics (e.g. weights: "
                          "the base as an ideal reference)")
    num.add_argument("--engine", choices=("sglang",), default="sglang")
    num.add_argument("--gpu-family", choices=("sm90", "sm100", "sm120"), default="sm120",
                     help="the GPUs the variant is served on (default: sm120, RTX PRO 6000 Blackwell)")
    num.add_argument("--moe-runner-backend", metavar="B",
                     help="SGLang's --moe-runner-backend, where you serve with another than `serve` picks")
    num.add_argument("--fp4-indexer", action="store_true",
                     help="as SGLang's --enable-deepseek-v4-fp4-indexer (sm100/sm120)")
    run = p.add_argument_group("running")
    run.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: cpu)")
    run.add_argument("--dtype", choices=("bfloat16", "float32"),
                     help="compute dtype (default: bfloat16 on a GPU, float32 on the CPU)")
    run.add_argument("--chunk", type=int, default=2048,
                     help="queries per layer forward, through the layer's cache (default: 2048)")
    run.add_argument("--batch-size", type=int, default=1, help="sequences per forward (default: 1)")
    run.add_argument("--no-mtp", action="store_true", help="skip the MTP draft block")
    run.add_argument("--seed", type=int, default=0, help="seed of --random-tokens")
    p.add_argument("--report", type=Path, metavar="DIR", help="report directory (default: VARIANT-compare beside it)")
    p.add_argument("--fail-above-kld", type=float, metavar="X", help="exit 1 if the mean KLD is above X nats")
    p.add_argument("--dry-run", action="store_true",
                   help="check both checkpoints and the data, print the plan and the estimated memory, run nothing")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=_run)


def _options(args: argparse.Namespace):
    from dsv4convert.compare.run import CompareOptions

    return CompareOptions(
        base=args.base, variant=args.variant, texts=list(args.text), random_tokens=args.random_tokens,
        tokens=args.tokens, seq_len=args.seq_len, numerics=args.numerics, base_numerics=args.base_numerics,
        engine=args.engine, gpu_family=args.gpu_family, moe_runner_backend=args.moe_runner_backend,
        fp4_indexer=args.fp4_indexer, device=args.device, dtype=args.dtype, chunk=args.chunk,
        batch_size=args.batch_size, mtp=not args.no_mtp, seed=args.seed, progress=not args.no_progress)


def print_plan(plan) -> None:
    e = plan.estimate
    blocks = plan.base.side.inspection.config.block_prefixes()
    if not plan.options.mtp:
        blocks = [b for b in blocks if b.startswith("layers.")]
    print(f"plan: {plan.variant.side.ckpt.root} ({plan.variant.side.inspection.variant}) against "
          f"{plan.base.side.ckpt.root} ({plan.base.side.inspection.variant})")
    print(f"  data: {plan.data['sequences']} sequences x {plan.data['seq_len']} tokens from {plan.data['source']}")
    print(f"  blocks: {len(blocks)} ({blocks[0]} .. {blocks[-1]}), each read and run once per side; the variant's "
          "twice (its own input and the base's)")
    for side in (plan.base, plan.variant):
        n = side.numerics.describe()
        serving = n["serving"] or {}
        print(f"  {side.label}: {n['label']}; {serving.get('engine')} {serving.get('gpu_family')}, MoE runner "
              f"{serving.get('moe_runner_backend')}, dense FP8 activation scales "
              f"{serving.get('dense_fp8_activation_scales')}, wo_a {serving.get('wo_a')}")
    print(f"  device {plan.device} ({str(plan.dtype).replace('torch.', '')}), chunk {e['chunk']} queries: "
          f"estimated peak device memory {human_bytes(e['peak_device_bytes'])} (largest layer "
          f"{human_bytes(e['largest_layer_bytes'])}), host memory {human_bytes(e['peak_host_bytes'])}, "
          f"reads {human_bytes(e['bytes_to_read'])}")
    print("dry run: nothing run")


def _run(args: argparse.Namespace) -> int:
    from dsv4convert.compare.report import write_reports
    from dsv4convert.compare.run import build_plan, run

    plan = build_plan(_options(args))
    if args.dry_run:
        print_plan(plan)
        return 0
    result = run(plan)
    root = plan.variant.side.ckpt.root
    out_dir = args.report or root.parent / f"{root.name}-compare"
    write_reports(result, Path(out_dir))
    o = result["output"]
    print(f"{args.variant} vs {args.base}: mean KLD {o['kld']['mean']:.6g} \u00b1 {o['kld']['standard_error']:.2g} "
          f"nats, same top-1 {100 * o['same_top1']:.2f}%, perplexity ratio {o['perplexity']['ratio']:.4f}, "
          f"expected acceptance {100 * o['expected_acceptance']:.2f}% ({o['positions']} positions)")
    for label, blocks in result["mtp_draft_agreement"].items():
        for block, value in blocks.items():
            print(f"  MTP {block} draft agreement ({label}): {100 * value:.2f}%")
    print(f"report: {Path(out_dir) / 'compare.md'}")
    if args.fail_above_kld is not None and o["kld"]["mean"] > args.fail_above_kld:
        print(f"compare: mean KLD {o['kld']['mean']:.6g} is above --fail-above-kld {args.fail_above_kld}")
        return 1
    return 0
