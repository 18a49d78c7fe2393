"""dsv4convert: streaming, verifiable quantized variants of DeepSeek-V4-Flash for SGLang."""

__version__ = "0.1.0"
