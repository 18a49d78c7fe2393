"""The model, one block at a time: the single way ``calibrate`` and ``compare`` run DeepSeek-V4.

:mod:`.blocks` builds transformers' decoder layer (and the output heads) for one block from any
checkpoint format; :mod:`.forward` runs a layer over whole sequences in query chunks through its
cache; :mod:`.text` turns the user's text into token windows with the checkpoint's tokenizer.
"""
