"""`dsv4convert validate` on the tiny checkpoint and its conversions."""

from __future__ import annotations

import json
import math
import shutil

from dsv4convert.cli import main
from dsv4convert.validate.cli import validate


def test_lossless_variants_validate_as_exact(outputs, tiny_ckpt, tmp_path):
    for variant in ("fp8", "nvfp4", "bf16"):
        result = validate(outputs[variant], against=tiny_ckpt, report_dir=tmp_path / variant, progress=False)
        s = result.summary
        assert s["passed"] and s["integrity_ok"], (variant, s["integrity_problems"])
        assert s["modules"] > 100 and s["exact_modules"] == s["modules"], variant
        assert math.isinf(s["worst_snr_db"])
        doc = json.loads((tmp_path / variant / "validate.json").read_text())
        experts = [m for m in doc["modules"] if m["role"] == "routed_expert"]
        assert experts and all(m["exact"] and m["rel_fro"] == 0.0 for m in experts)
        assert (tmp_path / variant / "snr_per_layer.png").stat().st_size > 1000
        assert "bit-exact against the source" in (tmp_path / variant / "validate.md").read_text()


def test_w4a16_reports_its_error_and_the_threshold_fails_it(outputs, tiny_ckpt, tmp_path, capsys):
    result = validate(outputs["w4a16"], against=tiny_ckpt, report_dir=tmp_path / "r", progress=False)
    s = result.summary
    assert s["passed"] and s["integrity_ok"]
    assert 8.0 < s["worst_snr_db"] < 30.0  # INT4 g128 round-to-nearest on heavy-tailed weights
    doc = json.loads((tmp_path / "r" / "validate.json").read_text())
    int4 = [m for m in doc["modules"] if m["format"] == "int4"]
    assert len(int4) == 144 and not any(m["exact"] for m in int4)
    assert all(0.9 < m["cosine"] < 1.0 and m["output_snr_db"] != "inf" for m in int4)
    assert all(m["exact"] for m in doc["modules"] if m["format"] != "int4")
    md = (tmp_path / "r" / "validate.md").read_text()
    assert "## Worst modules" in md and "mxfp4 -> int4" in md
    code = main(["validate", str(outputs["w4a16"]), "--against", str(tiny_ckpt), "--fail-below-snr", "30",
                 "--report", str(tmp_path / "r2"), "--no-progress"])
    assert code == 1 and "modules below 30.0 dB" in capsys.readouterr().out


def test_integrity_catches_a_stale_quantization_config(outputs, tmp_path, capsys):
    dst = tmp_path / "tampered"
    shutil.copytree(outputs["nvfp4"], dst)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"]["moe_quant_algo"] = "FP8"
    (dst / "config.json").write_text(json.dumps(config))
    code = main(["validate", str(dst), "--report", str(tmp_path / "r"), "--no-progress"])
    out = capsys.readouterr().out
    assert code == 1 and "integrity FAILED" in out and "quantization_config differs" in out
