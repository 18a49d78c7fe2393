"""calibrate and compare under torch.distributed (gloo on the CPU), started the ways users start them:
torchrun with 2 and 3 ranks, a 2-"node" rendezvous on localhost, and --gpus; a rank killed mid-layer.

Every run here is a subprocess with OMP_NUM_THREADS=1 (torchrun's default for its ranks), so the baseline
of one rank computes each sequence with the same kernels as the ranks do: outputs must then be equal, bit
for bit, except calibration's Hessians, which the backend sums across ranks in another order.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import torture  # noqa: E402  (its Stopper arms dsv4convert's stop points)

from dsv4convert.calibration import calibration_hessians  # noqa: E402
from dsv4convert.distributed import World, strip_gpus  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
TIMEOUT = 600   # a hang guard; the runs take seconds


def dsv4(*argv: str, ranks: int = 1, extra: tuple[str, ...] = (), env: dict | None = None,
         popen: bool = False):
    """``python -m dsv4convert ...`` alone, or under torchrun with ``ranks`` processes."""
    head = [sys.executable, "-m", "dsv4convert"] if ranks == 1 and not extra else \
        [sys.executable, "-m", "torch.distributed.run", *(extra or ("--standalone",)),
         "--nproc-per-node", str(ranks), "-m", "dsv4convert"]
    command = [*head, *argv]
    if popen:
        return subprocess.Popen(command, cwd=REPO, env=env or ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
    done = subprocess.run(command, cwd=REPO, env=env or ENV, capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    rng = random.Random(2)
    words = "the river moved slowly past the old mill and a farmer walked along the bank".split()
    path = tmp_path_factory.mktemp("data") / "text.jsonl"
    path.write_text("".join(json.dumps({"text": " ".join(rng.choice(words) for _ in range(300))}) + "\n"
                            for _ in range(30)))
    return path


def calibrate_args(src: Path, out: Path, data: Path) -> list[str]:
    return ["calibrate", "--src", str(src), "--output", str(out), "--calibration-data", str(data),
            "--num-sequences", "5", "--seq-len", "48", "--device", "cpu", "--dtype", "float32", "--hessians",
            "--no-progress", "--no-mtp"]


@pytest.fixture(scope="module")
def one_rank(tiny_ckpt, data, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cal1") / "calib.json"
    dsv4(*calibrate_args(tiny_ckpt, out, data))
    return out


def assert_same_calibration(got: Path, want: Path) -> None:
    a, b = json.loads(want.read_text()), json.loads(got.read_text())
    assert a["experts"] == b["experts"] and a["uncalibrated_experts"] == b["uncalibrated_experts"]
    ha, hb = calibration_hessians(want), calibration_hessians(got)
    for module in a["experts"]:
        for proj in ("w1", "w2"):
            x, y = ha(f"{module}.{proj}"), hb(f"{module}.{proj}")
            torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-5 * float(x.abs().max()))


def assert_split(out: Path, ranks: int) -> None:
    """5 sequences of 48 tokens, one micro-batch each, round robin: each rank's share is in the provenance;
    rank 0 wrote the outputs and nothing else is in the directory."""
    split = json.loads(out.read_text())["distributed"]
    assert split["world_size"] == ranks and split["backend"] == "gloo"
    assert split["tokens_per_rank"] == [48 * len(range(r, 5, ranks)) for r in range(ranks)]
    assert sorted(p.name for p in out.parent.iterdir()) == ["calib.json", "calib.json.d"]


def test_calibration_of_two_ranks_is_the_one_rank_calibration(tiny_ckpt, data, one_rank, tmp_path):
    """Three ranks: the resumed world of the next test, which finishes every layer but the first."""
    out = tmp_path / "calib.json"
    dsv4(*calibrate_args(tiny_ckpt, out, data), ranks=2)
    assert_same_calibration(out, one_rank)
    assert_split(out, 2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def compare_args(base: Path, variant: Path, report: Path, *extra: str) -> list[str]:
    return ["compare", "--base", str(base), "--variant", str(variant), "--random-tokens", "--tokens", "777",
            "--seq-len", "259", "--chunk", "100", "--no-progress", "--report", str(report), *extra]


def comparable(report: Path) -> dict:
    """compare.json without what legitimately differs between runs: timings and the split itself."""
    result = json.loads((report / "compare.json").read_text())
    for key in ("seconds", "peak_device_bytes", "distributed"):
        result.pop(key)
    for block in result["blocks"]:
        block.pop("seconds")
    return result


def test_compare_of_three_ranks_and_of_two_nodes_is_the_one_rank_compare(tiny_ckpt, outputs, tmp_path):
    dsv4(*compare_args(tiny_ckpt, outputs["w4a16"], tmp_path / "one"))
    dsv4(*compare_args(tiny_ckpt, outputs["w4a16"], tmp_path / "three"), ranks=3)
    want = comparable(tmp_path / "one")
    assert comparable(tmp_path / "three") == want
    split = json.loads((tmp_path / "three" / "compare.json").read_text())["distributed"]
    assert split == {"world_size": 3, "backend": "gloo", "tokens_per_rank": [259, 259, 259],
                     "peak_device_bytes_per_rank": [None, None, None]}
    # Two torchrun agents, one rank each, meeting at a rendezvous on localhost as two hosts would.
    port = free_port()
    nodes = [dsv4(*compare_args(tiny_ckpt, outputs["w4a16"], tmp_path / "nodes"), ranks=1, popen=True,
                  extra=("--nnodes", "2", "--node-rank", str(rank), "--rdzv-backend", "c10d",
                         "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "dsv4-test"))
             for rank in range(2)]
    for node in nodes:
        _, err = node.communicate(timeout=TIMEOUT)
        assert node.returncode == 0, err[-3000:]
    assert comparable(tmp_path / "nodes") == want


def test_a_rank_killed_mid_layer_stops_the_run_and_another_world_resumes_it(tiny_ckpt, data, one_rank, tmp_path):
    """Rank 1 stops itself after its micro-batch of layers.1 and is SIGKILLed there; the launcher stops
    rank 0 (waiting in the block's reduction); nothing half-written has a final name; three ranks resume
    from what rank 0 saved and finish with the one-rank result."""
    out = tmp_path / "calib.json"
    point = "calibrate: layers.1: micro-batch 1 done"
    with torture.Stopper() as stopper:
        env = {**ENV, "DSV4_STOP_POINTS": json.dumps(stopper.spec(point))}
        argv = calibrate_args(tiny_ckpt, out, data) + ["--gpus", "0,1"]   # --gpus on the CPU: two CPU ranks
        process = subprocess.Popen([sys.executable, "-m", "dsv4convert", *argv], cwd=REPO, env=env,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        run = torture.Run(process, Path(os.devnull), Path(os.devnull), time.monotonic())
        pid = stopper.wait(run, point)
        assert pid != process.pid       # a rank, not the launcher
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        _, err = process.communicate(timeout=TIMEOUT)
        stopped_in = time.monotonic() - start
    err = err.strip().splitlines()[-1]
    assert process.returncode == 2 and err.startswith("error: rank 1 (pid ") and "signal 9" in err, err
    assert "Run the same command again to resume" in err
    assert stopped_in < TIMEOUT, "the other rank was not stopped"
    work = out.parent / "calib.json.d"
    assert not out.exists()
    assert sorted(p.name for p in work.glob("layers.*")) == ["layers.0.json", "layers.0.safetensors"]
    assert not list(work.rglob("*.partial")) or all(p.name.startswith(".") for p in work.rglob("*.partial"))
    dsv4(*calibrate_args(tiny_ckpt, out, data), ranks=3)
    assert_same_calibration(out, one_rank)
    assert_split(out, 3)


# A rank that joins the world, then loads transformers' model code (as compare and calibrate do), gathers, and
# leaves: gloo's worker threads must be gone when it leaves, not left to interpreter shutdown, where their last
# release of a work's tensors aborts the rank now and then ("terminate called without an active exception").
LEAVE_PROBE = """
import os
from dsv4convert.distributed import join, leave
world = join("cpu")
import transformers.models.deepseek_v4.modeling_deepseek_v4  # imports torch.distributed.nn after the join
world.gather({"rank": world.rank})
leave(world)
names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
alive = sum(n.startswith(("pt_gloo", "gloo")) for n in names)
os.write(1, f"rank {world.rank}: {alive} gloo threads after leave\\n".encode())  # one write: the ranks share stdout
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads thread names from /proc")
def test_leaving_the_world_stops_gloo_threads_before_the_interpreter_ends(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(LEAVE_PROBE)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(probe)], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(done.stdout.splitlines()) == [f"rank {r}: 0 gloo threads after leave" for r in (0, 1)], done.stdout


def test_round_robin_shares_and_the_rank_argument():
    world = World(rank=1, size=3)
    assert [i for i in range(8) if world.owns(i)] == [1, 4, 7]
    assert not World().gather is None and World().gather(5) == [5] and World().broadcast("x") == "x"
    assert strip_gpus(["compare", "--gpus", "0,1", "--base", "b", "--gpus=2,3"]) == ["compare", "--base", "b"]
    assert World(local_rank=1, size=2).device("cuda").index == 1 and World().device("cpu").type == "cpu"
