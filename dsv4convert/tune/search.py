"""Find, per batch size, the fastest SGLang tile configs for a problem on this GPU, within a time budget.

The two GEMMs of SGLang's MoE are separate launches that share only the token alignment, i.e.
``BLOCK_SIZE_M`` (SGLang forces the down config's to the up config's). So each is searched on its
own; then, per batch size, the finalists' pairs of one ``BLOCK_SIZE_M`` are timed together as
SGLang runs them (with a TMA down config the gate/up GEMM writes expert-sorted rows, which changes
its speed: a GEMM timed alone does not show it), and the fastest pair is written as the up file
and the ``_down`` file. Every candidate runs once against the output of SGLang's default config
before it is timed, and is dropped if it differs by more than the kernels' tolerance. SGLang's
default config, and its shipped file's entries where one exists, are always timed first, so the
result is never a config that was not measured against them; the shipped pair is among the pairs
timed together, and a tuned pair replaces it only when it is faster by more than
``SHIPPED_MARGIN`` (within it the two are the same speed as far as timing can tell, and the
shipped entries are written unchanged).
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from dsv4convert.tune import sglang_moe, space
from dsv4convert.tune.device import Device
from dsv4convert.tune.problem import MoEProblem, TuneError
from dsv4convert.tune.space import Tile
from dsv4convert.tune.workload import ROUTINGS, TOLERANCE, Batch, make_batch, random_weights, relative_error, time_us

GEMMS = ("up", "down")
REFINED_SHAPES = 2  # per GEMM and batch size, the best shapes the second round varies
CONFIRMED_PER_BLOCK_M = 2  # finalists re-timed per GEMM, batch size and BLOCK_SIZE_M (plus the shipped entry)
PAIRED_PER_BLOCK_M = 2     # of those, the fastest per GEMM whose pairs are timed together
SHIPPED_MARGIN = 0.01      # how much faster than the shipped pair a tuned pair must be to replace it


@dataclass
class Trial:
    """One candidate tile for one GEMM at one batch size."""

    gemm: str
    tile: Tile
    batch_size: int
    round: str                  # "baseline", "shapes", "refine", or "confirm" (a finalist re-timed)
    status: str                 # "ok", "wrong" (differs from the default config), "shared-memory", "failed"
    us: float | None = None
    error: float | None = None  # largest difference from the default config, relative to its largest value
    note: str = ""

    def to_json(self) -> dict:
        return {"gemm": self.gemm, "config": self.tile.to_sglang(), "batch_size": self.batch_size, "round": self.round,
                "status": self.status, "us": self.us, "error": self.error, "note": self.note}


@dataclass
class Choice:
    """The configs written for one batch size, with their times and the default config's."""

    batch_size: int
    up: Tile
    down: Tile
    up_us: float | None         # each GEMM alone (the finalists' longer timing)
    down_us: float | None
    pair_us: float              # the two together, as SGLang runs them
    default_us: float           # SGLang's default config, both GEMMs alone

    def to_json(self) -> dict:
        return {"batch_size": self.batch_size, "up": self.up.to_sglang(), "down": self.down.to_sglang(),
                "up_us": self.up_us, "down_us": self.down_us, "pair_us": self.pair_us, "default_us": self.default_us}


@dataclass
class SearchResult:
    problem: MoEProblem
    device: Device
    choices: dict[int, Choice]
    trials: list[Trial]
    elapsed_s: float
    budget_s: float
    stopped_by_budget: bool
    left_out_for_shared_memory: int
    shapes_planned: int
    shapes_tried: int
    batches: dict = field(default_factory=dict, repr=False)  # the workloads, for ``compare`` to reuse

    def summary(self) -> dict:
        counts: dict[str, int] = defaultdict(int)
        for trial in self.trials:
            counts[trial.status] += 1
        return {"elapsed_s": round(self.elapsed_s, 1), "budget_s": self.budget_s,
                "stopped_by_budget": self.stopped_by_budget, "shapes_planned": self.shapes_planned,
                "shapes_tried": self.shapes_tried, "left_out_for_shared_memory": self.left_out_for_shared_memory,
                "trials": dict(counts)}


