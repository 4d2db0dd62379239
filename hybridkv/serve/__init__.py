"""HTTP serving: the OpenAI-compatible API over an engine thread."""
