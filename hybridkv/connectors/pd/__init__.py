"""NixlConnector: a decode instance reads the prompt KV of a prefill instance over NIXL."""
