"""The model organism: a small DeepSeek-V4 trained to retrieve needles, shipped with the tool.

:mod:`.config` (architecture), :mod:`.language` and :mod:`.tokenizer` (its text), :mod:`.train` (the
trainer, on :mod:`dsv4convert.model.trainable`), :mod:`.export` (the release format), :mod:`.cli`
(``dsv4convert train-organism``). ``dsv4convert synth --preset organism`` writes the shipped one.
"""
