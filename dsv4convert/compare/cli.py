"""``dsv4convert compare``: how far the model a variant serves is from the base, layer by layer."""

from __future__ import annotations

import argparse
from pathlib import Path

from dsv4convert.compare import DEFAULT_ANCHORS, DEFAULT_GPU_FAMILY
from dsv4convert.engines import GPU_FAMILIES, family_label
from dsv4convert.errors import DSV4Error
from dsv4convert.compare.dspark_lines import dspark_plan_lines, dspark_result_lines
from dsv4convert.sizes import human_bytes


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
            "error. Writes compare.json, compare.md and PNGs; exits 1 above --fail-above-kld, 2 on bad input. "
            "DeepSeek-V4.1 checkpoints run through V4.1's own forward one layer at a time, with the part that moved "
            "the output named (Engram, a KV source's compressor, the candidate-level or a fine indexer, attention, "
            "experts) and their DSpark drafter's draft fidelity as for 0731; --recall there says which indexer level "
            "kept the needle (docs/compare.md)."
        ),
    )
    p.add_argument("--base", required=True, metavar="SRC", help="the checkpoint the variant was made from")
    p.add_argument("--variant", required=True, metavar="DST", help="the checkpoint to judge")
    data = p.add_argument_group("data (nothing is downloaded: bring the text)")
    data.add_argument("--text", type=Path, action="append", default=[], metavar="FILE",
                      help="UTF-8 text, or JSONL with a \"text\" field; repeatable; tokenized with the base's tokenizer "
                           "(default: the base's own heldout.txt when it ships one, as the organism does)")
    data.add_argument("--random-tokens", action="store_true",
                      help="uniform random token ids instead of text (synthetic models and smoke tests only: "
                           "a real model's KLD on random ids says little)")
    data.add_argument("--tokens", type=int, default=65536, help="evaluation tokens (default: 65536)")
    data.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence (default: 4096)")
    rec = p.add_argument_group("recall (needle prompts instead of text; docs/compare.md)")
    rec.add_argument("--recall", action="store_true",
                     help="needle retrieval (teacher-forced) and the indexer's top-k, base against variant, with a "
                          "noise floor (the base in other query chunks)")
    rec.add_argument("--lengths", type=_lengths, metavar="L,L,...",
                     help="prompt lengths in tokens, K = 1024 (default: straddling the checkpoint's selection "
                          "threshold 4*index_topk + 4, the first length whose answer query leaves an entry out, "
                          "to 64x it, every residue mod 4)")
    rec.add_argument("--depths", type=_depths, default=None, metavar="D,D,...",
                     help="needle depths within the haystack, 0..1 (default: 0.1,0.5,0.9)")
    rec.add_argument("--trials", type=int, default=1, help="needles per (length, depth) (default: 1)")
    rec.add_argument("--local", action="store_true",
                     help="also run the variant's blocks on the base's input: each layer's own top-k overlap and "
                          "error (one more forward per block; plain compare always does)")
    rec.add_argument("--noise-floor", choices=("per-length", "all"), default=None,
                     help="the prompts the noise floor runs: per-length (default: one prompt per length, the middle "
                          "depth; float rounding does not depend on the needle's place) or all (every prompt, "
                          "half again the forward work of base and variant)")
    rec.add_argument("--fail-on-lost-needle", action="store_true",
                     help="exit 1 when the variant retrieves fewer needles than the base")
    rec.add_argument("--ablate", action="store_true",
                     help="also run the served numerics one part at a time (weights; + activations; + FP8 KV cache; "
                          "+ FP8 indexer; FP4 indexer), base and variant, against the base's weights alone")
    num = p.add_argument_group("numerics")
    num.add_argument("--numerics", choices=("served", "weights"), default="served",
                     help="served: what the server computes with (default); weights: stored weights only, "
                          "activations as computed")
    num.add_argument("--base-numerics", choices=("served", "weights"),
                     help="the base side's numerics, when they should differ from --numerics (e.g. weights: "
                          "the base as an ideal reference)")
    num.add_argument("--engine", choices=("sglang",), default="sglang")
    num.add_argument("--gpu-family", choices=GPU_FAMILIES, default=DEFAULT_GPU_FAMILY,
                     help=f"the GPUs the variant is served on (default: {DEFAULT_GPU_FAMILY}, "
                          f"{family_label(DEFAULT_GPU_FAMILY)})")
    num.add_argument("--moe-runner-backend", metavar="B",
                     help="SGLang's --moe-runner-backend, where you serve with another than `serve` picks")
    num.add_argument("--fp4-indexer", action="store_true",
                     help="as SGLang's --enable-deepseek-v4-fp4-indexer (sm100/sm120)")
    run = p.add_argument_group("running")
    run.add_argument("--device", default="auto",
                     help="auto, cpu, cuda or cuda:N (default: auto, the first CUDA GPU when there is one, else cpu)")
    run.add_argument("--dtype", choices=("bfloat16", "float32"),
                     help="compute dtype (default: bfloat16 on a GPU, float32 on the CPU)")
    run.add_argument("--chunk", type=int, default=2048,
                     help="queries per layer forward, through the layer's cache (default: 2048)")
    run.add_argument("--batch-size", type=int, default=1, help="sequences per forward (default: 1)")
    run.add_argument("--no-mtp", action="store_true",
                     help="skip the drafter: the preview's MTP block, or the DSpark drafter's draft fidelity")
    run.add_argument("--draft-anchors", type=int, default=DEFAULT_ANCHORS, metavar="N",
                     help="DSpark: draft blocks in all, anchored evenly over the sequences (default: "
                          f"{DEFAULT_ANCHORS}); each side drafts every block through every stage")
    run.add_argument("--seed", type=int, default=0, help="seed of --random-tokens")
    run.add_argument("--gpus", metavar="LIST",
                     help="one rank per listed GPU on this host (0,1,2,3), each running its share of the sequences "
                          "or prompts; the same as torchrun --nproc-per-node N -m dsv4convert compare ... (which also "
                          "spans hosts). Results equal one rank's")
    p.add_argument("--report", type=Path, metavar="DIR", help="report directory (default: VARIANT-compare beside it)")
    p.add_argument("--fail-above-kld", type=float, metavar="X", help="exit 1 if the mean KLD is above X nats")
    p.add_argument("--dry-run", action="store_true",
                   help="check both checkpoints and the data, print the plan and the estimated memory, run nothing")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=_run)


