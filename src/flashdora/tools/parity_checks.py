"""``flashdora parity``'s bars and verdicts: the training summary and every check of a run (or of merged runs)."""

from __future__ import annotations

import math

from flashdora.tools.parity_render import LOSS_BAR

COSINE_BAR = {"fp32": 0.99999, "autocast": 0.9999}  # flashdora vs PEFT logits (issue 5)
F64_FACTOR, F64_SLACK = 1.5, 1e-6  # flashdora's error vs float64 <= PEFT's * F64_FACTOR + F64_SLACK


def _abs_deltas(curves: list[dict[str, list[float]]], other: str) -> list[float]:
    return [abs(a - b) for c in curves for a, b in zip(c["peft"], c[other], strict=True)]


def summarize_training(curves: list[dict[str, list[float]]]) -> dict[str, float | bool]:
    """Mean and max per-step |loss delta| over all seeds' ``{"peft": [...], "flashdora": [...]}`` curves; with a
    ``"peft_floor"`` curve (``--floor``), the same for PEFT vs PEFT one ulp off (``floor_mean_abs_delta``, ...)."""
    deltas = _abs_deltas(curves, "flashdora")
    finite = all(math.isfinite(v) for c in curves for v in c["peft"] + c["flashdora"])
    out = {
        "mean_abs_delta": sum(deltas) / len(deltas) if finite else math.inf,
        "max_abs_delta": max(deltas) if finite else math.inf,
        "finite": finite,
    }
    if curves and all("peft_floor" in c for c in curves):
        floor = _abs_deltas(curves, "peft_floor")
        finite = all(math.isfinite(v) for v in floor)
        out["floor_mean_abs_delta"] = sum(floor) / len(floor) if finite else math.inf
        out["floor_max_abs_delta"] = max(floor) if finite else math.inf
    return out


def _check(name: str, value: float, op: str, bar: float) -> dict:
    passed = value >= bar if op == ">=" else value <= bar
    return {"name": name, "value": value, "op": op, "bar": bar, "passed": bool(passed)}


def checks(fidelity: dict, training: dict, path_counts: dict[str, int]) -> list[dict]:
    """Every bar of the run as ``{name, value, op, bar, passed}``."""
    out = []
    for mode, res in fidelity.items():
        out.append(
            _check(f"logits {mode}: cosine flashdora vs PEFT", res["flash_vs_peft"]["cosine"], ">=", COSINE_BAR[mode])
        )
        peft_err = res["peft_vs_f64"]["rel_err"]
        out.append(
            _check(
                f"logits {mode}: rel. error vs float64, flashdora (bar from PEFT's)",
                res["flash_vs_f64"]["rel_err"],
                "<=",
                peft_err * F64_FACTOR + F64_SLACK,
            )
        )
    out.append(_check("training: mean |delta loss|", training["mean_abs_delta"], "<=", LOSS_BAR))
    ran = path_counts.get("eager", 0) + path_counts.get("triton", 0)
    out.append(_check("flashdora op calls (its path really ran)", ran, ">=", 1))
    return out
