"""ModelRunner: a scheduled batch -> tensors -> paged attention through the model -> sampled tokens."""