def _lengths(text: str) -> list[int]:
    from dsv4convert.needle import parse_lengths

    try:
        return parse_lengths(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _depths(text: str) -> tuple[float, ...]:
    try:
        depths = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"depths must be numbers in [0, 1], got {text!r}") from None
    if not depths or not all(0.0 <= d <= 1.0 for d in depths):
        raise argparse.ArgumentTypeError(f"depths must be numbers in [0, 1], got {text!r}")
    return depths


def _options(args: argparse.Namespace):
    from dsv4convert.compare.recall import RecallOptions
    from dsv4convert.compare.run import CompareOptions

    recall = None
    if args.recall:
        recall = RecallOptions(lengths=args.lengths, trials=args.trials, seed=args.seed, ablate=args.ablate,
                               local=args.local, noise_floor=args.noise_floor or "per-length",
                               **({"depths": args.depths} if args.depths else {}))
    elif args.lengths or args.depths or args.ablate or args.local or args.noise_floor:
        raise DSV4Error("--lengths, --depths, --ablate, --local and --noise-floor belong to --recall")
    return CompareOptions(
        base=args.base, variant=args.variant, texts=list(args.text), random_tokens=args.random_tokens,
        tokens=args.tokens, seq_len=args.seq_len, numerics=args.numerics, base_numerics=args.base_numerics,
        engine=args.engine, gpu_family=args.gpu_family, moe_runner_backend=args.moe_runner_backend,
        fp4_indexer=args.fp4_indexer, device=args.device, dtype=args.dtype, chunk=args.chunk,
        batch_size=args.batch_size, mtp=not args.no_mtp, draft_anchors=args.draft_anchors, seed=args.seed,
        progress=not args.no_progress,
        recall=recall)


def print_plan(plan, eta=None) -> None:
    e = plan.estimate
    blocks = plan.base.side.inspection.config.block_prefixes()
    if not plan.options.mtp or plan.grid is not None:
        blocks = [b for b in blocks if b.startswith("layers.")]
    print(f"plan: {plan.variant.side.ckpt.root} ({plan.variant.side.inspection.variant}) against "
          f"{plan.base.side.ckpt.root} ({plan.base.side.inspection.variant})")
    if plan.grid is not None:
        d = plan.data
        print(f"  recall: {d['prompts']} needle prompts, lengths {d['lengths']}, depths {d['depths']}, "
              f"{d['trials']} trial(s); selection threshold {d['selection_threshold']} tokens")
        print(f"  tracks: {', '.join(t.label for t in plan.tracks)}")
    else:
        print(f"  data: {plan.data['sequences']} sequences x {plan.data['seq_len']} tokens from {plan.data['source']}")
    print(f"  blocks: {len(blocks)} ({blocks[0]} .. {blocks[-1]}), each read once per checkpoint and run once per "
          "track; the variant's also on the base's input")
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
    base_d, variant_d = plan.base.side.inspection.config.dspark, plan.variant.side.inspection.config.dspark
    for line in dspark_plan_lines(e.get("dspark"), base_d, variant_d):
        print(f"  {line}")
    if eta is not None:
        print(f"  {eta.line(what_runs(plan))}")
    print("dry run: nothing run")


