"""The engine's scheduling: the scheduler and its output, the token recorder, sequences, the KV cache's blocks, the step layout, what routers see (node_state)."""
