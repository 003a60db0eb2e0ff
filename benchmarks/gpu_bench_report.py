"""The ratios and the Markdown tables of `benchmarks.gpu_bench`, from its rows."""

from __future__ import annotations

from typing import Any

TARGET_RAW = 0.98  # ours / raw DeepSpeed, tokens/s, every setup
TARGET_PEER = 1.0  # ours / Accelerate and ours / Lightning
TARGET_MFU = 0.40  # ours at ZeRO-0/1/2 (with and without compile) on an H100/H200-class GPU
OTHERS = ("deepspeed", "accelerate", "lightning")


def _ok(row: dict[str, Any] | None) -> bool:
    return row is not None and row.get("status") == "ok"


def ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per setup: ours / raw and ours / each peer (tokens/s), ours' MFU, whether ours and raw
    DeepSpeed were given the same JSON, and the targets it misses (`None`: nothing to compare)."""
    setups = list(dict.fromkeys(r["setup"] for r in rows))
    out = []
    for setup in setups:
        by = {r["framework"]: r for r in rows if r["setup"] == setup}
        ours = by.get("hydraspeed")
        entry: dict[str, Any] = {"setup": setup, "ours_mfu": ours.get("mfu") if _ok(ours) else None}
        misses = []
        for other in OTHERS:
            theirs = by.get(other)
            if not (_ok(ours) and _ok(theirs)):
                entry[f"ours_over_{other}"] = None
                continue
            assert ours is not None and theirs is not None
            ratio = ours["tokens_per_s"] / theirs["tokens_per_s"]
            entry[f"ours_over_{other}"] = ratio
            target = TARGET_RAW if other == "deepspeed" else TARGET_PEER
            if ratio < target:
                misses.append(f"ours/{other} < {target}")
        raw = by.get("deepspeed")
        entry["same_deepspeed_json"] = (
            ours.get("config") == raw.get("config") if _ok(ours) and _ok(raw) else None  # type: ignore[union-attr]
        )
        stage_needs_mfu = _ok(ours) and ours["stage"] <= 2 and not ours["offload"]  # type: ignore[index]
        if stage_needs_mfu and entry["ours_mfu"] is not None and entry["ours_mfu"] < TARGET_MFU:
            misses.append(f"MFU < {TARGET_MFU:.0%}")
        entry["misses"] = misses
        out.append(entry)
    return out


def _num(value: Any, fmt: str) -> str:
    return "—" if value is None else format(value, fmt)


def _model_line(report: dict[str, Any]) -> str:
    setup = report["setup"]
    params = next((r["params"] for r in report["rows"] if r.get("params")), None)
    size = (f"{params / 1e9:.2f} B" if params >= 1e8 else f"{params / 1e6:.2f} M") if params else "size not"
    size += " parameters" if params else " measured"
    return (
        f"Llama ({setup['size']}, {size}, random init, SDPA), bf16, sequence {setup['seq']}, micro-batch "
        f"{setup['micro_batch']}, {setup['steps']} steps measured after {setup['warmup']} warm-up steps"
    )


def markdown(report: dict[str, Any]) -> str:
    """Both tables (rows, then ratios per setup) with the machine and versions above them."""
    v = report["versions"]
    lines = [
        f"### GPU benchmark: {report['device']}",
        "",
        f"{report['date']}; torch {v['torch']} (CUDA {v['cuda']}), DeepSpeed {v['deepspeed']}, transformers "
        f"{v['transformers']}, Accelerate {v['accelerate']}, Lightning {v['lightning']}; {report['seconds']} s.",
        f"{_model_line(report)}.",
    ]
    if report.get("smoke"):
        lines.append("--smoke: a tiny model for a few steps on the CPU; it checks the code paths, not speed.")
    if report["missing"]:
        lines.append(f"Missing here (rows without numbers): {', '.join(report['missing'])}.")
    if report["installed_from_wheels"]:
        lines.append(f"Installed from wheels: {', '.join(report['installed_from_wheels'])}.")
    lines += [
        "",
        "| setup | framework | tokens/s | MFU | peak memory (GB) | first step (s) | ran |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        if r["status"] != "ok":
            status = r["status"][:120].replace("|", "/")
            lines.append(f"| {r['setup']} | {r['framework']} | — | — | — | — | {status} |")
            continue
        ran = r["ran"].replace(" | ", ", ") + (
            "" if r.get("compiled", True) else " (torch.compile off: --smoke)"
        )
        lines.append(
            f"| {r['setup']} | {r['framework']} | {r['tokens_per_s']:,.0f} | {_num(r['mfu'], '.1%')} | "
            f"{r['peak_mem_GB']:.1f} | {r['first_step_s']:.1f} | {ran} |"
        )
    lines += [
        "",
        f"Targets: ours / raw DeepSpeed >= {TARGET_RAW}, ours / peer >= {TARGET_PEER}, "
        f"MFU >= {TARGET_MFU:.0%} at ZeRO-0/1/2.",
        "",
        "| setup | ours / DeepSpeed | ours / Accelerate | ours / Lightning | ours MFU | same DeepSpeed JSON | missed |",
        "|---|---|---|---|---|---|---|",
    ]
    for e in report["ratios"]:
        same = {True: "yes", False: "**no**", None: "—"}[e["same_deepspeed_json"]]
        missed = ", ".join(e["misses"]) or "none"
        lines.append(
            f"| {e['setup']} | {_num(e['ours_over_deepspeed'], '.3f')} | {_num(e['ours_over_accelerate'], '.3f')} "
            f"| {_num(e['ours_over_lightning'], '.3f')} | {_num(e['ours_mfu'], '.1%')} | {same} | {missed} |"
        )
    lines += _profiles(report)
    return "\n".join(lines) + "\n"


def _profiles(report: dict[str, Any]) -> list[str]:
    """Where a setup misses a target: the profile of each of its rows (steps after the window)."""
    from benchmarks.step_profile import line

    missed = [e["setup"] for e in report["ratios"] if e["misses"]]
    out = []
    for r in report["rows"]:
        if r["setup"] in missed and r["status"] == "ok" and r.get("profile"):
            out.append(f"- {r['setup']}, {r['framework']}: {line(r['profile'])}")
    if not out:
        return []
    return ["", "Profiles where a target is missed (steps after the measured window):", "", *out]
