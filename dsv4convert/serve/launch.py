"""The processes ``serve`` starts: SGLang servers (single, PD, multi-host roles) and the PD router.

Pure planning: nothing here starts a process, so every command can be printed (``--dry-run``) and checked
against SGLang's own argument parser in tests. What each server runs is the engine's (its settings object,
:func:`dsv4convert.engines.sglang.server.server`); this module adds the host's side: GPUs, ports, NUMA
binding, the PD port contract and the router (``sglang-contract.md`` sections 5 and 9).
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass, field, replace

from dsv4convert import variants
from dsv4convert.engines import SGLANG_LABEL
from dsv4convert.engines.sglang import TRANSFER_BACKENDS
from dsv4convert.engines.sglang.server import Disaggregation, Server, server, server_v41
from dsv4convert.errors import DSV4Error
from dsv4convert.models.deepseek_v4.layout import Drafter
from dsv4convert.serve.topology import Topology

SERVED_VARIANTS = variants.SERVED
ROLES = ("prefill", "decode", "router", "server")

MOONCAKE_TCP_COST = (
    "no active RDMA device under /sys/class/infiniband: KV caches move with mooncake_tcp, i.e. through "
    "host memory and the kernel TCP stack instead of GPU-direct RDMA; expect a much higher "
    "time-to-first-token for long prompts, and note that Mooncake TCP on a PCIe-only host is "
    f"unconfirmed with {SGLANG_LABEL} (it has failed under sustained load before)"
)


class LaunchError(DSV4Error):
    """A serving plan that cannot work: unknown variant, bad GPU split, port clash."""


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
    mtp: bool = False  # serve the checkpoint's draft; refused where its MoE method cannot run
    drafter: Drafter = Drafter.MTP  # what the checkpoint's mtp.* holds: EAGLE serves MTP, DSPARK a DSpark drafter
    dspark_block_size: int | None = None
    enable_metrics: bool = False  # Prometheus metrics at /metrics on every server
    engram: str | None = None  # DeepSeek-V4.1: where its Engram tables live (None: a V4 checkpoint)
    extra_args: tuple[str, ...] = ()   # the user's own launch_server arguments (Server.with_arguments)
    python: str = sys.executable


@dataclass(frozen=True)
class Command:
    """One process to start: its argv, the variables it adds to the environment, what it serves, and for an
    SGLang server the settings it was rendered from."""

    role: str
    argv: tuple[str, ...]
    env: dict[str, str]
    url: str
    ports: tuple[int, ...]
    sglang_args: tuple[str, ...] = field(default=(), compare=False)   # the program's own arguments, as rendered
    server: Server | None = field(default=None, compare=False)        # an SGLang server's settings

    def shell(self) -> str:
        """A copy-pasteable shell line (environment assignments, then the command)."""
        assignments = [f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items())]
        return " ".join([*assignments, shlex.join(self.argv)])


def server_settings(options: LaunchOptions, role: str, tp_size: int, port: int, nccl_port: int) -> Server:
    """The SGLang server ``options`` launch as ``role`` on ``tp_size`` GPUs."""
    common = dict(role=role, tp=tp_size, mtp=options.mtp, drafter=options.drafter,
                  dspark_block_size=options.dspark_block_size, host=options.host, port=port, nccl_port=nccl_port,
                  indexer_topk=options.indexer_topk, enable_metrics=options.enable_metrics)
    try:
        settings = (server_v41(options.model, options.gpu_family, variant=options.variant, engram=options.engram,
                               **common)
                    if options.engram is not None else
                    server(options.model, options.variant, options.gpu_family, **common))
        if role in ("prefill", "decode"):
            settings = replace(settings, disaggregation=Disaggregation(options.transfer_backend,
                                                                       options.bootstrap_port, options.ib_devices))
        return settings.with_arguments(options.extra_args)
    except DSV4Error as exc:
        raise LaunchError(str(exc)) from None


def _server_env(options: LaunchOptions, settings: Server, gpus: list[int]) -> dict[str, str]:
    env = settings.environment()
    env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
    if settings.disaggregation is not None and options.transfer_backend in ("mooncake", "mooncake_tcp"):
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
    settings = server_settings(options, role, len(gpus), port, nccl_port)
    argv = [*_numa_prefix(topology, gpus), *settings.command(options.python)]
    ports = (port, nccl_port) + ((options.bootstrap_port,) if role == "prefill" else ())
    return Command(role, tuple(argv), _server_env(options, settings, gpus), _url(options.host, port), ports,
                   tuple(settings.argv()), settings)


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
    args = tuple(router_args(options, prefill_url, decode_url))
    return Command("router", (options.python, "-m", "sglang_router.launch_router", *args), {},
                   _url(options.host, options.router_port), (options.router_port,), args)


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
