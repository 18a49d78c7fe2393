"""``dsv4convert compare``: the model a variant serves against the model it came from.

:mod:`.run` plans and checks (both checkpoints, the data, each side's numerics), :mod:`.engine`
streams both through the model block by block in lockstep, :mod:`.numerics` derives what each
side's server computes with from the launch ``serve`` makes, :mod:`.emulate` installs it on a
layer, :mod:`.metrics` scores the logits and hidden states, :mod:`.dspark` drafts with a DSpark drafter and
localizes what moved its drafts, :mod:`.report` writes the reports.
"""

# Draft blocks per run (all sequences together) a DSpark drafter is compared on; here, not in .dspark, so that
# `compare --help` shows it without loading torch.
DEFAULT_ANCHORS = 4096
# The GPU family whose served numerics a comparison emulates unless told (compare, automix, the demo): the RTX PRO
# 6000's, which quantizes the most activations of the three.
DEFAULT_GPU_FAMILY = "sm120"
