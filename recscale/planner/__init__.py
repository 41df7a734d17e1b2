"""Sharding planner: hardware presets, a cost model, option search and baselines."""
