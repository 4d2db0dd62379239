"""`hybridkv bench pd-accuracy`: a sweep of prefill/decode disaggregation over models x KV layouts x topologies x
routers, each cell's lm-eval score and greedy outputs compared with one plain instance's (as vLLM's
config_sweep_accuracy_test.sh does for its NixlConnector)."""
