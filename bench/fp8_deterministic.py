"""FP8 against bfloat16 all-gathers, deterministic against default all-reduces, FP8 sums.

Three tables on ``Cluster.virtual(n)`` (one GPU; ``Cluster.local(n)`` where n GPUs are visible
and ``--kind local``), at 4 and 8 ranks, from 8 KiB to 64 MiB (the bfloat16 message: the
largest per-rank buffer, as nccl-tests count it):

* all-gather of the same element count in ``float8_e4m3fn`` and in ``bfloat16``, both bound
  with ``strategy="auto"``: bytes each rank's output receives, time, FP8/bf16 time ratio.
  Every FP8 bind is checked once to move the bytes exactly (0 wrong bytes, else WRONG);
* all-reduce (sum, bfloat16) bound with ``strategy="auto"`` and with ``strategy="auto",
  deterministic=True``: what each bind runs (strategy, protocol), time and the ratio; each
  is checked once against the float64 reference within the benchmarks' bound, and the
  deterministic bind is run twice on the same inputs for the same bits;
* all-reduce (sum, ``float8_e4m3fn``) bound with ``strategy="auto"`` (the fused kernel's
  narrow build) and on the interpreter (the same strategy, ``protocol="ll"`` or "simple"):
  time and ratio, the two binds' outputs equal bit for bit (the sm datapath only).

    PYTHONPATH=. python3 bench/fp8_deterministic.py [--ranks 4,8]
        [--sizes 8KiB,64KiB,1MiB,16MiB,64MiB] [--out FILE.json] [--datapath sm|cpu]
        [--kind virtual|local] [--quick]

CUDA-graph replays, device time per op, median (``purlin.bench.providers``). Budget: about
2-3 minutes on one H200 (--quick: 8 KiB and 1 MiB). ``--datapath cpu`` runs the same binds
on the cpu datapath (float16 for bfloat16, wall time per call: not GPU numbers) -- what the
tests run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from purlin.bench.scripts import run_info

KiB, MiB = 1 << 10, 1 << 20
SIZES = (8 * KiB, 64 * KiB, 1 * MiB, 16 * MiB, 64 * MiB)
FP8 = "float8_e4m3fn"


def _cluster(datapath: str, kind: str, n: int):
    from purlin.runtime import Cluster

    if datapath == "cpu":
        return Cluster.cpu(n)
    return Cluster.local(n) if kind == "local" else Cluster.virtual(n)


def _counts(nbytes: int) -> tuple[int, int]:
    """(ops per graph, graph replays) of a size: fewer for large messages."""
    return (40, 10) if nbytes <= MiB else (10, 5) if nbytes <= 16 * MiB else (4, 3)


def _median(values) -> float:
    return float(sorted(values)[len(values) // 2])


def _what(bound) -> str:
    s = bound.schedule
    protocol = getattr(bound, "protocol", None)
    return f"{s.strategy}" + (f" {protocol}" if protocol else "") + \
        (f" c{s.chunks}" if getattr(s, "chunks", 1) not in (None, 1) else "")


# -- one bind, timed and checked -------------------------------------------------------------
def _gpu_fill(torch, bound, seed: int, fp8: bool):
    gen = torch.Generator(device=bound.inputs[0].device).manual_seed(seed)
    for x in bound.inputs:
        if fp8:  # every bit pattern
            x.view(torch.uint8).copy_(torch.randint(0, 256, x.shape, generator=gen,
                                                    device=x.device, dtype=torch.uint8))
        else:
            x.copy_(torch.randn(x.shape, generator=gen, device=x.device) + 0.5)


def _gpu_bytes_wrong(torch, bound) -> int:
    """An FP8 copy collective, run once on random bytes: output bytes unlike the reference's."""
    import numpy as np

    from purlin.spec import reference

    sizing = bound.schedule.sizing
    _gpu_fill(torch, bound, 1, fp8=True)
    xs = [bound.inputs[r][:sizing.input_count(r)].view(torch.uint8).cpu().numpy()
          for r in range(sizing.collective.nranks)]
    bound.launch()
    bound.check()
    want = reference(sizing, [x.astype(np.float64) for x in xs])
    return sum(int((bound.outputs[r][:sizing.output_count(r)].view(torch.uint8).cpu().numpy()
                    != want[r].astype(np.uint8)).sum()) for r in range(len(want)))


