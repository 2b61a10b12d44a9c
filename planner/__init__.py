"""Deployment planner: performance model and plan search (built in its own issue)."""
