"""Profile: where the generator's per-rollout time beyond the bare work goes.

Two views of the overhead case (instant engine, trivial env, inline env calls):

1. An unprofiled split: chat templating is wrapped with a timer (``ChatTokenizer.render`` in the
   generator run, ``tokenizer.apply_chat_template`` in the bare loop), so the per-rollout time
   divides into "chat template + tokenizer" and "everything else" with almost no distortion.
2. ``cProfile`` of one run of each: the top entries by cumulative and by own time, and own time
   grouped by package, per rollout. cProfile inflates Python-heavy code more than C code, so its
   absolute numbers are larger than the unprofiled ones; the ranking is what it is good for.
"""

from __future__ import annotations

import cProfile
import pstats
import time
from collections import Counter
from collections.abc import Callable
from functools import partial
from typing import Any

from skyrl_structured._episode.chat import ChatTokenizer

from .bare import BareWork
from .harness import Context, median, settle, write_json
from .overhead import TURNS, run_bare, run_generator
from .workload import InstantEngine, ReplyPool, make_batch, make_generator


def _sizes(ctx: Context) -> tuple[int, int, int]:
    """(N for the split, repeats, N for cProfile)."""
    if ctx.quick:
        return 32, 1, 32
    return 1024, 5, 2048


class _TemplateTimer:
    """Times chat templating: ``ChatTokenizer.render`` in the generator, ``apply_chat_template`` in the bare loop.

    The generator's templating is timed at its own entry point so that its memo and fast render
    path are measured as they run (patching ``apply_chat_template`` on the tokenizer would switch
    the fast path off); the bare loop calls ``apply_chat_template`` directly.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.total = 0.0
        self.calls = 0
        self._which = "bare"
        self._render = ChatTokenizer.render
        self._apply = tokenizer.apply_chat_template

    def _timed(self, function: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.total += time.perf_counter() - started
                self.calls += 1

        return timed

    def timing(self, which: str) -> _TemplateTimer:
        """Time the templating of ``which`` ("generator" or "bare") from now on."""
        self.__exit__()
        if which == "generator":
            ChatTokenizer.render = self._timed(self._render)  # type: ignore[method-assign]
        else:
            self.tokenizer.apply_chat_template = self._timed(self._apply)
        return self

    def __enter__(self) -> _TemplateTimer:
        return self

    def __exit__(self, *exc: object) -> None:
        ChatTokenizer.render = self._render  # type: ignore[method-assign]
        self.tokenizer.__dict__.pop("apply_chat_template", None)

    def reset(self) -> None:
        self.total = 0.0
        self.calls = 0


def _split(ctx: Context, pool: ReplyPool, backend: str, n: int, repeats: int) -> dict[str, Any]:
    engine = InstantEngine(pool)
    gen = make_generator(ctx.tokenizer, engine, turns=TURNS)
    work = BareWork(ctx.tokenizer, engine, turns=TURNS)
    runs: dict[str, list[tuple[float, float, int]]] = {"generator": [], "bare": []}
    with _TemplateTimer(ctx.tokenizer) as timer:
        for r in range(repeats):
            order = ("generator", "bare") if r % 2 == 0 else ("bare", "generator")
            for which in order:
                batch = make_batch(n)
                settle()
                timer.timing(which).reset()
                if which == "generator":
                    elapsed, out = run_generator(gen, batch, backend)
                else:
                    elapsed, out = run_bare(work, batch, backend)
                runs[which].append((elapsed, timer.total, timer.calls))
                del out, batch
    result: dict[str, Any] = {"backend": backend, "n": n}
    for which, values in runs.items():
        total = median([v[0] for v in values])
        template = median([v[1] for v in values])
        result[which] = {
            "per_rollout_us": total / n * 1e6,
            "template_and_tokenizer_us": template / n * 1e6,
            "template_calls_per_rollout": values[0][2] / n,
            "per_template_call_us": template / max(values[0][2], 1) * 1e6,
            "everything_else_us": (total - template) / n * 1e6,
        }
    return result


def _group(filename: str) -> str:
    if "site-packages/" in filename:
        return filename.split("site-packages/", 1)[1].split("/", 1)[0]
    for marker in ("skyrl_structured/", "benchmarks/"):
        if marker in filename:
            return marker + filename.split(marker, 1)[1]
    if filename.startswith("~") or filename.startswith("<"):
        return "builtins/C" if filename.startswith("~") else filename
    return "stdlib:" + filename.rsplit("/", 1)[-1]


def _entry(key: tuple[str, int, str], stat: tuple[Any, ...], n: int) -> dict[str, Any]:
    filename, line, name = key
    _, ncalls, tottime, cumtime, _ = stat
    where = _group(filename)
    return {
        "function": f"{where}:{line}({name})" if line else f"{where}({name})",
        "ncalls": ncalls,
        "tottime_us_per_rollout": tottime / n * 1e6,
        "cumtime_us_per_rollout": cumtime / n * 1e6,
    }


def _profile(fn: Callable[[], Any], n: int, top: int, text_path: Any) -> dict[str, Any]:
    profiler = cProfile.Profile()
    profiler.enable()
    fn()
    profiler.disable()
    stats = pstats.Stats(profiler)
    with open(text_path, "w") as f:
        pstats.Stats(profiler, stream=f).sort_stats("cumulative").print_stats(60)
        pstats.Stats(profiler, stream=f).sort_stats("tottime").print_stats(60)
    items = list(stats.stats.items())  # type: ignore[attr-defined]
    by_cum = sorted(items, key=lambda kv: kv[1][3], reverse=True)[:top]
    by_tot = sorted(items, key=lambda kv: kv[1][2], reverse=True)[:top]
    groups: Counter[str] = Counter()
    for (filename, _, _), stat in items:
        groups[_group(filename)] += stat[2]
    return {
        "total_us_per_rollout": stats.total_tt / n * 1e6,  # type: ignore[attr-defined]
        "top_cumulative": [_entry(k, v, n) for k, v in by_cum],
        "top_tottime": [_entry(k, v, n) for k, v in by_tot],
        "tottime_by_package_us_per_rollout": {k: v / n * 1e6 for k, v in groups.most_common(25)},
    }


def run(ctx: Context) -> dict[str, Any]:
    pool = ReplyPool.build(ctx.tokenizer)
    split_n, repeats, profile_n = _sizes(ctx)
    splits = []
    for backend in ctx.backends:
        row = _split(ctx, pool, backend, split_n, repeats)
        splits.append(row)
        g, b = row["generator"], row["bare"]
        ctx.log(
            f"profile split {backend:7s} N={split_n}: generator {g['per_rollout_us']:.0f} us/rollout "
            f"(template+tokenizer {g['template_and_tokenizer_us']:.0f}, else {g['everything_else_us']:.0f}); "
            f"bare {b['per_rollout_us']:.0f} (template+tokenizer {b['template_and_tokenizer_us']:.0f}, "
            f"else {b['everything_else_us']:.0f})"
        )
    profiles: dict[str, Any] = {}
    for backend in ctx.backends:
        engine = InstantEngine(pool)
        gen = make_generator(ctx.tokenizer, engine, turns=TURNS)
        work = BareWork(ctx.tokenizer, engine, turns=TURNS)
        run_generator(gen, make_batch(16), backend)  # warm caches (template compilation)
        contenders: tuple[tuple[str, Callable[[dict[str, Any]], Any]], ...] = (
            ("generator", partial(run_generator, gen, backend=backend)),
            ("bare", partial(run_bare, work, backend=backend)),
        )
        for which, fn in contenders:
            text = ctx.out_dir / f"profile_{which}_{backend}.txt"
            batch = make_batch(profile_n)
            settle()
            profiles[f"{which}/{backend}"] = _profile(partial(fn, batch), profile_n, 25, text)
            del batch
        ctx.log(f"profile cProfile {backend}: written profile_generator_{backend}.txt, profile_bare_{backend}.txt")
    payload = {"turns": TURNS, "split": splits, "cprofile_n": profile_n, "cprofile": profiles}
    write_json(ctx, "profile", payload)
    return payload
