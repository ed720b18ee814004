"""The fault suite's tables, made from the declarations and the measurements, never by
hand (design: detection table): the docs' fault table (:func:`fault_table`, from
:data:`~kvreplay.faults.registry.FAULTS`) and the detection and false-alarm tables
(:func:`detection_tables`, from ``bench/faults.py``'s results). The docs site holds them
as generated blocks, so a page that drifts from the suite fails its build and a test."""

from __future__ import annotations

from typing import Any

from kvreplay.faults.registry import FAULTS, OPTIONS

ENGINES = ("vllm", "served", "llamacpp", "hf")
"""Where a fault is measured: vLLM in process, a ``vllm serve`` (the fault planted
through the plugin), llama.cpp in process, transformers."""
COLUMNS = (*OPTIONS, "history")


def _cell_text(text: str) -> str:
    return text.replace("|", "\\|")


def fault_table() -> str:
    """Every declared fault: its engine, the bug it is shaped like, where it hooks, when
    it fires, and the check option that catches it."""
    lines = [
        "| fault | engine | shaped like | where it hooks | fires on | caught by |",
        "|---|---|---|---|---|---|",
    ]
    for f in FAULTS:
        cells = (f"`{f.name}`", f.engine, f.shaped_like, f.path, f.fires, f"`{f.caught_by}`")
        lines.append("| " + " | ".join(_cell_text(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def _cell(result: dict[str, Any] | None, noisy: bool) -> str:
    """A measurement as a cell; ``noisy``: the clean engine fails this option too."""
    if result is None:
        return ""
    if result.get("caught") is None:
        return "error"
    if not result["caught"]:
        return f"missed ({result.get('items_run', '?')} items, {result['seconds']:.0f} s)"
    if noisy:
        return f"fails, as clean does ({result['seconds']:.0f} s)"
    shape = f", {result['shape']}" if result.get("shape") else ""
    return f"**caught** (item {result.get('first_fail_at')}{shape}, {result['seconds']:.0f} s)"


def detection_tables(results: list[dict[str, Any]]) -> str:
    """Per fault and engine, each option's measurement (caught at which item and by which
    shape, or missed, and the seconds, cold); then per engine and option the clean runs
    and their false alarms. An option the clean engine also fails is no detection."""
    detect = {(r["fault"], r["engine"], r["option"]): r for r in results if r["kind"] == "detect"}
    clean = [r for r in results if r["kind"] == "clean"]
    noisy = {(r["engine"], r["option"]) for r in clean if r.get("caught")}
    options = [o for o in COLUMNS if any(k[2] == o for k in detect)]
    lines = [
        "| fault | engine | " + " | ".join(options) + " |",
        "|---|---|" + "---|" * len(options),
    ]
    for fault in FAULTS:
        for engine in ENGINES:
            if any((fault.name, engine) == k[:2] for k in detect):
                cells = [
                    _cell(detect.get((fault.name, engine, o)), (engine, o) in noisy)
                    for o in options
                ]
                lines.append(f"| {fault.name} | {engine} | " + " | ".join(cells) + " |")
    if clean:
        lines += ["", "| engine | option | runs | false alarms | errors |", "|---|---|---|---|---|"]
        for engine in ENGINES:
            for option in COLUMNS:
                group = [r for r in clean if (r["engine"], r["option"]) == (engine, option)]
                if group:
                    alarms = sum(r.get("caught") is True for r in group)
                    errors = sum(r.get("caught") is None for r in group)
                    lines.append(f"| {engine} | {option} | {len(group)} | {alarms} | {errors} |")
    return "\n".join(lines) + "\n"
