"""The targets every figure is checked against, and the check: PASS or MISS for each."""

from __future__ import annotations

from typing import Any

from .settings import TORCH_KINDS, variant_names
from .xla_stats import ops_diff

IDENTITY_STEP = 1.02
CLIP_STEP = 1.10
VS_TORCH = {"mlp8x64": 0.5, "cnn": 0.5, "mlp8x256": 0.8}
COMPILE_RATIO = 1.3
# Linear growth: the hooked compile time per layer at the deepest depth is at most this
# multiple of the one at the middle depth (a quadratic cost would give depth ratio 4).
COMPILE_LINEAR = 1.5


def check_targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    checks: list[dict[str, Any]] = []

    def add(target: str, where: str, value: Any, limit: Any, ok: bool) -> None:
        checks.append(
            {"target": target, "where": where, "value": value, "limit": limit, "pass": bool(ok)}
        )

    for case_name, res in results["steps"].items():
        ratios = res["ratios"]
        variants = res["variants"]
        plain = variants["jhooks plain"]
        for name, _flavor, hooks in variant_names():
            key = f"jhooks {name}"
            if hooks in ("identity", "idle"):
                r = ratios[f"{key} / jhooks plain"]
                add(
                    "identity hooks: step time / plain",
                    f"{case_name} {name}",
                    r,
                    IDENTITY_STEP,
                    r <= IDENTITY_STEP,
                )
                same = variants[key]["ops"] == plain["ops"]
                lowered_same = variants[key]["lowered_ops"] == plain["lowered_ops"]
                add(
                    "identity hooks: same compiled operations",
                    f"{case_name} {name}",
                    "same"
                    if same
                    else f"optimized HLO: {ops_diff(variants[key]['ops'], plain['ops'])}; "
                    f"lowered ops: {'same' if lowered_same else 'differ'}",
                    "same",
                    same,
                )
                mem = variants[key]["memory"] == plain["memory"]
                add(
                    "identity hooks: same memory",
                    f"{case_name} {name}",
                    variants[key]["memory"]["temp_size"],
                    plain["memory"]["temp_size"],
                    mem,
                )
            if hooks == "clip":
                r = ratios[f"{key} / jhooks plain"]
                add(
                    "gradient-modifying hooks: step time / plain",
                    f"{case_name} {name}",
                    r,
                    CLIP_STEP,
                    r <= CLIP_STEP,
                )
            if case_name in VS_TORCH and hooks not in ("idle", "none"):
                # Against the faster of PyTorch's thread settings: the larger ratio.
                r = max(ratios[f"{key} / {kind} {name}"] for kind in TORCH_KINDS)
                limit = VS_TORCH[case_name]
                add(
                    "jhooks hooked / PyTorch eager hooked",
                    f"{case_name} {name}",
                    r,
                    limit,
                    r <= limit,
                )
    cost = results.get("compile_cost") or {}
    depths = sorted(int(d) for d in cost)
    for depth in depths:
        for name, row in cost[str(depth)].items():
            if name != "plain":
                r = row["ratio_to_plain"]
                add(
                    "compile time, hooks on every layer / none",
                    f"depth {depth} {name}",
                    r,
                    COMPILE_RATIO,
                    r <= COMPILE_RATIO,
                )
    if len(depths) >= 2:
        mid, top = depths[-2], depths[-1]
        for name in cost[str(top)]:
            if name == "plain":
                continue
            growth = (cost[str(top)][name]["total_s"] / top) / (
                cost[str(mid)][name]["total_s"] / mid
            )
            add(
                "compile time grows linearly: per-layer time, deepest / next",
                f"{name} {top} vs {mid} layers",
                growth,
                COMPILE_LINEAR,
                growth <= COMPILE_LINEAR,
            )
    for c in (results.get("run_overhead") or {}).get("targets", []):
        add(c["target"], "run_overhead", c["value"], c["limit"], c["pass"])
    return checks
