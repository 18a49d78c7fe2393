"""What the serving host looks like: GPUs, their NUMA nodes and compute capability, CPUs per node, RDMA NICs.

Every reader takes either a sysfs root or a command's recorded output, so tests feed samples
and the live path only differs in where the text comes from.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from dsv4convert.errors import DSV4Error

_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")
_CPU_LIST = re.compile(r"^\d+(-\d+)?(,\d+(-\d+)?)*$")
_DEVICE_COLUMN = re.compile(r"^(GPU|NIC)\d+$")
GPU_QUERY = ["nvidia-smi", "--query-gpu=index,pci.bus_id,name,compute_cap", "--format=csv,noheader"]
TOPO_QUERY = ["nvidia-smi", "topo", "-m"]


class TopologyError(DSV4Error):
    """The host's GPUs or NUMA layout cannot be read or do not fit the requested plan."""


@dataclass(frozen=True)
class Gpu:
    index: int
    pci_bus_id: str
    name: str
    compute_capability: tuple[int, int]
    numa_node: int | None

    @property
    def family(self) -> str:
        """SGLang's architecture family, e.g. ``sm120`` for an RTX PRO 6000."""
        major, minor = self.compute_capability
        return f"sm{major}{minor}"


@dataclass(frozen=True)
class Topology:
    gpus: tuple[Gpu, ...]
    node_cpus: dict[int, str] = field(default_factory=dict)
    ib_devices: tuple[str, ...] = ()
    gpu_links: dict[tuple[int, int], str] = field(default_factory=dict)
    numactl: str | None = None

    @property
    def has_nvlink(self) -> bool:
        return any(link.startswith("NV") for link in self.gpu_links.values())

    def gpus_by_numa_node(self) -> dict[int | None, list[int]]:
        groups: dict[int | None, list[int]] = {}
        for gpu in self.gpus:
            groups.setdefault(gpu.numa_node, []).append(gpu.index)
        return groups

    def gpu(self, index: int) -> Gpu:
        for gpu in self.gpus:
            if gpu.index == index:
                return gpu
        raise TopologyError(f"GPU {index} does not exist on this host (GPUs: {[g.index for g in self.gpus]})")

    def numa_node_of(self, indices: list[int]) -> int | None:
        """The one NUMA node all ``indices`` sit on, or None when they span nodes or it is unknown."""
        nodes = {self.gpu(i).numa_node for i in indices}
        return nodes.pop() if len(nodes) == 1 else None


def parse_gpu_query(text: str) -> list[tuple[int, str, str, tuple[int, int]]]:
    """Rows of ``nvidia-smi --query-gpu=index,pci.bus_id,name,compute_cap --format=csv,noheader``."""
    rows = []
    for line in text.strip().splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 4:
            raise TopologyError(f"unexpected nvidia-smi GPU query line: {line!r}")
        index, bus_id, name, capability = fields
        major, _, minor = capability.partition(".")
        rows.append((int(index), bus_id, name, (int(major), int(minor or 0))))
    return rows


def parse_topo_matrix(text: str) -> tuple[dict[int, int | None], dict[tuple[int, int], str], dict[str, str]]:
    """``nvidia-smi topo -m``: per-GPU NUMA affinity, GPU-to-GPU link types, NIC names.

    Cells are tab separated; empty cells are dropped, which keeps rows aligned with the header
    because the link matrix never has empty cells.
    """
    lines = [_ANSI_ESCAPE.sub("", line) for line in text.splitlines()]
    # The header row starts with an empty cell; matrix rows start with their device name.
    header = next((line for line in lines if "\t" in line and not line.split("\t")[0].strip() and "GPU0" in line), None)
    if header is None:
        raise TopologyError("nvidia-smi topo -m output has no GPU header row")
    columns = [cell.strip() for cell in header.split("\t") if cell.strip()]
    devices = [c for c in columns if _DEVICE_COLUMN.match(c)]
    numa: dict[int, int | None] = {}
    links: dict[tuple[int, int], str] = {}
    nic_names: dict[str, str] = {}
    for line in lines:
        cells = [cell.strip() for cell in line.split("\t") if cell.strip()]
        nic = re.match(r"^\s*(NIC\d+):\s*(\S+)\s*$", line)
        if nic:
            nic_names[nic.group(1)] = nic.group(2)
            continue
        if not cells or not re.fullmatch(r"GPU\d+", cells[0]) or len(cells) < len(devices) + 1:
            continue
        gpu = int(cells[0][3:])
        for column, link in zip(devices, cells[1 : 1 + len(devices)]):
            if column.startswith("GPU") and int(column[3:]) != gpu:
                links[(gpu, int(column[3:]))] = link
        rest = cells[1 + len(devices) :]
        if rest and _CPU_LIST.match(rest[0]):
            rest = rest[1:]
        numa[gpu] = int(rest[0]) if rest and rest[0].isdigit() else None
    return numa, links, nic_names


def pci_numa_node(sys_root: Path, pci_bus_id: str) -> int | None:
    """NUMA node of a PCI device from sysfs; nvidia-smi's 8-digit domain becomes sysfs's 4."""
    domain, _, rest = pci_bus_id.lower().partition(":")
    path = sys_root / "sys/bus/pci/devices" / f"{domain[-4:]}:{rest}" / "numa_node"
    if not path.is_file():
        return None
    node = int(path.read_text().strip())
    return node if node >= 0 else None


def node_cpu_lists(sys_root: Path) -> dict[int, str]:
    """CPU list per NUMA node (``/sys/devices/system/node/nodeN/cpulist``)."""
    nodes = {}
    for path in sorted((sys_root / "sys/devices/system/node").glob("node[0-9]*/cpulist")):
        nodes[int(path.parent.name[4:])] = path.read_text().strip()
    return nodes


def infiniband_devices(sys_root: Path) -> list[str]:
    """RDMA devices under ``/sys/class/infiniband`` with at least one ACTIVE port."""
    devices = []
    for device in sorted((sys_root / "sys/class/infiniband").glob("*")):
        states = [p.read_text() for p in device.glob("ports/*/state")]
        if any("ACTIVE" in state for state in states):
            devices.append(device.name)
    return devices


def _run(argv: list[str]) -> str | None:
    if shutil.which(argv[0]) is None:
        return None
    completed = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    return completed.stdout if completed.returncode == 0 else None


def discover(
    sys_root: Path = Path("/"),
    run: Callable[[list[str]], str | None] = _run,
    numactl: str | None = None,
) -> Topology:
    """Read the host: sysfs for NUMA (authoritative), ``nvidia-smi topo -m`` where sysfs is silent."""
    gpu_text = run(GPU_QUERY)
    if not gpu_text:
        raise TopologyError("cannot list GPUs: `nvidia-smi --query-gpu` is missing or failed")
    topo_text = run(TOPO_QUERY)
    topo_numa, links, _ = parse_topo_matrix(topo_text) if topo_text else ({}, {}, {})
    gpus = []
    for index, bus_id, name, capability in parse_gpu_query(gpu_text):
        node = pci_numa_node(sys_root, bus_id)
        gpus.append(Gpu(index, bus_id, name, capability, node if node is not None else topo_numa.get(index)))
    return Topology(
        gpus=tuple(gpus),
        node_cpus=node_cpu_lists(sys_root),
        ib_devices=tuple(infiniband_devices(sys_root)),
        gpu_links=links,
        numactl=numactl if numactl is not None else shutil.which("numactl"),
    )
