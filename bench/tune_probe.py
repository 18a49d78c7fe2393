"""Whether tile dimensions outside ``tune``'s search space win at decode batch sizes 1-4 on the GPU.

Two warps, BLOCK_SIZE_K 64 with pipelines to 10 stages, 8 warps on 16x64 tiles, and 32-wide tiles
with deeper pipelines and TMA, beside the winners of ``bench/tune.py``'s run at 501b7d0, in one process
with ``tune``'s own search machinery (each checked against SGLang's default config, then the four
fastest per GEMM re-timed longer and the best paired as SGLang runs them). Same setup as
``bench/tune.py``; writes one JSON::

    PYTHONPATH=/tmp/site:/tmp/sgl:. python3 bench/tune_probe.py $OUT/probe.json
"""
from __future__ import annotations

import itertools
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dsv4convert.formats import Format  # noqa: E402
from dsv4convert.synth import reference_config  # noqa: E402
from dsv4convert.tune import device, search  # noqa: E402
from dsv4convert.tune.problem import MoEProblem  # noqa: E402
from dsv4convert.tune.space import Tile  # noqa: E402

T = Tile
WINNERS = {
    "up": [T(16, 64, 128, 1, 4, 7, True), T(16, 64, 128, 1, 4, 6, False), T(16, 128, 128, 64, 4, 4, True)],
    "down": [T(16, 64, 128, 16, 4, 3, True), T(16, 128, 128, 32, 4, 4, True), T(16, 128, 128, 64, 4, 2, True)],
}


def candidates(gemm: str) -> list[Tile]:
    out = []
    for w in WINNERS[gemm]:
        for warps, stages, tma in itertools.product((2,), range(5, 9), (False, True)):
            out.append(replace(w, num_warps=warps, num_stages=stages, use_tma=tma))
    for bn, warps, stages, tma in itertools.product((64, 128), (2, 4), (4, 6, 8, 10), (False, True)):
        out.append(T(16, bn, 64, 1, warps, stages, tma))
    for stages, tma in itertools.product((5, 6, 7), (False, True)):
        out.append(T(16, 64, 128, 1, 8, stages, tma))
        out.append(T(16, 32, 128, 1, 4, stages + 1, tma))
    return list(dict.fromkeys(out))


def main() -> int:
    out = Path(sys.argv[1])
    problem = MoEProblem.from_config(reference_config(), Format.FP8, 4)
    gpu = device.detect()
    sizes = [1, 2, 4]
    s = search._Search(problem, gpu, sizes, seed=0, rep_ms=3)
    s.baselines(True)
    start = time.monotonic()
    for m in sizes:
        for gemm in search.GEMMS:
            for tile in WINNERS[gemm] + candidates(gemm):
                if time.monotonic() - start > 150:
                    break
                s.evaluate(gemm, tile, m, "probe")
    result = {}
    for m in sizes:
        batch = s.batches[m]
        best = {}
        for gemm in search.GEMMS:
            ok = sorted((t for t in s.trials if t.gemm == gemm and t.batch_size == m and t.us is not None
                         and t.tile.block_m == 16), key=lambda t: t.us)
            finalists = list(dict.fromkeys([t.tile for t in ok[:4]] + WINNERS[gemm][:1]))
            longer = {tile: min(s.time(gemm, tile, batch, 20) for _ in range(2)) for tile in finalists}
            best[gemm] = sorted(longer.items(), key=lambda kv: kv[1])
            print(m, gemm, [(t.label(), round(us, 2)) for t, us in best[gemm]], flush=True)
        pairs = {(WINNERS["up"][0], WINNERS["down"][0]): None}
        pairs.update({(u, d): None for u, _ in best["up"][:2] for d, _ in best["down"][:2]})
        timed = {}
        for _ in range(2):
            for pair in pairs:
                timed.setdefault(pair, []).append(s.time_pair(*pair, batch, 20))
        rows = sorted(((min(v), p) for p, v in timed.items()), key=lambda r: r[0])
        print(m, "pairs", [(p[0].label(), p[1].label(), round(us, 2)) for us, p in rows], flush=True)
        result[m] = {"gemms": {g: [(t.to_sglang(), us) for t, us in b] for g, b in best.items()},
                     "pairs": [(p[0].to_sglang(), p[1].to_sglang(), us) for us, p in rows]}
    result["trials"] = [t.to_json() for t in s.trials]
    out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
