"""The contract types every layer above the KV core shares: a request's state and sampling parameters, what the
scheduler hands the runner for one step, and what comes back to the user. Nothing here imports from above."""
