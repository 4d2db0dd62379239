"""KV cache core: specs, planner, layouts, block pool, hashing, per-group managers, coordinator.

Imports nothing from the model, engine or server layers.
"""
