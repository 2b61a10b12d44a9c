"""M2N transport: pre-registered buffers and tagged one-sided writes (built in its own issue)."""
