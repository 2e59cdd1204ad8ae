"""Do the cleanup engine's shortcuts pay? Cancellation of N rollouts with each one on and off, in one run.

    python -m benchmarks.cleanup_shortcuts              # 1,024 in flight, 7 interleaved repeats
    python -m benchmarks.cleanup_shortcuts --n 256 --repeats 3

Issue 21 asks to keep a shortcut of ``skyrl_structured.envs`` only where a benchmark in the same
run shows it pays. Two are switched off here, one at a time and together, by patching them out:

- *late deadline*: ``_bounded_once_suspended`` arms a cleanup's deadline only once the cleanup
  suspends (off: the deadline is armed before every cleanup step);
- *inline close*: ``_OpenEnv.__aexit__`` closes an env that ``closes_at_once()`` outside any
  shielded scope (off: every close goes through ``run_cleanups``).

Each variant runs :mod:`benchmarks.cancellation`'s cancel-scope case (asyncio), with env calls inline
(``max_env_workers=0``, where both shortcuts apply) and in 32 threads. Reported: the process CPU time
and the wall time from the cancellation to ``generate()`` raising it, median of the repeats. Not part
of ``python -m benchmarks``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import anyio

from skyrl_structured import envs
from skyrl_structured.tiny import build_chatml_tokenizer

from . import cancellation
from .harness import Context
from .workload import ReplyPool


async def _armed_at_once(awaitable: Any, scope: anyio.CancelScope, limit_s: float) -> Any:
    scope.deadline = anyio.current_time() + limit_s
    return await awaitable


@contextlib.contextmanager
def _variant(name: str) -> Iterator[None]:
    saved = (envs._bounded_once_suspended, envs.SyncEnvAdapter.closes_at_once)
    if "late deadline" in name:
        envs._bounded_once_suspended = _armed_at_once  # type: ignore[assignment]
    if "inline close" in name:
        envs.SyncEnvAdapter.closes_at_once = lambda self: False  # type: ignore[method-assign]
    try:
        yield
    finally:
        envs._bounded_once_suspended, envs.SyncEnvAdapter.closes_at_once = saved  # type: ignore[method-assign]


VARIANTS = ("all shortcuts", "no late deadline", "no inline close", "no late deadline, no inline close")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.cleanup_shortcuts", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--n", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    tokenizer = build_chatml_tokenizer()
    ctx = Context(quick=False, out_dir=Path(tempfile.mkdtemp()), tokenizer=tokenizer, tokenizer_name="tiny")
    pool = ReplyPool.build(tokenizer)
    runs: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for _ in range(args.repeats):  # interleaved, so load drifts hit every variant alike
        for workers in (0, 32):
            for name in VARIANTS:
                with _variant(name):
                    wall_cpu = cancellation._once(
                        ctx, pool, n=args.n, backend="asyncio", how="cancel scope", max_env_workers=workers
                    )
                runs.setdefault((workers, name), []).append(wall_cpu)
    rows = []
    for (workers, name), values in runs.items():
        rows.append(
            {
                "max_env_workers": workers,
                "variant": name,
                "cpu_ms": 1e3 * statistics.median(cpu for _, cpu in values),
                "cpu_ms_range": [1e3 * min(c for _, c in values), 1e3 * max(c for _, c in values)],
                "wall_ms": 1e3 * statistics.median(wall for wall, _ in values),
            }
        )
    for row in rows:
        print(
            f"workers={row['max_env_workers']:>2}  {row['variant']:<36} cpu {row['cpu_ms']:7.1f} ms "
            f"(range {row['cpu_ms_range'][0]:.1f}-{row['cpu_ms_range'][1]:.1f})  wall {row['wall_ms']:7.1f} ms"
        )
    if args.json is not None:
        args.json.write_text(json.dumps({"n": args.n, "repeats": args.repeats, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
