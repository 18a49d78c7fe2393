"""Streaming conversion: recipe -> plan -> validate -> execute (execute.py: shard jobs on workers; pipeline.py: one shard read, converted, written)."""

# The largest output shard by default (`--max-shard-size`); here, beside nothing heavy, so that `--help` shows it
# without loading the converter.
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3
