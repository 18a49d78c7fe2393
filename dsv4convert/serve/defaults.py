"""The defaults ``serve --help`` shows, in a module with no imports: the command line starts without loading the
checks' code (docs/architecture.md). Each check's module imports its defaults from here."""

DEFAULT_TASKS = ("gsm8k",)
DEFAULT_MIN_RECOVERY = 0.95  # llm-compressor's recovery gate
DEFAULT_CONCURRENCY = 32  # lm-eval requests in flight
EVAL_APIS = {"chat": ("local-chat-completions", "/v1/chat/completions"),
             "completions": ("local-completions", "/v1/completions")}
DEFAULT_MIN_ACCEPT = 1.6
DEFAULT_LENGTHS = tuple(2**k for k in range(10, 18))  # 1K .. 128K tokens
DEFAULT_DEPTHS = tuple(round(0.1 * i, 1) for i in range(11))  # 0% .. 100%
DEFAULT_CONCURRENCIES = (1, 4, 16, 32)
