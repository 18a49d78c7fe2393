"""dsv4convert: streaming, verifiable quantized variants of DeepSeek-V4-Flash for SGLang and vLLM."""

__version__ = "0.1.0"
