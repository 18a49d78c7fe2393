"""Crash torture at CI size: SIGKILL a real conversion at named points of every phase, SIGTERM and
Ctrl-C it, resume, and require the bytes of an uninterrupted run (the harness is bench/torture.py;
the larger run and its numbers are in docs/reliability.md).

Every kill lands by construction: the conversion stops itself at the point
(dsv4convert/stop_points.py) and is killed there, so a slow or busy machine changes nothing that is
tested. Each point is its own case; a point the conversion no longer reaches fails by name.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from dsv4convert.serve.process import live_processes

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import torture  # noqa: E402

SHARD_BYTES = 1_000_000  # the tiny model's ~7.8 MB output in 10+ shards

STARTUP = ["source: reading the index", "source: reading its middle shard header", "destination: creating it",
           "lock: writing its draft", "lock: linking", "resume state (0 shards): writing",
           "resume state (0 shards): renaming"]
SHARD_STEPS = ["opening its .partial", ".partial opened", "converting its middle module", "writing its middle tensor",
               "renaming its .partial", "renamed, resume state not yet written", "resume state being written",
               "resume state written, before its rename"]
FINALIZE = ["copying the first small file", "config.json: writing", "config.json: renaming",
            "hf_quant_config.json: writing", "hf_quant_config.json: renaming", "provenance.json: writing",
            "provenance.json: renaming", "output: re-inspecting", "reading an output shard header",
            "README.md: writing", "README.md: renaming", "model.safetensors.index.json: writing",
            "model.safetensors.index.json: renaming", "final resume state: writing", "final resume state: renaming",
            "lock: releasing"]
SHARDS = ("first shard", "middle shard", "last shard")
RANDOMS = 2
NVFP4_POINTS = (STARTUP + [f"{where}: {step}" for where in SHARDS for step in SHARD_STEPS]
                + [f"finalize: {step}" for step in FINALIZE] + [f"random point {i + 1} (seed 7)" for i in range(RANDOMS)])
# fp8 writes other bytes through the same machinery: its shard writes and finalization (no hf_quant_config.json).
FP8_POINTS = ([f"{where}: {step}" for where in SHARDS for step in SHARD_STEPS[:5]]
              + [f"finalize: {step}" for step in FINALIZE if not step.startswith("hf_quant_config.json")])


@pytest.fixture(scope="module")
def launchers(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("torture")
    fork, exec_ = torture.ForkLauncher(workdir), torture.Launcher(workdir)
    yield fork, exec_
    fork.close()
    exec_.close()


def make_torture(launcher, tiny_ckpt: Path, workdir: Path, recipe: str) -> torture.Torture:
    t = torture.Torture(launcher, tiny_ckpt, workdir, recipe, shard_bytes=SHARD_BYTES, timeout=300.0)
    t.make_reference()
    return t


@pytest.fixture(scope="module")
def nvfp4(launchers, tiny_ckpt, tmp_path_factory) -> torture.Torture:
    return make_torture(launchers[0], tiny_ckpt, tmp_path_factory.mktemp("nvfp4"), "nvfp4")


@pytest.fixture(scope="module")
def fp8(launchers, tiny_ckpt, tmp_path_factory) -> torture.Torture:
    return make_torture(launchers[0], tiny_ckpt, tmp_path_factory.mktemp("fp8"), "fp8")


def kill_point(t: torture.Torture, label: str) -> torture.KillPoint:
    """The named case's point in the reference run; a case whose point is gone fails by its name."""
    points = t.catalogue(every_shard=False, randoms=RANDOMS, seed=7)
    if label not in points:
        pytest.fail(f"kill point {label!r} is not passed by an uninterrupted {t.recipe} conversion "
                    f"(its points: {sorted(points)})")
    return points[label]


def assert_survived(outcome: torture.Outcome) -> None:
    assert outcome.killed
    assert outcome.problems_after_kill == [], outcome.problems_after_kill
    assert outcome.bytes_lost == 0
    assert outcome.identical, outcome.diffs


