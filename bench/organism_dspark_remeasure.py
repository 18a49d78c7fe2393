"""Re-measure the shipped V4 organism drafter's acceptance as ``train-organism --drafter dspark`` measured it, with
the code as it is now (the drafter's weights unchanged).

Why: ``model/dspark.py`` now holds ``markov_w2`` in BF16 as SGLang 0.5.23 serves it
(``DSparkV4MarkovHead``: ``SGLANG_DSPARK_OPT_MARKOV_W2_BF16``, default on); ``dsv4convert/data/organism-dspark/
dspark.json`` recorded the acceptance with it in float32. Prints the new ``acceptance`` and writes it, with what was
recorded before and where it was measured, to ``--out`` (JSON)::

    python bench/organism_dspark_remeasure.py --device cuda --out "$OUT/remeasured.json"
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from dsv4convert.devices import resolve_device  # noqa: E402
from dsv4convert.organism.dspark import MeasureSettings, Target, describe_acceptance, measure  # noqa: E402
from dsv4convert.organism.export import load_dspark_release, write_organism  # noqa: E402
from dsv4convert.organism.provenance import source_commit  # noqa: E402
from dsv4convert.synth import ORGANISM_DSPARK_DIR  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    device = resolve_device(args.device)
    recorded = json.loads((ORGANISM_DSPARK_DIR / "dspark.json").read_text())
    settings = MeasureSettings(**recorded["measured_on"])
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        path = write_organism(Path(tmp) / "organism", drafter="dspark")
        backbone, drafter = load_dspark_release(path, device=device)
        tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        text = (path / "heldout.txt").read_text(encoding="utf-8")
        acceptance = measure(drafter, Target(backbone, json.loads((path / "config.json").read_text())), tokenizer,
                             text, settings)
    for line in describe_acceptance(acceptance):
        print(line)
    args.out.write_text(json.dumps({
        "acceptance": acceptance, "measured_on": dataclasses.asdict(settings), "commit": source_commit(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "torch": torch.__version__,
        "seconds": round(time.perf_counter() - started, 1),
        "recorded_before": {"acceptance": recorded["acceptance"], "device": recorded["device"],
                            "commit": recorded["commit"]}}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
