"""The options that choose how `simulate` and `simulate-routing` price a step: a GPU from the
catalog with its efficiency curves, or an operator profile measured by `megainfer profile`."""

from __future__ import annotations

import argparse


def add_step_model_options(parser: argparse.ArgumentParser, *, default_tp: int, gpu_help: str) -> None:
    from megainfer.cli.options import positive_int

    parser.add_argument("--gpu", default=None, help=gpu_help + " (default: H100, or the profile's GPU)")
    parser.add_argument("--tp", type=positive_int, default=None,
                        help=f"GPUs of an instance, tensor parallel (default: {default_tp}, or the profile's)")
    parser.add_argument("--catalog", help="GPU catalog YAML (default: the built-in one)")
    parser.add_argument("--profile", metavar="PATH",
                        help="operator profile from `megainfer profile`: steps are priced from its measurements "
                             "where its grid covers them, from efficiency curves elsewhere")
    parser.add_argument("--curves", metavar="PATH",
                        help="efficiency curves YAML (default: planner/efficiency_curves.yaml)")


def build_step_models(args: argparse.Namespace, model, *, default_tp: int) -> list:
    """One step model per GPU named in --gpu (comma-separated), priced as the options say."""
    from megainfer.errors import ConfigError
    from planner.catalog import Catalog
    from planner.operator_profile import OperatorProfile
    from planner.step_cost_model import ColocatedStepModel

    profile = OperatorProfile.load(args.profile) if args.profile else None
    tp = args.tp or (profile.tp if profile is not None else default_tp)
    if args.gpu:
        names = [g.strip() for g in args.gpu.split(",") if g.strip()]
    elif profile is not None:
        names = [profile.device.catalog_name]  # None: a device outside the catalog (a CPU)
    else:
        names = ["H100"]
    if profile is not None and len(names) > 1:
        raise ConfigError("--profile measures one device: give one --gpu with it (or none)")
    catalog = Catalog.load(args.catalog)
    return [ColocatedStepModel(model, catalog[name] if name else None, tp, profile=profile, curves_path=args.curves)
            for name in names]


def describe_sources(step_model) -> str:
    """Which operators a run priced from the profile and which from curves."""
    sources = step_model.explain()
    if not sources:
        return ""
    width = max(len(op) for op, _ in sources)
    lines = ["operators priced from:"] + [f"  {op:{width}s}  {where}" for op, where in sources]
    if any("curves" in where for _, where in sources):
        lines.append(f"  curves: {step_model.curves.source}")
    return "\n".join(lines)
