"""Host topology readers on hand-written samples of nvidia-smi output and a fake sysfs tree."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsv4convert.serve.launch import LaunchError, default_pd_split
from dsv4convert.serve.topology import (
    GPU_QUERY,
    TOPO_QUERY,
    Gpu,
    Topology,
    TopologyError,
    discover,
    infiniband_devices,
    node_cpu_lists,
    parse_gpu_query,
    parse_topo_matrix,
    pci_numa_node,
)

# `nvidia-smi topo -m` of the user's host: 8x RTX PRO 6000, GPUs 0-3 on NUMA 0, 4-7 on NUMA 1,
# PCIe only (the header is underlined with ANSI codes, as nvidia-smi prints it on a terminal).
_CPUS = {0: "0-31,64-95", 1: "32-63,96-127"}
TOPO_8X_PCIE = "\n".join(
    ["\x1b[4m\t" + "\t".join(f"GPU{i}" for i in range(8)) + "\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m"]
    + [
        f"GPU{i}\t" + "\t".join(" X " if i == j else ("NODE" if i // 4 == j // 4 else "SYS") for j in range(8))
        + f"\t{_CPUS[i // 4]}\t{i // 4}\t\tN/A"
        for i in range(8)
    ]
    + ["", "Legend:", "", "  X    = Self",
       "  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)",
       "  NODE = Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node",
       "  NV#  = Connection traversing a bonded set of # NVLinks", ""]
)
BUSES = ["18", "2A", "3A", "5D", "9A", "AB", "BA", "DB"]
QUERY_8X = "".join(f"{i}, 00000000:{b}:00.0, NVIDIA RTX PRO 6000 Blackwell Server Edition, 12.0\n" for i, b in enumerate(BUSES))

# Two NVLinked H200s with one ConnectX NIC each, on different sockets.
TOPO_2X_NVLINK = "\n".join([
    "\tGPU0\tGPU1\tNIC0\tNIC1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID",
    "GPU0\t X \tNV18\tPIX\tSYS\t0-47,96-143\t0\t\tN/A",
    "GPU1\tNV18\t X \tSYS\tPIX\t48-95,144-191\t1\t\tN/A",
    "NIC0\tPIX\tSYS\t X \tSYS\t\t\t",
    "NIC1\tSYS\tPIX\tSYS\t X \t\t\t",
    "", "Legend:", "", "  X    = Self", "", "NIC Legend:", "", "  NIC0: mlx5_0", "  NIC1: mlx5_1", "",
])


def fake_sysfs(root: Path, numa_by_bus: dict[str, int], node_cpus: dict[int, str], ib: dict[str, str]) -> Path:
    for bus, node in numa_by_bus.items():
        device = root / "sys/bus/pci/devices" / f"0000:{bus.lower()}:00.0"
        device.mkdir(parents=True)
        (device / "numa_node").write_text(f"{node}\n")
    for node, cpus in node_cpus.items():
        directory = root / f"sys/devices/system/node/node{node}"
        directory.mkdir(parents=True)
        (directory / "cpulist").write_text(cpus + "\n")
    for name, state in ib.items():
        port = root / "sys/class/infiniband" / name / "ports/1"
        port.mkdir(parents=True)
        (port / "state").write_text(state + "\n")
    return root


def test_topo_matrix_numa_and_links():
    numa, links, nics = parse_topo_matrix(TOPO_8X_PCIE)
    assert numa == {i: i // 4 for i in range(8)}
    assert links[(0, 3)] == "NODE" and links[(3, 4)] == "SYS" and (2, 2) not in links
    assert nics == {}


def test_topo_matrix_with_nics_and_nvlink():
    numa, links, nics = parse_topo_matrix(TOPO_2X_NVLINK)
    assert numa == {0: 0, 1: 1}
    assert links == {(0, 1): "NV18", (1, 0): "NV18"}
    assert nics == {"NIC0": "mlx5_0", "NIC1": "mlx5_1"}
    assert Topology(gpus=(), gpu_links=links).has_nvlink


def test_topo_matrix_rejects_garbage():
    with pytest.raises(TopologyError, match="no GPU header"):
        parse_topo_matrix("No devices were found\n")


def test_gpu_query():
    rows = parse_gpu_query(QUERY_8X)
    assert rows[0] == (0, "00000000:18:00.0", "NVIDIA RTX PRO 6000 Blackwell Server Edition", (12, 0))
    assert [r[0] for r in rows] == list(range(8))
    with pytest.raises(TopologyError, match="unexpected"):
        parse_gpu_query("0, 00000000:18:00.0\n")


def test_sysfs_readers(tmp_path):
    root = fake_sysfs(tmp_path, {"18": 0, "9A": 1, "DB": -1}, _CPUS, {"mlx5_0": "4: ACTIVE", "mlx5_1": "1: DOWN"})
    assert pci_numa_node(root, "00000000:18:00.0") == 0
    assert pci_numa_node(root, "00000000:9A:00.0") == 1
    assert pci_numa_node(root, "00000000:DB:00.0") is None  # -1: no NUMA information
    assert pci_numa_node(root, "00000000:77:00.0") is None
    assert node_cpu_lists(root) == _CPUS
    assert infiniband_devices(root) == ["mlx5_0"]


def test_discover_prefers_sysfs_and_falls_back_to_topo(tmp_path):
    # sysfs knows GPUs 0-5 only; 6 and 7 come from the topo matrix.
    root = fake_sysfs(tmp_path, {b: i // 4 for i, b in enumerate(BUSES[:6])}, _CPUS, {})
    outputs = {tuple(GPU_QUERY): QUERY_8X, tuple(TOPO_QUERY): TOPO_8X_PCIE}
    topology = discover(root, run=lambda argv: outputs.get(tuple(argv)), numactl="/usr/bin/numactl")
    assert topology.gpus_by_numa_node() == {0: [0, 1, 2, 3], 1: [4, 5, 6, 7]}
    assert {g.family for g in topology.gpus} == {"sm120"}
    assert topology.ib_devices == () and not topology.has_nvlink
    assert topology.numa_node_of([4, 5, 6, 7]) == 1 and topology.numa_node_of([3, 4]) is None
    assert default_pd_split(topology) == ([0, 1, 2, 3], [4, 5, 6, 7], None)


def test_discover_without_nvidia_smi(tmp_path):
    with pytest.raises(TopologyError, match="cannot list GPUs"):
        discover(tmp_path, run=lambda argv: None)


def test_single_numa_node_split_warns():
    gpus = tuple(Gpu(i, f"0000:{i:02x}:00.0", "H200", (9, 0), 0) for i in range(8))
    prefill, decode, warning = default_pd_split(Topology(gpus=gpus))
    assert (prefill, decode) == ([0, 1, 2, 3], [4, 5, 6, 7]) and "share a CPU socket" in warning
    with pytest.raises(LaunchError, match="at least 2 GPUs"):
        default_pd_split(Topology(gpus=gpus[:1]))
    with pytest.raises(TopologyError, match="GPU 9 does not exist"):
        Topology(gpus=gpus).gpu(9)
