"""validate's SGLANG_DSV4_FP4_EXPERTS note says what the variable does, the value that applies and why (#54)."""

from __future__ import annotations

import pytest

from dsv4convert.validate.sglang_load import Fp4ExpertsSetting


@pytest.mark.parametrize("needed, dtype, fp4, wrong", [("0", "F8_E4M3", False, False), ("0", "U8", True, True),
                                                       ("1", "U8", True, False), ("0", None, True, True)])
def test_the_note_explains_the_variable_the_value_and_the_guess(needed, dtype, fp4, wrong):
    tensor = "layers.0.ffn.experts.0.w1.weight" if dtype else None
    note = Fp4ExpertsSetting(needed, tensor, dtype, fp4).describe()
    assert note.startswith("SGLANG_DSV4_FP4_EXPERTS tells SGLang whether the routed experts are stored as MXFP4")
    assert f"serve with SGLANG_DSV4_FP4_EXPERTS={needed}." in note
    assert ("are MXFP4" in note) == (needed == "1")
    assert f"={needed}: unset" not in note and "is_fp4_experts=" not in note
    assert (tensor or "no routed-expert '.weight' tensor") in note
    assert ("the wrong expert path" in note) == wrong and ("right here" in note) == (not wrong)
