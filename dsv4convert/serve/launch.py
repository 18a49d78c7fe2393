"""The exact SGLang 0.5.23 command lines and environments for serving a converted checkpoint.

Pure planning: nothing here starts a process, so every command can be printed (``--dry-run``)
and checked against SGLang's own argument parser in tests. The rules (flag names, per-variant
environment, the MoE runner per GPU family, where the MTP draft can run, the PD port contract)
follow ``sglang-contract.md`` sections 1, 4, 5 and 9 and ``sglang-loading.md`` section 2.4.
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass, field

from dsv4convert.errors import DSV4Error
from dsv4convert.serve.topology import Topology
from dsv4convert.storage import Format

SERVED_VARIANTS = ("native", "fp8", "nvfp4", "nvfp4-mtp-mxfp4", "nvfp4-mtp-bf16", "w4a16", "bf16")
TRANSFER_BACKENDS = ("mooncake", "mooncake_tcp", "nixl")
ROLES = ("prefill", "decode", "router", "server")
NO_DRAFT = "this checkpoint has no MTP draft (made without one, or converted with --no-mtp)"

# Cookbook cell for SM120 (the only one shipped): --mem-fraction-static 0.70, decode graphs up to bs 32.
_SM120_MEM_FRACTION = "0.70"
_SM120_DECODE_GRAPH_BS = 32

MOONCAKE_TCP_COST = (
    "no active RDMA device under /sys/class/infiniband: KV caches move with mooncake_tcp, i.e. through "
    "host memory and the kernel TCP stack instead of GPU-direct RDMA; expect a much higher "
    "time-to-first-token for long prompts, and note that Mooncake TCP on a PCIe-only host is "
    "unconfirmed with SGLang 0.5.23 (it has failed under sustained load before)"
)


class LaunchError(DSV4Error):
    """A serving plan that cannot work: unknown variant, bad GPU split, port clash."""


# SGLang's EAGLE draft from the checkpoint's MTP block, the cookbook's "balanced" preset (sglang-contract.md
# section 4: V4 accepts EAGLE with top-k 1, or DSPARK): one draft step, one candidate, two tokens verified
# per step, so an accepted length of at most 2.
MTP_ARGS = ("--speculative-algorithm", "EAGLE", "--speculative-num-steps", "1", "--speculative-eagle-topk", "1",
            "--speculative-num-draft-tokens", "2")

# MoE methods whose kernels exist only on some GPU majors, and why.
_SM100_ONLY_METHODS = {
    "Mxfp4FlashinferTrtllmMoEMethod": "FlashInfer's TRT-LLM MXFP4 MoE kernel (trtllm_fp4_block_scale_moe) is an SM100 "
                                      "kernel",
}



def flag_value(args: list[str] | tuple[str, ...], name: str) -> str | None:
    """The value a launch argv gives ``name`` (``--name V`` or ``--name=V``; the last one wins, as argparse
    reads it), or None: how compare's numerics and fit's sizing read back what ``server_args`` launches."""
    value = None
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value

@dataclass(frozen=True)
class VariantDefaults:
    """What SGLang 0.5.23 runs for one variant on one GPU family, and the flags that make it so.

    ``moe_method``/``draft_moe_method`` name the routed-expert method SGLang builds for the backbone
    and for the MTP draft (the compressed-tensors scheme class for W4A16); CI builds SGLang's model
    with these settings and checks the names (tests/test_sglang_loading.py).
    """

    env: dict[str, str]
    moe_runner_backend: str | None  # None: leave SGLang's automatic choice
    moe_method: str
    draft_moe_method: str
    mtp_args: tuple[str, ...] | None  # flags that serve the MTP draft; None where its MoE method cannot run
    mtp_note: str | None = None       # why the draft is not served here


def gpu_family_major(gpu_family: str) -> int:
    if not gpu_family.startswith("sm") or not gpu_family[2:].isdigit():
        raise LaunchError(f"GPU family must look like sm90/sm100/sm120, got {gpu_family!r}")
    digits = gpu_family[2:]
    return int(digits[:-1])


def _defaults(env: dict[str, str], runner: str | None, method: str, draft_method: str, major: int,
              draft_args: tuple[str, ...] = ()) -> VariantDefaults:
    why = _SM100_ONLY_METHODS.get(draft_method) if major != 10 else None
    if why is None:
        return VariantDefaults(env, runner, method, draft_method, MTP_ARGS + draft_args)
    return VariantDefaults(env, runner, method, draft_method, None,
                           f"SGLang 0.5.23 loads this checkpoint's MXFP4 MTP experts into {draft_method}, and {why}; "
                           "convert with to-nvfp4 --mtp-experts bf16 (both engines) or --engine sglang (FP8-block MTP experts) to "
                           "serve the draft on this GPU")


def variant_defaults(variant: str, gpu_family: str) -> VariantDefaults:
    """Environment, MoE runner and MTP flags a variant needs on a GPU family.

    SGLang detects the quantization itself; what it cannot know is that non-FP4 experts must
    not be read as FP4 when its shard probe finds nothing (W4A16 keys, BF16) or finds the NVFP4
    backbone's U8 while the draft's experts are FP8, and that its automatic runner for the NVFP4
    hybrid is an SM100-only one. The NVFP4 hybrid's FP8 draft experts run on SGLang's Triton FP8
    MoE: Fp8MoEMethod has no Marlin path (its runner stays unset and its forward fails).
    """
    major = gpu_family_major(gpu_family)
    not_fp4 = {"SGLANG_DSV4_FP4_EXPERTS": "0"}
    nvfp4_runner = None if major == 10 else "marlin"
    if variant == "native":
        mxfp4 = {10: "Mxfp4FlashinferTrtllmMoEMethod", 12: "Mxfp4MarlinMoEMethod"}.get(major,
                                                                                     "Mxfp4FlashinferCutlassMoEMethod")
        return _defaults({}, "marlin" if major == 12 else None, mxfp4, mxfp4, major)
    if variant == "fp8":
        return _defaults(not_fp4, None, "Fp8MoEMethod", "Fp8MoEMethod", major)
    if variant == "nvfp4":
        return _defaults(not_fp4, nvfp4_runner, "ModelOptNvFp4FusedMoEMethod", "Fp8MoEMethod", major,
                         ("--speculative-moe-runner-backend", "triton"))
    if variant == "nvfp4-mtp-mxfp4":
        return _defaults({"SGLANG_DSV4_FP4_EXPERTS": "1"}, nvfp4_runner, "ModelOptNvFp4FusedMoEMethod",
                         "Mxfp4FlashinferTrtllmMoEMethod", major)
    if variant == "nvfp4-mtp-bf16":  # BF16 draft experts (ignored_layers): SGLang's unquantized Triton MoE
        return _defaults(not_fp4, nvfp4_runner, "ModelOptNvFp4FusedMoEMethod", "UnquantizedFusedMoEMethod", major,
                         ("--speculative-moe-runner-backend", "triton"))
    if variant == "w4a16":
        wna16 = "CompressedTensorsWNA16TritonMoE" if major == 10 else "CompressedTensorsWNA16MoE"
        return _defaults(not_fp4, None, wna16, wna16, major)
    if variant == "bf16":
        return _defaults(not_fp4, None, "UnquantizedFusedMoEMethod", "UnquantizedFusedMoEMethod", major)
    raise LaunchError(
        f"no serving defaults for variant {variant!r}; expected one of {', '.join(SERVED_VARIANTS)} "
        "(pass --variant to override what inspect detected)"
    )


def served_like(variant: str, module_formats: dict[str, tuple[Format, dict]]) -> str:
    """The shipped variant whose serving rules apply to a checkpoint (a mixed recipe follows its experts)."""
    if variant in SERVED_VARIANTS:
        return variant
    experts = {fmt for module, (fmt, _) in module_formats.items()
               if ".ffn.experts." in module and not module.startswith("mtp.")}
    mtp_experts = {fmt for module, (fmt, _) in module_formats.items()
                   if ".ffn.experts." in module and module.startswith("mtp.")}
    if Format.NVFP4 in experts:
        if Format.MXFP4 in mtp_experts:
            return "nvfp4-mtp-mxfp4"
        return "nvfp4-mtp-bf16" if mtp_experts == {Format.BF16} else "nvfp4"
    for fmt, like in ((Format.INT4, "w4a16"), (Format.MXFP4, "native")):
        if fmt in experts:
            return like
    return "fp8"


def choose_transfer_backend(requested: str | None, ib_devices: tuple[str, ...]) -> tuple[str, str | None]:
    """The KV transfer backend to use and, when it had to fall back, a warning saying what that costs."""
    if requested is not None and requested not in TRANSFER_BACKENDS:
        raise LaunchError(f"unknown transfer backend {requested!r}; expected one of {', '.join(TRANSFER_BACKENDS)}")
    if requested in (None, "mooncake") and not ib_devices:
        return "mooncake_tcp", MOONCAKE_TCP_COST
    return requested or "mooncake", None


@dataclass(frozen=True)
class LaunchOptions:
    """Everything a plan depends on besides the host topology."""

    model: str
    variant: str
    gpu_family: str
    host: str = "127.0.0.1"
    router_port: int = 8000
    prefill_port: int = 30000
    decode_port: int = 30001
    server_port: int = 30000
    bootstrap_port: int = 8998
    prefill_nccl_port: int = 29100
    decode_nccl_port: int = 29200
    transfer_backend: str = "mooncake_tcp"
    ib_devices: tuple[str, ...] = ()
    indexer_topk: bool = False
    mtp: bool = False  # serve the MTP draft (EAGLE, MTP_ARGS); refused where its MoE method cannot run
    enable_metrics: bool = False  # Prometheus metrics at /metrics on every server
    extra_args: tuple[str, ...] = ()
    python: str = sys.executable


@dataclass(frozen=True)
class Command:
    """One process to start: its argv, the variables it adds to the environment, what it serves."""

    role: str
    argv: tuple[str, ...]
    env: dict[str, str]
    url: str
    ports: tuple[int, ...]
    sglang_args: tuple[str, ...] = field(default=(), compare=False)

    def shell(self) -> str:
        """A copy-pasteable shell line (environment assignments, then the command)."""
        assignments = [f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items())]
        return " ".join([*assignments, shlex.join(self.argv)])


def server_args(options: LaunchOptions, role: str, tp_size: int, port: int, nccl_port: int) -> list[str]:
    """Arguments for ``python -m sglang.launch_server`` (what SGLang's parser sees)."""
    if role not in ("prefill", "decode", "server"):
        raise LaunchError(f"not a server role: {role!r}")
    defaults = variant_defaults(options.variant, options.gpu_family)
    args = [
        "--model-path", options.model,
        "--host", options.host,
        "--port", str(port),
        "--tp-size", str(tp_size),
        "--nccl-port", str(nccl_port),
        "--kv-cache-dtype", "fp8_e4m3",
    ]
    if defaults.moe_runner_backend:
        args += ["--moe-runner-backend", defaults.moe_runner_backend]
    if gpu_family_major(options.gpu_family) == 12:
        args += ["--mem-fraction-static", _SM120_MEM_FRACTION]
        if role in ("decode", "server"):
            args += ["--cuda-graph-max-bs-decode", str(_SM120_DECODE_GRAPH_BS)]
    if options.mtp:
        if defaults.mtp_args is None:
            raise LaunchError(f"no MTP draft for the {options.variant} variant on {options.gpu_family}: "
                              f"{defaults.mtp_note}")
        args += list(defaults.mtp_args)
    if options.indexer_topk:
        # The capturer needs attention TP == 1, i.e. one attention-DP rank per GPU.
        args += ["--enable-return-indexer-topk", "--attn-dp-size", str(tp_size)]
    if options.enable_metrics:
        args += ["--enable-metrics"]
    if role in ("prefill", "decode"):
        args += [
            "--disaggregation-mode", role,
            "--disaggregation-transfer-backend", options.transfer_backend,
            "--disaggregation-bootstrap-port", str(options.bootstrap_port),
        ]
        if options.transfer_backend == "mooncake" and options.ib_devices:
            args += ["--disaggregation-ib-device", ",".join(options.ib_devices)]
    return args + list(options.extra_args)


def _server_env(options: LaunchOptions, role: str, gpus: list[int]) -> dict[str, str]:
    env = dict(variant_defaults(options.variant, options.gpu_family).env)
    env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
    if role in ("prefill", "decode") and options.transfer_backend in ("mooncake", "mooncake_tcp"):
        env["MC_TCP_ENABLE_CONNECTION_POOL"] = "true"
    return env


def _numa_prefix(topology: Topology | None, gpus: list[int]) -> list[str]:
    """``numactl`` binding to the GPUs' node, when they share one and numactl exists."""
    if topology is None or topology.numactl is None:
        return []
    node = topology.numa_node_of(gpus)
    if node is None:
        return []
    return [topology.numactl, f"--cpunodebind={node}", f"--membind={node}"]


def server_command(
    options: LaunchOptions, role: str, gpus: list[int], port: int, nccl_port: int, topology: Topology | None
) -> Command:
    if not gpus:
        raise LaunchError(f"the {role} server needs at least one GPU")
    args = server_args(options, role, len(gpus), port, nccl_port)
    argv = [*_numa_prefix(topology, gpus), options.python, "-m", "sglang.launch_server", *args]
    ports = (port, nccl_port) + ((options.bootstrap_port,) if role == "prefill" else ())
    return Command(role, tuple(argv), _server_env(options, role, gpus), _url(options.host, port), ports, tuple(args))


def router_args(options: LaunchOptions, prefill_url: str, decode_url: str) -> list[str]:
    """Arguments for ``python -m sglang_router.launch_router`` in PD mode.

    The bootstrap port follows the prefill URL so the router puts it into every request,
    rather than each side falling back to its own default.
    """
    return [
        "--pd-disaggregation",
        "--prefill", prefill_url, str(options.bootstrap_port),
        "--decode", decode_url,
        "--host", options.host,
        "--port", str(options.router_port),
    ]


def router_command(options: LaunchOptions, prefill_url: str, decode_url: str) -> Command:
    args = router_args(options, prefill_url, decode_url)
    argv = (options.python, "-m", "sglang_router.launch_router", *args)
    return Command("router", argv, {}, _url(options.host, options.router_port), (options.router_port,), tuple(args))


def _url(host: str, port: int) -> str:
    connect = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    return f"http://{connect}:{port}"


def default_pd_split(topology: Topology) -> tuple[list[int], list[int], str | None]:
    """Prefill on the first NUMA node's GPUs, decode on the second's; else halves, with a warning."""
    by_node = {node: gpus for node, gpus in topology.gpus_by_numa_node().items() if node is not None}
    if len(by_node) >= 2:
        first, second = sorted(by_node)[:2]
        return by_node[first], by_node[second], None
    indices = [g.index for g in topology.gpus]
    if len(indices) < 2:
        raise LaunchError(f"PD disaggregation needs at least 2 GPUs; this host has {len(indices)}")
    half = len(indices) // 2
    return indices[:half], indices[half : 2 * half], (
        "GPUs are not split across two NUMA nodes here; prefill and decode share a CPU socket"
    )


def check_pd_ports(options: LaunchOptions) -> None:
    ports = {
        "router": options.router_port,
        "prefill": options.prefill_port,
        "decode": options.decode_port,
        "bootstrap": options.bootstrap_port,
        "prefill NCCL": options.prefill_nccl_port,
        "decode NCCL": options.decode_nccl_port,
    }
    seen: dict[int, str] = {}
    for name, port in ports.items():
        if port in seen:
            raise LaunchError(f"the {seen[port]} and {name} ports are both {port}; every server needs its own")
        seen[port] = name


def plan_pd(options: LaunchOptions, topology: Topology | None, prefill_gpus: list[int], decode_gpus: list[int]) -> list[Command]:
    """Prefill, decode and router on one host, in start order."""
    check_pd_ports(options)
    if set(prefill_gpus) & set(decode_gpus):
        raise LaunchError(f"prefill GPUs {prefill_gpus} and decode GPUs {decode_gpus} overlap")
    prefill = server_command(options, "prefill", prefill_gpus, options.prefill_port, options.prefill_nccl_port, topology)
    decode = server_command(options, "decode", decode_gpus, options.decode_port, options.decode_nccl_port, topology)
    return [prefill, decode, router_command(options, prefill.url, decode.url)]


def plan_single(options: LaunchOptions, topology: Topology | None, gpus: list[int]) -> list[Command]:
    """One ordinary server over ``gpus`` (no disaggregation)."""
    return [server_command(options, "server", gpus, options.server_port, options.prefill_nccl_port, topology)]


def plan_role(
    options: LaunchOptions,
    topology: Topology | None,
    role: str,
    gpus: list[int],
    prefill_url: str | None = None,
    decode_url: str | None = None,
) -> list[Command]:
    """One piece of a multi-host PD deployment: this host's prefill, decode or router.

    Servers listen on ``options.host`` (use 0.0.0.0 across hosts); multi-node TP flags such as
    ``--dist-init-addr``/``--nnodes``/``--node-rank`` travel in ``options.extra_args``.
    """
    if role == "prefill":
        return [server_command(options, "prefill", gpus, options.prefill_port, options.prefill_nccl_port, topology)]
    if role == "decode":
        return [server_command(options, "decode", gpus, options.decode_port, options.decode_nccl_port, topology)]
    if role == "router":
        if not prefill_url or not decode_url:
            raise LaunchError("the router role needs --prefill-url and --decode-url")
        return [router_command(options, prefill_url, decode_url)]
    raise LaunchError(f"unknown role {role!r}; expected prefill, decode or router")
