"""One home per model release (#52): what each release is, from its config.json."""
