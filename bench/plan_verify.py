"""How long planning and verification take, fresh (uncached), on one core.

    python3 bench/plan_verify.py [--out outputs/plan_verify.json]

Cases: an 8-rank all-to-all (64 chunk names; also cut into 64 pieces per transfer) and a 72-rank
all-reduce, for every strategy that applies. ``plan()`` verifies what it returns, so its time is
plan + verify; ``verify`` alone is timed again on the finished schedule. Goals: all-to-all
< 1 s, 72-rank all-reduce < 5 s. Prints the table and writes the records as JSON (no GPU
needed).
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # before numpy is imported

import argparse  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

from purlin.bench.scripts import output, write_json  # noqa: E402
from purlin.snac import plan, verify  # noqa: E402
from purlin.snac.planner import _plan  # noqa: E402
from purlin.spec import collectives  # noqa: E402

# (label, collective factory, nranks, strategies, count, chunks, goal in seconds)
CASES = [
    ("a2a-8 64 names", collectives.all_to_all, 8, ("direct-push", "direct-pull", "ring"),
     64 * 64, 1, 1.0),
    ("a2a-8 64 names x 64 pieces", collectives.all_to_all, 8,
     ("direct-push", "direct-pull", "ring"), 64 * 64, 64, 1.0),
    ("all-reduce-72", collectives.all_reduce, 72,
     ("direct-push", "direct-pull", "two-phase", "ring"), 72 * 16, 1, 5.0),
]


def pin_one_core() -> str:
    """Run on one core where the OS lets us choose; say which."""
    if hasattr(os, "sched_setaffinity"):
        core = min(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {core})
        return f"pinned to core {core}"
    return "not pinned (no sched_setaffinity)"


def time_case(coll, strategy, count, chunks, repeat):
    """Median seconds of a fresh plan() (cache cleared each time), and of verify() alone."""
    plan_times, schedule = [], None
    for _ in range(repeat):
        _plan.cache_clear()
        start = time.perf_counter()
        schedule = plan(coll, strategy, count=count, chunks=chunks)
        plan_times.append(time.perf_counter() - start)
    start = time.perf_counter()
    report = verify(schedule)
    verify_s = time.perf_counter() - start
    return schedule, report, plan_times, verify_s


def measure(repeat: int = 3, cases=CASES) -> list[dict]:
    """One record per (case, strategy)."""
    records = []
    for label, factory, n, strategies, count, chunks, goal in cases:
        coll = factory(n)
        for strategy in strategies:
            schedule, report, plan_times, verify_s = time_case(coll, strategy, count, chunks,
                                                               repeat)
            median = statistics.median(plan_times)
            records.append({
                "case": label, "collective": coll.name, "nranks": n, "strategy": strategy,
                "count": count, "dtype": schedule.dtype, "chunks": chunks, "lanes": 1,
                "steps": sum(len(s) for s in schedule.steps), "events": report.events,
                "calls_verified": report.calls, "scratch_copies": schedule.scratch_copies,
                "verified": report.ok, "plan_verify_s": median,
                "plan_verify_min_s": min(plan_times), "plan_verify_max_s": max(plan_times),
                "samples": len(plan_times), "verify_s": verify_s, "goal_s": goal,
                "meets_goal": median < goal,
            })
    return records


def table(records) -> str:
    head = (f"{'case':<28} {'strategy':<12} {'steps':>6} {'events':>7} {'copies':>6} "
            f"{'plan+verify s':>13} {'verify s':>9} {'goal s':>6}  ok")
    lines = [head, "-" * len(head)]
    for r in records:
        ok = "yes" if r["meets_goal"] and r["verified"] else "NO"
        lines.append(f"{r['case']:<28} {r['strategy']:<12} {r['steps']:>6} {r['events']:>7} "
                     f"{r['scratch_copies']:>6} {r['plan_verify_s']:>13.3f} "
                     f"{r['verify_s']:>9.3f} {r['goal_s']:>6.1f}  {ok}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="JSON file or folder (default outputs/)")
    parser.add_argument("--repeat", type=int, default=3, help="fresh plans per case (median)")
    args = parser.parse_args(argv)
    where = pin_one_core()
    records = measure(args.repeat)
    print(f"plan + verify, fresh, {where}; python {platform.python_version()}, "
          f"{platform.processor() or platform.machine()}")
    print(table(records))
    meta = {"python": platform.python_version(), "machine": platform.machine(),
            "cpu": where, "repeat": args.repeat}
    path = write_json(output(args.out, "plan_verify.json"), {"meta": meta, "records": records})
    print(f"wrote {path}")
    return 0 if all(r["meets_goal"] and r["verified"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
