"""A deployment's model and the weights its nodes load: the plan's checkpoint, or random weights
for a preset without one."""

from __future__ import annotations

from megainfer.config import ModelConfig
from megainfer.model.weights import RandomWeights, SafetensorsCheckpoint, WeightSource
from megainfer.model_resolution import resolve_model
from megainfer.plan import Plan


def checked_model(plan: Plan) -> ModelConfig:
    """The plan's model, checked against the plan before anything starts."""
    model, _ = weights_of(plan)
    plan.check_model(model)  # tp against heads and intermediate size, experts against nodes
    return model


def weights_of(plan: Plan) -> tuple[ModelConfig, WeightSource]:
    model, checkpoint = resolve_model(plan.model)
    return model, SafetensorsCheckpoint(checkpoint) if checkpoint else RandomWeights(0)
