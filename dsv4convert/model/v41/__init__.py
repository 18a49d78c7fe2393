"""DeepSeek-V4.1's forward, restated from SGLang 0.5.23's code (no transformers release has it)."""
