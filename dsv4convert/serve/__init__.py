"""Serving converted checkpoints with SGLang: plan, run, check (``dsv4convert serve``)."""