def test_trace_reaches_every_phase(nvfp4):
    points = nvfp4.catalogue(every_shard=True, randoms=2, seed=0).values()
    assert {p.phase for p in points} == {"reading", "prepare", "lock", "state", "writing", "quantizing", "renaming",
                                         "finalize", "random"}
    assert len(points) >= 60 and len(nvfp4.sizes) >= 10
    # Every case named here is a point of the uninterrupted run, and the catalogue holds nothing else.
    assert set(nvfp4.catalogue(every_shard=False, randoms=RANDOMS, seed=7)) == set(NVFP4_POINTS)
    # The reference itself is a complete, valid conversion that nothing else wrote into.
    assert "model.safetensors.index.json" in nvfp4.reference and ".dsv4convert/state.json" in nvfp4.reference
    assert not any(name.endswith(".partial") or name.endswith("lock") for name in nvfp4.reference)


@pytest.mark.parametrize("label", NVFP4_POINTS)
def test_sigkill_then_resume_is_byte_identical(nvfp4, tmp_path, label):
    point = kill_point(nvfp4, label)
    outcome = nvfp4.survive(point, tmp_path / "dst")
    assert_survived(outcome)
    if label == "finalize: lock: releasing":  # every shard was done and kept, none redone
        assert outcome.finished_before_resume == len(nvfp4.sizes) and outcome.bytes_redone == 0


@pytest.mark.parametrize("label", FP8_POINTS)
def test_sigkill_fp8_writing_and_finalizing(fp8, tmp_path, label):
    assert_survived(fp8.survive(kill_point(fp8, label), tmp_path / "dst"))


def test_a_point_that_is_never_reached_fails_by_name(nvfp4, tmp_path):
    gone = torture.KillPoint("gone", "writing", "model-99999-of-99999.safetensors: opening its .partial", 1, 0)
    with pytest.raises(torture.PointNotReached, match="without reaching 'model-99999-of-99999"):
        nvfp4.kill_run(tmp_path / "dst", gone, resume=False)


@pytest.mark.parametrize("sig, group, label", [
    (signal.SIGTERM, False, "first shard: .partial opened"),  # a scheduler stopping the job
    (signal.SIGINT, True, "middle shard: opening its .partial"),  # Ctrl-C: the terminal signals the whole group
])
def test_sigterm_and_ctrl_c_stop_cleanly_and_resume(launchers, tiny_ckpt, nvfp4, tmp_path, sig, group, label):
    real = torture.Torture(launchers[1], tiny_ckpt, tmp_path, "nvfp4", shard_bytes=SHARD_BYTES, timeout=300.0)
    real.reference, real.sizes = nvfp4.reference, nvfp4.sizes
    result = real.interrupt(tmp_path / "dst", sig, kill_point(nvfp4, label), group=group)
    assert result["exit_status"] == 2, result
    stderr = result["stderr"]
    assert stderr.startswith("error: ") and "\n" not in stderr and "Traceback" not in stderr, stderr
    assert "interrupted" in stderr and "--resume" in stderr and str(tmp_path / "dst") in stderr
    assert result["leftovers"] == []  # the .partial was removed and the lock released
    assert result["identical"], result["diffs"]


def test_state_records_only_complete_shards_after_each_kill(nvfp4, tmp_path):
    """The invariant check itself must catch a torn file under a final name and a lying state."""
    dst = tmp_path / "dst"
    nvfp4.kill_run(dst, kill_point(nvfp4, "middle shard: resume state written, before its rename"), resume=False)
    assert torture.problems_after_kill(dst, nvfp4.reference) == []
    shard = sorted(p for p in dst.glob("model-*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-1])
    assert any("differs" in p for p in torture.problems_after_kill(dst, nvfp4.reference))
    state_path = dst / ".dsv4convert" / "state.json"
    state = json.loads(state_path.read_text())
    assert shard.name in state["shards"]
    assert any("state.json lists" in p for p in torture.problems_after_kill(dst, nvfp4.reference))


# ---------------------------------------------------------------- disk full and write errors


def limit_file_size(nbytes: int):
    """preexec_fn: files may not grow past ``nbytes``; SIGXFSZ ignored so write() fails with EFBIG."""
    def apply() -> None:
        import resource

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))
    return apply


