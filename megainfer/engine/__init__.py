"""The engine: requests in, per-step token deltas out (Engine), fed from other threads (QueuedEngine), stepped by the one step loop (EngineSteps, StepLoop)."""