def _gpu_same_bits_twice(torch, bound) -> bool:
    _gpu_fill(torch, bound, 2, fp8=False)
    runs = []
    for _ in range(2):
        bound.launch()
        bound.check()
        runs.append([o.clone() for o in bound.outputs])
    return all(torch.equal(a.view(torch.int16), b.view(torch.int16))
               for a, b in zip(*runs))


def _time_gpu(torch, bound, nbytes: int) -> float:
    from purlin.bench.providers import time_graph

    ops, repeats = _counts(nbytes)
    us = _median(time_graph(torch, bound, ops, repeats))
    torch.cuda.synchronize()
    return us


def _time_cpu(bound, inputs, nbytes: int) -> float:
    ops, repeats = 3, 3
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(ops):
            bound(inputs)
        times.append((time.perf_counter() - t0) * 1e6 / ops)
    return _median(times)


def _cpu_inputs(bound, fp8: bool, seed: int):
    import numpy as np

    rng = np.random.default_rng(seed)
    s = bound.schedule
    if fp8:
        return [rng.integers(0, 256, s.sizing.input_count(r), dtype=np.uint8)
                for r in range(s.nranks)]
    return [(rng.standard_normal(s.sizing.input_count(r)) + 0.5).astype(bound.run.np_dtype)
            for r in range(s.nranks)]


