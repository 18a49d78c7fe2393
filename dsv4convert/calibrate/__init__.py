"""``dsv4convert calibrate``: layer-by-layer calibration from the native checkpoint, on one device.

Streams calibration tokens through transformers' DeepSeek-V4 decoder layers one block at a
time (:mod:`.stream`; a DSpark drafter's stages under SGLang's drafting forward: :mod:`.dspark`), records per routed expert the input amax of ``w1``/``w3`` and ``w2``,
the tokens routed and optionally the GPTQ Hessians (:mod:`.stats`), writes them to the
calibration file ``to-nvfp4 --calibration`` reads (:mod:`.calibfile`; the tool reads it through
:mod:`dsv4convert.calibration`), and reports GPTQ's held-out error (:mod:`.report`; GPTQ itself is a
numerics algorithm, ``formats/gptq.py``).
"""
