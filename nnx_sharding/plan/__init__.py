"""The sharding planner (see docs/planning.md)."""
