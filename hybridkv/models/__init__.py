"""Plain torch model definitions and Hugging Face checkpoint loading. Models know nothing of blocks: they compute
q/k/v and hand them to an AttentionFn (see base.py)."""
