"""Streaming conversion: recipe -> plan -> validate -> execute (see execute.py)."""
