"""One package per model family, models/<name>/ (docs/adding_a_model.md); executor/ names none of them."""

# What model_config.model_name defaults to: the family of the default model (SmolLM2-135M-Instruct).
DEFAULT_MODEL_NAME = "llama"
