"""DeepSeek-V4.1's forward in plain torch, restated rule by rule from SGLang 0.5.23's V4.1 code."""