def test_file_size_limit_fails_in_one_line_and_resume_completes(launchers, nvfp4, tmp_path):
    dst = tmp_path / "dst"
    smallest = min(nvfp4.sizes.values())
    assert smallest < 400_000 < max(nvfp4.sizes.values())
    run = launchers[1].start(nvfp4.argv(dst, resume=False), preexec=limit_file_size(400_000))
    code = run.wait(300)
    err = run.output()[1].strip()
    assert code == 2, err
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    assert "cannot write (EFBIG: File too large)" in err and ".safetensors" in err
    assert not list(dst.glob(".*.partial")) and not (dst / ".dsv4convert" / "lock").exists()
    assert not (dst / "model.safetensors.index.json").exists()
    assert torture.problems_after_kill(dst, nvfp4.reference) == []
    finished = torture.finished_shards(dst)
    assert finished and all(size <= 400_000 for _, _, size in finished.values())
    assert nvfp4.resume(dst) is None
    assert torture.compare(dst, nvfp4.reference) == []
    assert {n: v for n, v in torture.finished_shards(dst).items() if n in finished} == finished


def test_disk_full_mid_run_fails_in_one_line_and_resume_completes(nvfp4, tmp_path):
    """ENOSPC from the kernel: the .partial of a later shard is a link to /dev/full, planted while the
    run is stopped past its start-up cleanup (every write to /dev/full fails with ENOSPC)."""
    dst = tmp_path / "dst"
    victim = sorted(nvfp4.sizes)[len(nvfp4.sizes) // 2]
    with torture.Stopper() as stopper:
        run, _ = nvfp4.stopped_run(dst, kill_point(nvfp4, "first shard: resume state written, before its rename"),
                                   stopper, resume=False)
        (dst / f".{victim}.partial").symlink_to("/dev/full")
        stopper.let_go()
        code = run.wait(300)
    err = run.output()[1].strip()
    assert code == 2, err
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    assert f"{victim}" in err and "cannot write (ENOSPC: No space left on device)" in err
    assert not list(dst.glob(".*.partial"))
    assert torture.problems_after_kill(dst, nvfp4.reference) == []
    assert nvfp4.resume(dst) is None
    assert torture.compare(dst, nvfp4.reference) == []


def test_shard_writer_and_small_files_turn_enospc_into_one_error(tmp_path):
    import torch

    from dsv4convert.checkpoint import PlannedTensor, ShardWriter, atomic_write_json, partial_path
    from dsv4convert.errors import CheckpointError

    path = tmp_path / "s.safetensors"
    partial_path(path).symlink_to("/dev/full")
    # The header goes to disk when the writer opens the file (writes are unbuffered), so that fails first.
    with pytest.raises(CheckpointError, match=r"s\.safetensors: cannot write \(ENOSPC"):
        with ShardWriter(path, [PlannedTensor("a", "F32", (1 << 20,))]) as writer:
            writer.write("a", torch.zeros(1 << 20))
    assert not partial_path(path).exists() and not path.exists()
    partial_path(tmp_path / "state.json").symlink_to("/dev/full")
    with pytest.raises(CheckpointError, match=r"state\.json: cannot write \(ENOSPC"):
        atomic_write_json(tmp_path / "state.json", {"x": 1})
    assert not partial_path(tmp_path / "state.json").exists() and not (tmp_path / "state.json").exists()


# ---------------------------------------------------------------- concurrent runs and locks


def test_second_conversion_into_the_same_destination_is_refused(nvfp4, tmp_path):
    """While the first run holds the lock (stopped mid-shard), every second run is refused; released, the
    first one finishes as if nothing had happened."""
    dst = tmp_path / "dst"
    with torture.Stopper() as stopper:
        first, pid = nvfp4.stopped_run(dst, kill_point(nvfp4, "middle shard: writing its middle tensor"), stopper,
                                       resume=False)
        assert pid == first.popen.pid
        for extra in (["--resume"], ["--overwrite"], []):
            argv = [a for a in nvfp4.argv(dst, resume=False)] + extra
            second = nvfp4.launcher.start(argv)
            assert second.wait(300) == 2
            err = second.output()[1].strip()
            assert err.startswith("error: ") and "\n" not in err, err
            if extra:
                assert f"another conversion (pid {first.popen.pid} on " in err and "is writing this destination" in err
            else:
                assert "destination is not empty" in err
        stopper.let_go()
        assert first.wait(300) == 0, first.output()[1]
    assert torture.compare(dst, nvfp4.reference) == []


def test_stale_lock_of_a_killed_run_is_recovered_on_resume(nvfp4, tmp_path):
    dst = tmp_path / "dst"
    nvfp4.kill_run(dst, kill_point(nvfp4, "middle shard: writing its middle tensor"), resume=False)
    holder = json.loads((dst / ".dsv4convert" / "lock").read_text())
    with pytest.raises(OSError):
        os.kill(holder["pid"], 0)
    run = nvfp4.launcher.start(nvfp4.argv(dst, resume=True))
    assert run.wait(300) == 0
    assert f"removing stale lock of dead process {holder['pid']}" in run.output()[1]
    assert torture.compare(dst, nvfp4.reference) == []


def test_lock_without_a_holder_is_stale_only_after_the_grace_period(tmp_path, capsys):
    from dsv4convert.convert.state import LOCK_WRITE_GRACE, DestinationLock
    from dsv4convert.errors import DSV4Error

    lock = DestinationLock(tmp_path)
    lock.path.parent.mkdir(parents=True)
    lock.path.write_text("")  # a run killed between creating the file and writing its pid
    with pytest.raises(DSV4Error, match="another conversion \\(an unknown process\\)"):
        lock.acquire()
    old = time.time() - LOCK_WRITE_GRACE - 1
    os.utime(lock.path, (old, old))
    lock.acquire()
    assert "no holder recorded" in capsys.readouterr().err
    assert json.loads(lock.path.read_text())["pid"] == os.getpid()
    lock.release()
    assert not lock.path.exists()


def children_of(pid: int) -> list[int]:
    """Live child pids of ``pid``, oldest first."""
    return sorted(child for child, parent, _ in live_processes() if parent == pid)


def test_worker_killed_by_the_system_is_one_line_and_resumable(launchers, nvfp4, tmp_path):
    """The OOM killer takes one worker, not the whole run: the driver must say so in one line."""
    dst = tmp_path / "dst"
    two_workers = torture.Torture(launchers[1], nvfp4.src, tmp_path, "nvfp4", shard_bytes=SHARD_BYTES, workers=2)
    with torture.Stopper() as stopper:
        run, pid = two_workers.stopped_run(dst, kill_point(nvfp4, "middle shard: writing its middle tensor"), stopper,
                                           resume=False)
        assert pid in children_of(run.popen.pid) and b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
        os.kill(pid, signal.SIGKILL)  # the pool worker writing that shard, stopped mid-write
        code = run.wait(300)
    err = run.output()[1].strip()
    # The dead worker could not remove its .partial; only temporary files are left, and resume cleans them.
    assert torture.problems_after_kill(dst, nvfp4.reference) == []
    assert not (dst / ".dsv4convert" / "lock").exists()
    assert nvfp4.resume(dst) is None and torture.compare(dst, nvfp4.reference) == []
    assert code == 2 and err.startswith("error: ") and "\n" not in err and "--resume" in err, err


def test_interrupt_while_a_shard_is_being_opened_leaves_no_partial(tmp_path, monkeypatch):
    """SIGTERM right after the .partial is created, before any ``with`` holds the writer (the
    bench caught one left behind by a SIGTERM that landed there)."""
    from dsv4convert.checkpoint import PlannedTensor, ShardWriter, partial_path
    from dsv4convert.checkpoint import writer as shard_writer

    class InterruptedPack:
        @staticmethod
        def pack(*args):
            raise KeyboardInterrupt

    monkeypatch.setattr(shard_writer, "struct", InterruptedPack)
    path = tmp_path / "s.safetensors"
    with pytest.raises(KeyboardInterrupt):
        ShardWriter(path, [PlannedTensor("a", "F32", (1,))])
    assert not partial_path(path).exists() and not path.exists()
