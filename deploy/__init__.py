"""Ray deployment of attention and expert nodes (built in its own issue)."""