def _launch_errors() -> tuple[type[BaseException], ...]:
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources

    return OutOfResources, CompilationError


class _Search:
    def __init__(self, problem: MoEProblem, device: Device, batch_sizes: list[int], *, seed: int, rep_ms: int):
        self.problem, self.device, self.rep_ms = problem, device, rep_ms
        weights = random_weights(problem, device.torch_device, seed)
        routings = ROUTINGS if device.timed else 1
        self.batches = {m: make_batch(problem, weights, m, device.torch_device, seed, routings=routings)
                        for m in batch_sizes}
        self.defaults = {m: Tile.from_sglang(sglang_moe.default_config(problem, m)) for m in batch_sizes}
        self.reference: dict[tuple[str, int], object] = {}
        self.shipped: dict[tuple[str, int], Tile] = {}   # (gemm, batch size) -> the shipped file's entry
        self.confirmed: dict[tuple[str, int, Tile], float] = {}   # the finalists' longer timings
        self.pairs: dict[int, dict[tuple[Tile, Tile], float]] = {}  # batch size -> (up, down) -> us together
        self.trials: list[Trial] = []
        self.best: dict[tuple[str, int], dict[int, tuple[float, Tile]]] = defaultdict(dict)
        self.tried: set[tuple[str, Tile, int]] = set()
        self.out_of_resources, self.compilation_error = _launch_errors()
        self.sorted_up = device.has_tma and problem.kernel.fp8_activations

    def _run(self, gemm: str, tile: Tile, batch: Batch, routing: int):
        """One launch, as timed. Where a TMA down config can run (FP8 on a GPU with TMA; on Hopper it wins the
        down GEMM), the gate/up GEMM writes expert-sorted rows, as SGLang launches it beside one."""
        default_up = self.defaults[batch.size]
        if gemm == "up":
            if self.sorted_up:
                return batch.up(tile, routing, batch.up_output(batch.sorted_rows(tile.block_m)), c_sorted=True)
            return batch.up(tile, routing, batch.up_output())
        a2, a2_scale = batch.down_input(default_up, routing, tile)
        return batch.down(tile, routing, a2, a2_scale, batch.down_output())

    def _output(self, gemm: str, tile: Tile, batch: Batch) -> torch.Tensor:
        """The launch's result in token order (sorted rows depend on ``BLOCK_SIZE_M``), to check against the default's."""
        out = self._run(gemm, tile, batch, 0)
        return batch.token_order(out, tile.block_m, 0) if gemm == "up" and self.sorted_up else out

    def evaluate(self, gemm: str, tile: Tile, m: int, round_: str) -> Trial | None:
        if (gemm, tile, m) in self.tried:
            return None
        self.tried.add((gemm, tile, m))
        batch = self.batches[m]
        trial = Trial(gemm, tile, m, round_, "ok")
        try:
            out = self._output(gemm, tile, batch)
            reference = self.reference.get((gemm, m))
            trial.error = 0.0 if reference is None else relative_error(out, reference)
            if trial.error > TOLERANCE:
                trial.status, trial.note = "wrong", f"differs from SGLang's default config by {trial.error:.3g}"
            else:
                trial.us = self.time(gemm, tile, batch, self.rep_ms)
                table = self.best[(gemm, m)]
                if tile.block_m not in table or trial.us < table[tile.block_m][0]:
                    table[tile.block_m] = (trial.us, tile)
        except self.out_of_resources as exc:
            trial.status, trial.note = "shared-memory", str(exc).split(". Reducing")[0]
        except self.compilation_error as exc:
            trial.status, trial.note = "failed", f"Triton could not compile it: {str(exc).splitlines()[0][:200]}"
        self.trials.append(trial)
        return trial

    def time(self, gemm: str, tile: Tile, batch: Batch, rep_ms: int) -> float:
        routings = range(len(batch.routings))
        return time_us(lambda: [self._run(gemm, tile, batch, r) for r in routings], self.device, rep_ms,
                       len(batch.routings))

    def confirm(self, rep_ms: int) -> None:
        """Re-time the two fastest tiles of each ``BLOCK_SIZE_M`` (and the shipped entry), per GEMM and batch
        size, longer and alternating, so that the choice between near-equal finalists is not one short
        timing's noise."""
        for (gemm, m), table in self.best.items():
            batch = self.batches[m]
            for block_m in table:
                ok = sorted((t for t in self.trials if t.gemm == gemm and t.batch_size == m and t.us is not None
                             and t.tile.block_m == block_m and t.round != "confirm"), key=lambda t: t.us)
                finalists = list(dict.fromkeys(t.tile for t in ok))[:CONFIRMED_PER_BLOCK_M]
                shipped = self.shipped.get((gemm, m))
                if shipped is not None and shipped.block_m == block_m and shipped not in finalists:
                    finalists.append(shipped)
                times: dict[Tile, list[float]] = {tile: [] for tile in finalists}
                for _ in range(2):
                    for tile in finalists:
                        times[tile].append(self.time(gemm, tile, batch, rep_ms))
                for tile, measured in times.items():
                    self.trials.append(Trial(gemm, tile, m, "confirm", "ok", us=min(measured), error=0.0))
                    self.confirmed[(gemm, m, tile)] = min(measured)

    def time_pair(self, up: Tile, down: Tile, batch: Batch, rep_ms: int) -> float:
        routings = range(len(batch.routings))
        default = self.defaults[batch.size]
        return time_us(lambda: [batch.gemms(up, down, r, default) for r in routings], self.device, rep_ms,
                       len(batch.routings))

    def _finalists(self, gemm: str, m: int, block_m: int) -> list[Tile]:
        confirmed = sorted(((us, tile) for (g, size, tile), us in self.confirmed.items()
                            if g == gemm and size == m and tile.block_m == block_m), key=lambda p: p[0])
        return [tile for _, tile in confirmed[:PAIRED_PER_BLOCK_M]]

    def confirm_pairs(self, rep_ms: int) -> None:
        """Time the finalists' pairs of each ``BLOCK_SIZE_M``, and the shipped pair, together and alternating."""
        for m, batch in self.batches.items():
            pairs = [(up, down) for block_m in sorted(set(self.best[("up", m)]) & set(self.best[("down", m)]))
                     for up in self._finalists("up", m, block_m) for down in self._finalists("down", m, block_m)]
            shipped = self._shipped_pair(m)
            if shipped is not None and shipped not in pairs:
                pairs.append(shipped)
            times: dict[tuple[Tile, Tile], list[float]] = {pair: [] for pair in pairs}
            for _ in range(2):
                for pair in pairs:
                    times[pair].append(self.time_pair(*pair, batch, rep_ms))
            self.pairs[m] = {pair: min(measured) for pair, measured in times.items()}

    def baselines(self, shipped: bool) -> None:
        """SGLang's default config (the reference every candidate must match), then its shipped entry."""
        for m, batch in self.batches.items():
            default = self.defaults[m]
            for gemm in GEMMS:
                trial = self.evaluate(gemm, default, m, "baseline")
                if trial.status != "ok":
                    raise TuneError(f"SGLang's default config {default.label()} does not run on this GPU at batch "
                                    f"size {m}: {trial.note}")
                self.reference[(gemm, m)] = self._output(gemm, default, batch).clone()
            if shipped and sglang_moe.lookup(self.problem, None) is not None:
                for gemm, config in zip(GEMMS, sglang_moe.served_configs(self.problem, None, m)):
                    tile = Tile.from_sglang(config)
                    self.evaluate(gemm, tile, m, "baseline")
                    if any(t.tile == tile and t.gemm == gemm and t.batch_size == m and t.us is not None
                           for t in self.trials):
                        self.shipped[(gemm, m)] = tile

    def ranked(self, gemm: str, m: int) -> list[Tile]:
        ok = [t for t in self.trials if t.gemm == gemm and t.batch_size == m and t.status == "ok" and not t.tile.use_tma]
        return [t.tile for t in sorted(ok, key=lambda t: t.us)]

    def choose(self) -> dict[int, Choice]:
        choices = {}
        for m in self.batches:
            times = self.pairs[m]
            pair, us = min(times.items(), key=lambda kv: kv[1])
            shipped = self._shipped_pair(m)
            if shipped in times and pair != shipped and us > times[shipped] * (1 - SHIPPED_MARGIN):
                pair, us = shipped, times[shipped]
            up, down = pair
            default = self.defaults[m]
            default_us = sum(t.us for t in self.trials
                             if t.tile == default and t.batch_size == m and t.round == "baseline" and t.us is not None)
            choices[m] = Choice(m, up, down, self.confirmed.get(("up", m, up)), self.confirmed.get(("down", m, down)),
                                us, default_us)
        return choices

    def _shipped_pair(self, m: int) -> tuple[Tile, Tile] | None:
        """The shipped entries for both GEMMs at batch size ``m``, where a shipped file exists and both ran."""
        up, down = self.shipped.get(("up", m)), self.shipped.get(("down", m))
        return (up, down) if up is not None and down is not None else None


