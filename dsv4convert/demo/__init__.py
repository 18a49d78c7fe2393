"""``dsv4convert demo``: the model organism's story (``story.py``) and its command line (``cli.py``, which loads the
story when the command runs)."""
