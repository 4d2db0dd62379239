"""Synthetic tasks with exactly scorable answers (the default model is trained on them)."""