def run_search(problem: MoEProblem, device: Device, batch_sizes: Iterable[int], *, budget_s: float,
               max_candidates: int | None = None, seed: int = 0, rep_ms: int = 3, confirm_rep_ms: int = 10,
               shipped: bool = True,
               progress: bool = True, clock: Callable[[], float] = time.monotonic) -> SearchResult:
    """Search both GEMMs' tiles for every batch size; stop starting new candidates once ``budget_s`` is spent."""
    from tqdm import tqdm

    batch_sizes = sorted(set(batch_sizes))
    start = clock()
    search = _Search(problem, device, batch_sizes, seed=seed, rep_ms=rep_ms)
    search.baselines(shipped)
    shapes, left_out = space.shape_grid(problem, device)
    shapes = [t for t in shapes if any(space.worth_timing(t, problem, m) for m in batch_sizes)]
    if max_candidates is not None:
        shapes = shapes[:max_candidates]
    plan = [(tile, [m for m in batch_sizes if space.worth_timing(tile, problem, m)]) for tile in shapes]
    bar = tqdm(total=sum(len(ms) for _, ms in plan) * len(GEMMS), unit="trial", desc="tune", disable=not progress,
               file=sys.stderr)
    stopped, tried = False, 0

    def over_budget() -> bool:
        return clock() - start > budget_s

    def sweep(work: list[tuple[Tile, list[tuple[str, int]]]], round_: str) -> bool:
        nonlocal tried
        for tile, targets in work:
            if over_budget():
                return True
            for gemm, m in targets:
                search.evaluate(gemm, tile, m, round_)
                bar.update(1)
            tried += round_ == "shapes"
            bar.set_postfix_str(f"{tile.label()}; {clock() - start:.0f}/{budget_s:.0f} s", refresh=False)
        return False

    try:
        stopped = sweep([(tile, [(g, m) for m in ms for g in GEMMS]) for tile, ms in plan], "shapes")
        if not stopped:
            targets: dict[Tile, list[tuple[str, int]]] = defaultdict(list)
            for m in batch_sizes:
                for gemm in GEMMS:
                    for best in search.ranked(gemm, m)[:REFINED_SHAPES]:
                        for tile in space.refinements(best, problem, device, tma=True):
                            if (gemm, m) not in targets[tile]:
                                targets[tile].append((gemm, m))
            refine = list(targets.items())
            if max_candidates is not None:
                refine = refine[:max_candidates]
            bar.total += sum(len(t) for _, t in refine)
            bar.refresh()
            stopped = sweep(refine, "refine")
        search.confirm(confirm_rep_ms)
        search.confirm_pairs(confirm_rep_ms)
    finally:
        bar.close()
    return SearchResult(problem, device, search.choose(), search.trials, clock() - start, budget_s, stopped,
                        left_out, len(plan), tried, search.batches)
