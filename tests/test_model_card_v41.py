"""The model card of every DeepSeek-V4.1 conversion (#53): written by each variant's conversion of tiny-v41; its
commands are the ones ``serve --dry-run`` prints (absolute model path), SGLang 0.5.23's own resolution and vLLM
0.33.0's own parser take them; it never offers an engine that refuses the variant on a family; its ``validate`` line
names the output and its source by absolute path (tests/test_v41_convert.py runs that validation on every output)."""

from __future__ import annotations

import re
import shlex

import pytest
import sglang_oracle as sgl
from conftest import V41_VARIANTS

from dsv4convert.cli import main
from dsv4convert.engines import GPU_FAMILIES, SGLANG, VLLM, gpu_of_family
from dsv4convert.engines.config import v41_families, v41_variant_of
from dsv4convert.engines.vllm.quant_config import v41_problem as vllm_problem


def sections(card: str) -> dict[tuple[str, str], str]:
    """(engine heading, machine heading) -> that section's text."""
    found, engine, machine = {}, "", ""
    for block in re.split(r"^(## .*|### .*)$", card, flags=re.M)[1:]:
        if block.startswith("## "):
            engine, machine = block, ""
        elif block.startswith("### "):
            machine = block
        elif engine.startswith("## Serving") and machine:
            found[engine, machine] = block
    return found


def commands(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)\n```", text, flags=re.S)


@pytest.mark.parametrize("variant", V41_VARIANTS)
def test_every_v41_conversion_carries_a_card_whose_commands_the_engines_take(v41_outputs, tiny_v41, variant, capsys):
    import json

    import vllm_oracle as vllm

    out = v41_outputs[variant]
    card = (out / "README.md").read_text()
    config = json.loads((out / "config.json").read_text())
    assert v41_variant_of(config) == variant and f"# DeepSeek-V4.1-Flash, {variant} variant" in card
    assert "`tokenizer.json`, byte for byte" in card and "Engram tables, byte for byte" in card
    engines = config.get("quantization_config", {}).get("producer", {}).get("engines", [SGLANG, VLLM])
    found = sections(card)
    asked = []
    for family in GPU_FAMILIES:
        gpu = gpu_of_family(family)
        machine = f"### 8x {gpu.label}"
        sglang = found.get(("## Serving with SGLang 0.5.23", machine))
        refusal = v41_families(variant)[SGLANG][family]
        if refusal:
            assert commands(sglang) == [] and refusal in sglang
        else:
            (line,) = commands(sglang)
            words = shlex.split(line)
            env = dict(w.split("=", 1) for w in words[:words.index("python")])
            argv = words[words.index("sglang.launch_server") + 1:]
            assert argv[:2] == ["--model-path", str(out.resolve())]
            # The same command serve prints for these GPUs (on the server's own port), its Engram placement included.
            assert main(["serve", "--dry-run", "--model", str(out), "--gpu-family", family, "--gpus",
                         "0,1,2,3,4,5,6,7", "--port", "30000"]) == 0
            planned = [shlex.split(x) for x in capsys.readouterr().out.splitlines() if "sglang.launch_server" in x]
            (served,) = planned
            assert served[served.index("sglang.launch_server") + 1:] == argv
            assert dict(w.split("=", 1) for w in served[:served.index("-m") - 1]) == env
            resolved = sgl.resolve_server_args(argv, gpu=family, env=env).resolved_dict()
            assert resolved["speculative_algorithm"] == "DSPARK" and resolved["tp_size"] == 8
            assert "Engram placement, fit's choice" in sglang and "PD 4+4" in sglang
        heading = ("## Serving with vLLM 0.33.0", machine)
        if VLLM not in engines:
            assert heading not in found and vllm_problem(config.get("quantization_config"), variant)
            assert "Not for vLLM 0.33.0" in card
            continue
        (line,) = commands(found[heading])
        words = shlex.split(line)
        assert words[:3] == ["vllm", "serve", str(out.resolve())]
        asked.append(vllm.request_v41(out, words[3:], gpu=family, resolve_only=True))
    for answer in vllm.run(asked) if asked else []:
        assert "raised" not in answer, answer.get("traceback", answer.get("raised"))
        assert answer["resolved"]["draft_architectures"] == ["DSparkV41DraftModel"]
    (validate,) = [c for c in commands(card) if c.startswith("dsv4convert validate")]
    words = shlex.split(validate)
    assert words[2:] == [str(out.resolve()), "--against", str(tiny_v41.resolve())]