# -- the two tables ---------------------------------------------------------------------------
def gather_row(cluster, n: int, nbytes: int, half: str, datapath: str, torch=None) -> dict:
    """FP8 and 16-bit all-gathers of ``nbytes / 2`` elements per rank's output."""
    import numpy as np

    from purlin.spec import collectives, reference

    coll = collectives.all_gather(n)
    count = max(n * 16, nbytes // 2 // (n * 16) * (n * 16))  # whole 16-byte FP8 pieces
    row = {"table": "all-gather", "nranks": n, "nbytes": nbytes, "count": count}
    for label, dtype in (("fp8", FP8), ("bf16", half)):
        entry = {"dtype": dtype}
        try:
            bound = cluster.bind(coll, "auto", count=count, dtype=dtype)
            sizing = bound.schedule.sizing
            entry["output_bytes"] = sizing.output_count(0) * sizing.dtype.itemsize
            entry["how"] = _what(bound)
            if datapath == "cpu":
                xs = _cpu_inputs(bound, dtype == FP8, 1)
                outs = bound(xs)
                want = reference(sizing, [x.astype(np.float64) for x in xs])
                entry["wrong"] = sum(int((np.asarray(o).astype(np.float64) != w).sum())
                                     for o, w in zip(outs, want))
                entry["us"] = _time_cpu(bound, xs, nbytes)
            else:
                entry["wrong"] = _gpu_bytes_wrong(torch, bound) if dtype == FP8 else 0
                entry["us"] = _time_gpu(torch, bound, nbytes)
        except Exception as exc:  # noqa: BLE001 - a refused or failed bind is a row, said so
            entry["refused"] = str(exc).splitlines()[0][:300]
        row[label] = entry
    row["ratio"] = _ratio(row["fp8"], row["bf16"])
    return row


def reduce_row(cluster, n: int, nbytes: int, half: str, datapath: str, torch=None) -> dict:
    """A 16-bit sum all-reduce of ``nbytes``, default against deterministic."""
    import numpy as np

    from purlin.bench.providers import count_wrong
    from purlin.spec import collectives, reference

    coll = collectives.all_reduce(n)
    row = {"table": "all-reduce", "nranks": n, "nbytes": nbytes, "dtype": half}
    for label, det in (("default", False), ("deterministic", True)):
        entry = {}
        try:
            bound = cluster.bind(coll, "auto", nbytes=nbytes, dtype=half, deterministic=det)
            entry["how"] = _what(bound)
            if datapath == "cpu":
                xs = _cpu_inputs(bound, False, 2)
                outs = bound(xs)
                want = reference(bound.schedule.sizing, [x.astype(np.float64) for x in xs])
                entry["wrong"] = sum(int((np.abs(np.asarray(o, np.float64) - w)
                                          > 4e-3 * (1 + np.abs(w))).sum())
                                     for o, w in zip(outs, want))
                again = bound(xs)
                entry["same_bits"] = all(np.array_equal(a, b) for a, b in zip(outs, again))
                entry["us"] = _time_cpu(bound, xs, nbytes)
            else:
                entry["wrong"] = count_wrong(torch, bound)
                entry["same_bits"] = _gpu_same_bits_twice(torch, bound)
                entry["us"] = _time_gpu(torch, bound, nbytes)
        except Exception as exc:  # noqa: BLE001 - a refused or failed bind is a row, said so
            entry["refused"] = str(exc).splitlines()[0][:300]
        row[label] = entry
    row["ratio"] = _ratio(row["deterministic"], row["default"])
    return row


def fp8_sum_row(cluster, n: int, nbytes: int, half: str, datapath: str, torch=None) -> dict:
    """An FP8 (e4m3fn) sum all-reduce of ``nbytes / 2`` elements (the bfloat16 message's
    count): ``auto`` (the fused kernel's narrow build) against the interpreter on the same
    strategy (LL up to ``LL_MAX_BYTES``, else simple), both on the same finite inputs, which
    must give the same bits (``wrong``: the bytes that differ)."""
    from purlin.atom.sm import LL_MAX_BYTES
    from purlin.spec import collectives

    coll = collectives.all_reduce(n)
    count = max(16, nbytes // 2 // 16 * 16)
    row = {"table": "fp8-sum", "nranks": n, "nbytes": nbytes, "count": count}
    outs, strategy = {}, "direct-push"
    for label in ("fused", "interpreter"):
        entry = {}
        try:
            if label == "fused":
                bound = cluster.bind(coll, "auto", count=count, dtype=FP8)
                strategy = bound.schedule.strategy
            else:
                bound = cluster.bind(coll, strategy, count=count, dtype=FP8,
                                     protocol="ll" if count <= LL_MAX_BYTES else "simple")
            entry["how"] = _what(bound)
            gen = torch.Generator(device=bound.inputs[0].device).manual_seed(3)
            for x in bound.inputs:  # finite values: equal bits mean equal sums
                values = torch.randn(x.numel(), generator=gen, device=x.device)
                x.view(torch.uint8).view(-1).copy_(values.to(torch.float8_e4m3fn)
                                                   .view(torch.uint8))
            bound.launch()
            bound.check()
            count_out = bound.schedule.sizing.output_count
            outs[label] = [o.view(torch.uint8)[:count_out(r)].clone()
                           for r, o in enumerate(bound.outputs)]
            entry["us"] = _time_gpu(torch, bound, nbytes)
        except Exception as exc:  # noqa: BLE001 - a refused or failed bind is a row, said so
            entry["refused"] = str(exc).splitlines()[0][:300]
        row[label] = entry
    if len(outs) == 2:
        row["fused"]["wrong"] = sum(int((a != b).sum()) for a, b in
                                    zip(outs["fused"], outs["interpreter"]))
    row["ratio"] = _ratio(row["fused"], row["interpreter"])
    return row


def _ratio(a, b):
    if "us" not in a or "us" not in b or a.get("wrong") or b.get("wrong"):
        return None
    return a["us"] / b["us"]


def _ok(row) -> bool:
    entries = [v for v in row.values() if isinstance(v, dict)]
    return all("refused" not in e and not e.get("wrong") and e.get("same_bits", True)
               for e in entries)


def run(ranks, sizes, datapath="sm", kind="virtual", log=sys.stdout) -> dict:
    torch = None
    if datapath == "sm":
        import torch
    half = "float16" if datapath == "cpu" else "bfloat16"  # numpy has no bfloat16
    rows, t0 = [], time.monotonic()
    tables = (gather_row, reduce_row) + ((fp8_sum_row,) if datapath == "sm" else ())
    for table in tables:
        for n in ranks:
            cluster = _cluster(datapath, kind, n)
            for nbytes in sizes:
                row = table(cluster, n, nbytes, half, datapath, torch)
                row["status"] = "ok" if _ok(row) else "WRONG"
                rows.append(row)
                _print_row(row, log)
                if torch is not None:
                    torch.cuda.empty_cache()
    out = {"rows": rows, "info": run_info(datapath, time.monotonic() - t0,
                                        kind="cpu" if datapath == "cpu" else kind,
                                        ranks=list(ranks), sizes=list(sizes))}
    if log is not None:
        bad = sum(r["status"] != "ok" for r in rows)
        print(f"\n{len(rows)} rows, {bad} not ok", file=log)
    return out


def _size(n: int) -> str:
    return f"{n // MiB}M" if n >= MiB else f"{n // KiB}K" if n >= KiB else str(n)


def _us(entry) -> str:
    if "refused" in entry:
        return "REFUSED"
    if entry.get("wrong"):
        return "WRONG"
    return f"{entry['us']:.2f}"


def _print_row(row, log) -> None:
    if log is None:
        return
    key = f"_header_{row['table']}"
    if not getattr(log, key, False):
        if row["table"] == "all-gather":
            print(f"\nall-gather, same elements: {'n':>2} {'size':>6} {'fp8 B':>10} "
                  f"{'bf16 B':>10} {'fp8 us':>9} {'bf16 us':>9} {'ratio':>6}  fp8 bind / "
                  "bf16 bind", file=log)
        elif row["table"] == "fp8-sum":
            print(f"\nall-reduce e4m3fn, sum:   {'n':>2} {'size':>6} {'fused':>9} "
                  f"{'interp.':>9} {'ratio':>6}  fused bind / interpreter bind (same bits)",
                  file=log)
        else:
            print(f"\nall-reduce {row['dtype']}: {'n':>2} {'size':>6} {'default':>9} "
                  f"{'determ.':>9} {'ratio':>6}  default bind / deterministic bind",
                  file=log)
        try:
            setattr(log, key, True)
        except AttributeError:
            pass
    ratio = "-" if row["ratio"] is None else f"{row['ratio']:.2f}"
    tail = "" if row["status"] == "ok" else "  " + row["status"]
    if row["table"] == "all-gather":
        f, b = row["fp8"], row["bf16"]
        print(f"{'':<26} {row['nranks']:>2} {_size(row['nbytes']):>6} "
              f"{f.get('output_bytes', '-'):>10} {b.get('output_bytes', '-'):>10} "
              f"{_us(f):>9} {_us(b):>9} {ratio:>6}  {f.get('how', f.get('refused'))} / "
              f"{b.get('how', b.get('refused'))}{tail}", file=log)
    elif row["table"] == "fp8-sum":
        f, i = row["fused"], row["interpreter"]
        print(f"{'':<26} {row['nranks']:>2} {_size(row['nbytes']):>6} {_us(f):>9} "
              f"{_us(i):>9} {ratio:>6}  {f.get('how', f.get('refused'))} / "
              f"{i.get('how', i.get('refused'))}{tail}", file=log)
    else:
        d, k = row["default"], row["deterministic"]
        print(f"{'':<20} {row['nranks']:>2} {_size(row['nbytes']):>6} {_us(d):>9} "
              f"{_us(k):>9} {ratio:>6}  {d.get('how', d.get('refused'))} / "
              f"{k.get('how', k.get('refused'))}{tail}", file=log)


def main(argv=None) -> int:
    from purlin.cli import size_list

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="4,8", help="rank counts (default 4,8)")
    ap.add_argument("--sizes", default=None, help="8KiB,64KiB,1MiB,16MiB,64MiB (default)")
    ap.add_argument("--quick", action="store_true", help="8 KiB and 1 MiB only")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    ap.add_argument("--datapath", default="sm", choices=("sm", "cpu"))
    ap.add_argument("--kind", default="virtual", choices=("virtual", "local"),
                    help="GPU clusters: virtual ranks on one GPU (default), or one GPU a rank")
    args = ap.parse_args(argv)
    ranks = [int(x) for x in args.ranks.split(",")]
    sizes = size_list(args.sizes) or ([8 * KiB, MiB] if args.quick else list(SIZES))
    out = run(ranks, sizes, args.datapath, args.kind)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1, default=str)
        print(f"wrote {args.out}")
    return 1 if any(r["status"] != "ok" for r in out["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
