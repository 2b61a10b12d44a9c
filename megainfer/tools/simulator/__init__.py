"""`megainfer simulate`: the real scheduler driven by the planner's step model instead of a model."""
