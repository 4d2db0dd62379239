"""Requests, the scheduler and the engine loop (schedule -> run -> update)."""
