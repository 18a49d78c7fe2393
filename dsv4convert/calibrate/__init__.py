"""``dsv4convert calibrate``: layer-by-layer calibration from the native checkpoint, on one device.

Streams calibration tokens through transformers' DeepSeek-V4 decoder layers one block at a
time (:mod:`.stream`), records per routed expert the input amax of ``w1``/``w3`` and ``w2``,
the tokens routed and optionally the GPTQ Hessians (:mod:`.stats`), writes them to the
calibration file ``to-nvfp4 --calibration`` reads (:mod:`.calibfile`), and provides GPTQ for
W4A16 INT4 (:mod:`.gptq`) and a held-out error report (:mod:`.report`).
"""

from dsv4convert.calibrate.calibfile import CalibrationHessians, calibration_hessians
from dsv4convert.calibrate.gptq import gptq_quantize_int4

__all__ = ["CalibrationHessians", "calibration_hessians", "gptq_quantize_int4"]
