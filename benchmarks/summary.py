"""Markdown tables of the results, for ``results/summary.md`` and the docs page."""

from __future__ import annotations

from typing import Any


def _table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _code(text: str) -> str:
    """A code span: profiler names like ``<built-in method ...>`` would otherwise read as HTML tags."""
    return "`" + text.replace("`", "'").replace("|", "\\|") + "`"


def _yes(flag: bool | None) -> str:
    return "—" if flag is None else ("yes" if flag else "**no**")


def overhead(p: dict[str, Any]) -> str:
    rows = [
        [
            r["backend"],
            "inline" if r["variant"] == "inline" else "32 threads",
            r.get("workload", "repeating"),
            r["n"],
            f"{r['bare_s']['median']:.3f}",
            f"{r['generator_s']['median']:.3f}",
            f"**{r['ratio']:.2f}**",
            f"{r['cpu_ratio']:.2f}",
            f"{r['per_rollout_extra_us']:.0f}",
            f"{r['skyrl_ratio']:.2f}" if "skyrl_ratio" in r else "—",
            f"{r['generator_over_skyrl']:.2f}" if "generator_over_skyrl" in r else "—",
            f"{r['generator_over_skyrl_cpu']:.2f}" if "generator_over_skyrl_cpu" in r else "—",
            f"{r['generator_s']['n']}",
            _yes(r["meets_goal"]) if r["variant"] == "inline" else "—",
        ]
        for r in p["rows"]
    ]
    header = [
        "backend",
        "env calls",
        "observations",
        "N",
        "bare s",
        "generator s",
        "ratio",
        "CPU-time ratio",
        "extra µs/rollout",
        "SkyRL ratio",
        "generator / SkyRL",
        "generator / SkyRL CPU",
        "repeats",
        "≤ 1.10",
    ]
    return _table(header, rows)


def scale(p: dict[str, Any]) -> str:
    rows = [
        [
            r["backend"],
            r["n"],
            f"{r['wall_s']['median']:.3f}",
            f"{r['per_rollout_us']:.0f}",
            f"{r['peak_traced_per_rollout_bytes'] / 1024:.1f}",
            f"{r['retained_output_bytes'] / r['n'] / 1024:.1f}",
            f"{r['bare_peak_traced_per_rollout_bytes'] / 1024:.1f}",
            f"{r['gc_pause_s'] * 1e3:.0f}",
            f"{r['gc_full_collections']:.0f}",
        ]
        for r in p["rows"]
    ]
    header = [
        "backend",
        "N",
        "wall s",
        "µs/rollout",
        "peak KiB/rollout",
        "output KiB/rollout",
        "bare peak KiB/rollout",
        "GC pauses ms",
        "full GCs",
    ]
    flat = [
        f"- {b}: per-rollout time spread {s['time_per_rollout_spread']:.0%}, peak memory spread "
        f"{s['memory_per_rollout_spread']:.0%} (max−min over min, across N); within 20%: {_yes(s['meets_goal'])}"
        for b, s in p["summary"].items()
    ]
    return _table(header, rows) + "\n\n" + "\n".join(flat)


def concurrency(p: dict[str, Any]) -> str:
    rows = [
        [
            r["backend"],
            r["max_concurrent_rollouts"] or "all",
            r["engine_capacity"],
            f"{r['wall_s']:.2f}",
            f"{r['ideal_s']:.2f}",
            f"{r['wall_over_ideal']:.3f}",
            f"{r['slowest_rollout_s']:.2f}",
            f"{r['sum_of_rollouts_s']:.0f}",
            r["peak_live_envs"],
        ]
        for r in p["rows"]
    ]
    header = [
        "backend",
        "max_concurrent_rollouts",
        "engine capacity",
        "wall s",
        "ideal s",
        "wall / ideal",
        "slowest rollout s",
        "sum of rollouts s",
        "peak live envs",
    ]
    return _table(header, rows)


def cancellation(p: dict[str, Any]) -> str:
    rows = [
        [
            r["backend"],
            r["how"],
            "inline" if r["max_env_workers"] == 0 else f"{r['max_env_workers']} threads",
            r["in_flight"],
            f"**{r['latency_s']['median'] * 1e3:.1f}**",
            f"{r['latency_s']['min'] * 1e3:.1f}–{r['latency_s']['max'] * 1e3:.1f}",
            _yes(r.get("meets_goal")),
        ]
        for r in p["rows"]
    ]
    # The goal: under 50 ms at 4,096 rollouts in flight with inline env calls, at 1,024 with env threads.
    header = ["backend", "cancelled by", "env calls", "in flight", "median ms", "range ms", "< 50 ms (goal size)"]
    floor = [[r["backend"], r["in_flight"], f"{r['latency_s']['median'] * 1e3:.1f}"] for r in p.get("floor", [])]
    text = _table(header, rows)
    if floor:
        text += "\n\nFloor: cancelling the same number of bare anyio tasks (asleep, nothing to clean up):\n\n" + _table(
            ["backend", "tasks", "median ms"], floor
        )
    return text


