"""PNG plots of the results (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

COLORS = {"asyncio": "tab:blue", "trio": "tab:orange"}


def _save(fig: Any, out_dir: Path, name: str) -> Path:
    path = out_dir / f"{name}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def overhead(payload: dict[str, Any], out_dir: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4))
    for variant, style in (("inline", "-o"), ("threads", "--s")):
        for backend, color in COLORS.items():
            rows = [r for r in payload["rows"] if r["variant"] == variant and r["backend"] == backend]
            if rows:
                ax.plot(
                    [r["n"] for r in rows],
                    [r["ratio"] for r in rows],
                    style,
                    color=color,
                    label=f"{backend}, env calls {'inline' if variant == 'inline' else 'in 32 worker threads'}",
                )
    for variant, style in (("inline", "-^"), ("threads", "--^")):
        rows = [r for r in payload["rows"] if r["variant"] == variant and "skyrl_ratio" in r]
        if rows:
            ax.plot(
                [r["n"] for r in rows],
                [r["skyrl_ratio"] for r in rows],
                style,
                color="tab:green",
                label="SkyRL's SkyRLGymGenerator (asyncio), env calls "
                + ("inline" if variant == "inline" else "in 32 threads"),
            )
    ax.axhline(1.10, color="gray", linestyle=":", label="goal 1.10")
    ax.axhline(1.0, color="black", linewidth=0.5)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("rollouts per generate() (N)")
    ax.set_ylabel("time ratio generator / bare loop")
    ax.set_title(f"Orchestration overhead ({payload['turns']} turns per rollout, instant engine)")
    ax.legend(fontsize=8)
    return _save(fig, out_dir, "overhead")


def scale(payload: dict[str, Any], out_dir: Path) -> Path:
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for backend, color in COLORS.items():
        rows = [r for r in payload["rows"] if r["backend"] == backend]
        if not rows:
            continue
        ns = [r["n"] for r in rows]
        left.plot(ns, [r["per_rollout_us"] for r in rows], "-o", color=color, label=backend)
        right.plot(
            ns, [r["peak_traced_per_rollout_bytes"] / 1024 for r in rows], "-o", color=color, label=f"{backend} peak"
        )
        if backend == "asyncio":
            right.plot(
                ns,
                [r["retained_output_bytes"] / r["n"] / 1024 for r in rows],
                ":",
                color="gray",
                label="output kept after generate()",
            )
            right.plot(
                ns,
                [r["bare_peak_traced_per_rollout_bytes"] / 1024 for r in rows],
                "--",
                color="black",
                label="bare loop peak",
            )
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("rollouts per generate() (N)")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    left.set_ylabel("wall time per rollout (µs)")
    left.set_title("Time per rollout")
    right.set_ylabel("KiB per rollout (tracemalloc)")
    right.set_title("Peak memory per rollout")
    return _save(fig, out_dir, "scale")


def concurrency(payload: dict[str, Any], out_dir: Path) -> Path:
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for backend, color in COLORS.items():
        rows = [r for r in payload["rows"] if r["backend"] == backend and r["engine_capacity"] >= r["n"]]
        if not rows:
            continue
        labels = [str(r["max_concurrent_rollouts"] or "all") for r in rows]
        x = range(len(rows))
        left.plot(x, [r["wall_s"] for r in rows], "-o", color=color, label=f"{backend} wall")
        right.plot(x, [r["peak_live_envs"] for r in rows], "-o", color=color, label=backend)
        if backend == "asyncio":
            left.plot(x, [r["ideal_s"] for r in rows], "--", color="black", label="ideal schedule")
            left.axhline(rows[0]["slowest_rollout_s"], color="gray", linestyle=":", label="slowest rollout")
            left.set_xticks(list(x), labels)
            right.set_xticks(list(x), labels)
            total = rows[0]["sum_of_rollouts_s"]
            left.set_title(f"Wall time (sum over rollouts: {total:.0f} s)")
    lo, hi = payload["latency_s"]
    left.set_xlabel("max_concurrent_rollouts")
    left.set_ylabel(f"seconds (latency U({lo * 1e3:.0f}, {hi * 1e3:.0f}) ms per call)")
    right.set_xlabel("max_concurrent_rollouts")
    right.set_ylabel("peak live environments")
    right.set_title("Live environments")
    left.legend(fontsize=8)
    right.legend(fontsize=8)
    return _save(fig, out_dir, "concurrency")


def cancellation(payload: dict[str, Any], out_dir: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4))
    styles = {0: "-", 32: "--"}
    for row_key in sorted({(r["backend"], r["how"], r["max_env_workers"]) for r in payload["rows"]}):
        backend, how, workers = row_key
        rows = [r for r in payload["rows"] if (r["backend"], r["how"], r["max_env_workers"]) == row_key]
        marker = "s" if how == "task.cancel" else "o"
        ax.plot(
            [r["in_flight"] for r in rows],
            [r["latency_s"]["median"] * 1e3 for r in rows],
            styles.get(workers, "-") + marker,
            color=COLORS.get(backend, "gray"),
            label=f"{backend} {how}, {'inline env' if workers == 0 else f'{workers} env threads'}",
        )
    for backend in sorted({r["backend"] for r in payload.get("floor", [])}):
        rows = [r for r in payload["floor"] if r["backend"] == backend]
        ax.plot(
            [r["in_flight"] for r in rows],
            [r["latency_s"]["median"] * 1e3 for r in rows],
            ":x",
            color=COLORS.get(backend, "gray"),
            label=f"{backend} floor: bare tasks, no cleanup",
        )
    ax.axhline(50, color="gray", linestyle=":", label="goal 50 ms")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("rollouts in flight when cancelled")
    ax.set_ylabel("cancel → generate() raised, all envs closed (ms)")
    ax.set_title("Cancellation latency")
    ax.legend(fontsize=7)
    return _save(fig, out_dir, "cancellation")


def goodput(payload: dict[str, Any], out_dir: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4))
    for backend, color in COLORS.items():
        rows = [r for r in payload["rows"] if r["backend"] == backend]
        if not rows:
            continue
        x = [r["target_failed_fraction"] * 100 for r in rows]
        ax.plot(x, [r["wall_ratio"] for r in rows], "-o", color=color, label=f"{backend}: wall / fault-free wall")
        ax.plot(
            x,
            [r["wall_ratio_per_engine_call"] for r in rows],
            "--s",
            color=color,
            label=f"{backend}: same, per engine call served",
        )
        for xi, r in zip(x, rows, strict=True):
            ax.annotate(
                f"goodput {r['goodput']:.0%}",
                (xi, r["wall_ratio"]),
                fontsize=7,
                xytext=(3, -10),
                textcoords="offset points",
            )
    ax.axhline(1.05, color="gray", linestyle=":", label="goal ≤ 1.05")
    ax.axhline(1.0, color="black", linewidth=0.5)
    ax.set_xlabel("rollouts failing (%)")
    ax.set_ylabel("time ratio")
    ax.set_title("Faults with skip_failed_rollouts=True")
    ax.legend(fontsize=7)
    return _save(fig, out_dir, "goodput")


def profile(payload: dict[str, Any], out_dir: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4))
    labels, template, other = [], [], []
    for row in payload["split"]:
        for which in ("bare", "generator"):
            labels.append(f"{which}\n{row['backend']}")
            template.append(row[which]["template_and_tokenizer_us"])
            other.append(row[which]["everything_else_us"])
    x = range(len(labels))
    ax.bar(x, template, color="tab:green", label="chat template + tokenizer")
    ax.bar(x, other, bottom=template, color="tab:red", label="everything else")
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("µs per rollout")
    ax.set_title(f"Where a rollout's time goes (N={payload['split'][0]['n']}, unprofiled)")
    ax.legend(fontsize=8)
    return _save(fig, out_dir, "profile")


PLOTS = {
    "overhead": overhead,
    "scale": scale,
    "concurrency": concurrency,
    "cancellation": cancellation,
    "goodput": goodput,
    "profile": profile,
}