def what_runs(plan) -> str:
    """The work the expected-time line is about, in a user's terms."""
    tracks = len(plan.tracks)
    if plan.grid is not None:
        return f"{plan.data['prompts']} needle prompts x {tracks} tracks"
    return f"{plan.data['sequences']} x {plan.data['seq_len']} tokens x {tracks} tracks"


def _run(args: argparse.Namespace) -> int:
    from dsv4convert.compare import v41
    from dsv4convert.distributed import run_as_rank

    if v41.is_v41(args.base) or v41.is_v41(args.variant):   # by the release registry: V4.1's forward
        return _compare_v41(args, v41.main)
    return run_as_rank(args, lambda world: _compare(args, world), launch=not args.dry_run)


# What compare on V4.1 does not take yet: options of V4's engine (its query chunks, its MoE runner and FP4 indexer
# switches, several ranks) and of V4's recall diagnosis.
V41_REFUSED = {"gpus": "--gpus", "moe_runner_backend": "--moe-runner-backend", "fp4_indexer": "--fp4-indexer",
               "local": "--local", "noise_floor": "--noise-floor"}


def _compare_v41(args: argparse.Namespace, main) -> int:
    given = [flag for key, flag in V41_REFUSED.items() if getattr(args, key, None)]
    if given:
        raise DSV4Error(f"{', '.join(given)}: not for DeepSeek-V4.1 checkpoints yet (compare runs them on one device "
                        "through V4.1's forward; the FP4 indexer and compressed KV are always SGLang's there)")
    return main(_options(args), dry_run=args.dry_run, report=args.report, fail_above_kld=args.fail_above_kld,
                fail_on_lost_needle=args.fail_on_lost_needle)


def _compare(args: argparse.Namespace, world) -> int:
    from dsv4convert.compare.report import write_recall_reports, write_reports
    from dsv4convert.compare.run import build_plan, expected, recall_time, run

    plan = build_plan(_options(args), world)
    eta = expected(plan) if world.is_main else None
    if args.dry_run:
        print_plan(plan, eta)
        return 0
    if eta is not None:      # before any work: a CPU run of the real model takes hours, and says so here
        eta.announce(what_runs(plan))
    result = run(plan, eta)
    if result is None:       # not rank 0: rank 0 writes and prints everything
        return 0
    root = plan.variant.side.ckpt.root
    out_dir = Path(args.report or root.parent / f"{root.name}-compare")
    if plan.grid is not None:
        write_recall_reports(result, out_dir)
        recall = result["recall"]
        for line in recall["verdicts"]:
            print(line)
        print(f"report: {out_dir / 'compare.md'}")
        subject, reference = recall["tracks"][recall["subject"]], recall["tracks"][recall["reference"]]
        if args.fail_on_lost_needle and subject["accuracy"] < reference["accuracy"]:
            print(f"compare: the variant retrieves {100 * subject['accuracy']:.0f}% of the needles, the base "
                  f"{100 * reference['accuracy']:.0f}%")
            return 1
        print(f"next: dsv4convert serve --model {args.variant} --check recall (the same needles through the server)")
        return 0
    write_reports(result, out_dir)
    o = result["output"]
    print(f"{args.variant} vs {args.base}: mean KLD {o['kld']['mean']:.6g} \u00b1 {o['kld']['standard_error']:.2g} "
          f"nats, same top-1 {100 * o['same_top1']:.2f}%, perplexity ratio {o['perplexity']['ratio']:.4f}, "
          f"expected acceptance {100 * o['expected_acceptance']:.2f}% ({o['positions']} positions)")
    for label, blocks in result["mtp_draft_agreement"].items():
        for block, value in blocks.items():
            print(f"  MTP {block} draft agreement ({label}): {100 * value:.2f}%")
    for line in dspark_result_lines(result.get("dspark")):
        print(f"  {line}")
    print(f"report: {out_dir / 'compare.md'}")
    if args.fail_above_kld is not None and o["kld"]["mean"] > args.fail_above_kld:
        print(f"compare: mean KLD {o['kld']['mean']:.6g} is above --fail-above-kld {args.fail_above_kld}")
        return 1
    print(f"next: dsv4convert compare --base {args.base} --variant {args.variant} --recall (long-context recall"
          f"{recall_time(plan, eta, result)}), then dsv4convert serve --model {args.variant}")
    return 0
