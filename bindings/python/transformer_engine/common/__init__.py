"""Framework-neutral pieces: FP8 recipes (transformer_engine.common.recipe)."""