def goodput(p: dict[str, Any]) -> str:
    rows = [
        [
            r["backend"],
            f"{r['target_failed_fraction']:.0%}",
            f"{r['realized_failed_fraction']:.1%}",
            f"**{r['goodput']:.2%}**",
            _yes(r["placeholders_match_faults"]),
            f"{r['clean_s']['median']:.3f}",
            f"{r['faulty_s']['median']:.3f}",
            f"**{r['wall_ratio']:.3f}**",
            f"{r['cpu_ratio']:.3f}",
            f"{r['wall_ratio_per_engine_call']:.3f}",
        ]
        for r in p["rows"]
    ]
    header = [
        "backend",
        "target failed",
        "realized",
        "goodput",
        "placeholders = fatal faults",
        "fault-free s",
        "faulty s",
        "wall ratio",
        "CPU-time ratio",
        "wall ratio per engine call",
    ]
    return _table(header, rows)


def profile(p: dict[str, Any]) -> str:
    rows = []
    for r in p["split"]:
        for which in ("bare", "generator"):
            s = r[which]
            rows.append(
                [
                    r["backend"],
                    which,
                    f"{s['per_rollout_us']:.0f}",
                    f"{s['template_and_tokenizer_us']:.0f}",
                    f"{s['per_template_call_us']:.1f}",
                    f"{s['everything_else_us']:.0f}",
                ]
            )
    split = _table(
        ["backend", "run", "µs/rollout", "template+tokenizer µs", "µs per template call", "everything else µs"], rows
    )
    parts = [split]
    key = next((k for k in p["cprofile"] if k.startswith("generator/")), None)
    if key is not None:
        prof = p["cprofile"][key]
        top = [
            [
                _code(e["function"]),
                e["ncalls"],
                f"{e['tottime_us_per_rollout']:.1f}",
                f"{e['cumtime_us_per_rollout']:.1f}",
            ]
            for e in prof["top_tottime"][:15]
        ]
        total = prof["total_us_per_rollout"]
        cumulative = [
            [
                _code(e["function"]),
                e["ncalls"],
                f"{e['tottime_us_per_rollout']:.1f}",
                f"{e['cumtime_us_per_rollout']:.1f}",
            ]
            # Skip the event loop's own frames, which hold the whole run.
            for e in [e for e in prof["top_cumulative"] if e["cumtime_us_per_rollout"] < 0.95 * total][:15]
        ]
        backend = key.split("/")[1]
        where = f"cProfile of `generate()` ({backend}, N={p['cprofile_n']}, µs per rollout, inflated by the profiler)"
        parts.append(
            f"Top entries by cumulative time, {where}:\n\n"
            + _table(["function", "calls", "own µs", "cumulative µs"], cumulative)
        )
        parts.append(
            f"Top entries by own time, {where}:\n\n" + _table(["function", "calls", "own µs", "cumulative µs"], top)
        )
        bare = p["cprofile"].get("bare/" + key.split("/")[1])
        if bare is not None:
            groups = prof["tottime_by_package_us_per_rollout"]
            bare_groups = bare["tottime_by_package_us_per_rollout"]
            names = sorted(set(groups) | set(bare_groups), key=lambda k: -(groups.get(k, 0) - bare_groups.get(k, 0)))
            diff = [
                [
                    _code(n),
                    f"{groups.get(n, 0):.1f}",
                    f"{bare_groups.get(n, 0):.1f}",
                    f"{groups.get(n, 0) - bare_groups.get(n, 0):+.1f}",
                ]
                for n in names[:15]
            ]
            parts.append(
                "Own time by package, generator vs bare loop (cProfile, µs per rollout), largest differences first:\n\n"
                + _table(["package / module", "generator", "bare", "difference"], diff)
            )
    return "\n\n".join(parts)


SECTIONS = {
    "overhead": ("Overhead against the bare work", overhead),
    "scale": ("Scale", scale),
    "concurrency": ("Concurrency with latency", concurrency),
    "cancellation": ("Cancellation latency", cancellation),
    "goodput": ("Goodput under faults", goodput),
    "profile": ("Profile", profile),
}


def render(payloads: dict[str, dict[str, Any]], machine: dict[str, Any], image_prefix: str) -> str:
    load = machine.get("load_average")
    head = [
        f"Measured on {machine.get('cpu_count')} CPUs ({machine.get('cpu_model')}), Python {machine.get('python')}, "
        f"{machine.get('platform')}; load average at the end {tuple(round(x, 2) for x in load) if load else 'n/a'}; "
        f"commit {machine.get('commit')}; tokenizer: {machine.get('tokenizer')}; "
        f"{'quick (smoke) sizes' if machine.get('quick') else 'full sizes'}.",
    ]
    for name, (title, fn) in SECTIONS.items():
        if name not in payloads:
            continue
        head.append(f"### {title}\n\n![{title}]({image_prefix}{name}.png)\n\n{fn(payloads[name])}")
    return "\n\n".join(head) + "\n"
