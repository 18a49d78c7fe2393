"""DeepSeek-V4.1-Flash (10 Sep 2026) and its -1017 snapshot: the config reader and the native inventory."""
