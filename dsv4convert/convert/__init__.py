"""Streaming conversion: recipe -> plan -> validate -> execute (execute.py: shard jobs on workers; pipeline.py: one shard read, converted, written)."""
