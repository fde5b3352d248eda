"""Purlin against every peer at its best: the same two GPUs, one run, 8 B .. 1 GiB.

    python3 bench/peers.py [--out outputs/peers] [--quick] [--dry-run]   # 2 GPUs, ~9 minutes

Graph replay per op (slowest rank, median), bf16, in one run on the same two GPUs:

* the six collectives, 8 B .. 1 GiB: Purlin in one process driving both GPUs
  (``Cluster.local(2)``: ``strategy="auto"``, direct-push / two-phase / ring at every other
  size, copy engines from 64 MiB) and in process mode (``purlin.torch.Communicator``,
  protocol auto, zero-copy, one process per GPU), against NCCL's default path, NCCL on buffers
  registered as a symmetric window, PyTorch symmetric memory's one-shot and two-shot
  all-reduce and FlashInfer's (TensorRT-LLM) one-shot and two-shot all-reduce;
* the fused all-reduce + residual add + RMSNorm at hidden 4096 and 8192, rows 1 .. 64: Purlin's
  ``all_reduce_add_rms_norm`` against FlashInfer's fused kernel and NCCL + add +
  ``torch.rms_norm``;
* the TP=2 decoder step (bench/tp_decoder.py's layer, 32 layers per graph): NCCL + add +
  ``torch.rms_norm``, Purlin's epilogue, FlashInfer's fused kernel, and no all-reduce (bound);
* 10,000 replays of a captured ``comm.all_reduce`` at 8 KiB, 1 MiB and 16 MiB, new inputs
  before each, every result compared with NCCL's.

Prints one table per collective with every peer beside Purlin and best peer / Purlin per size,
the fused-norm and decoder tables, one line for everything that could not run (a missing
package, too few GPUs, an API this torch lacks), and writes ``<out>/peers.json`` and
``<out>/peers.html``. ``--dry-run`` prints the plan and what would be skipped here, touching
no GPU; ``--quick`` a short subset. FlashInfer compiles its kernels on first use (nvcc, in
the background while the first phases run): carry it with ``bash bench/wheels.sh --peers``.
NVLink multicast stays off (``purlin.bench.scripts.GPU_ENV``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
import warnings

from purlin.bench import peers
from purlin.bench.scripts import folder, gpu_env, write_json

gpu_env()  # before the ranks' processes start NCCL
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
os.environ.setdefault("FLASHINFER_CONFIDENTIAL_COMPUTE", "1")  # its multicast-free workspace

KiB, MiB = 1 << 10, 1 << 20
EPS = 1e-5
REPLAY_SIZES = (8 * KiB, 1 * MiB, 16 * MiB)
FUNCTION = {"all-reduce": "all_reduce:sum", "all-gather": "all_gather",
            "reduce-scatter": "reduce_scatter", "all-to-all": "all_to_all",
            "broadcast": "broadcast", "reduce": "reduce"}
BASELINE_PEERS = ("nccl", "nccl-window", "symm-one-shot", "symm-two-shot")
FI_BUILD = (
    "import sys, pathlib\n"
    "marker = pathlib.Path(sys.argv[1])\n"
    "try:\n"
    "    from flashinfer.comm.trtllm_ar import get_trtllm_comm_module\n"
    "    get_trtllm_comm_module()\n"
    "    marker.write_text('ok')\n"
    "except BaseException as exc:\n"
    "    marker.write_text(f'error: {type(exc).__name__}: {exc}'[:600])\n"
    "    raise\n")


# -- helpers shared by the workers ------------------------------------------------------------
def _agree(torch, dist, flag: bool) -> bool:
    """True on every rank when any rank says so (a time limit must cut every rank alike)."""
    t = torch.tensor([1 if flag else 0], device=torch.cuda.current_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _timed(torch, dist, fn, nbytes, ops=50, repeats=15):
    """Per-op microseconds of ``fn`` from CUDA-graph replays, per repeat, slowest rank."""
    from purlin.bench.metrics import Timing, op_counts
    from purlin.bench.torch_dist import graph_per_op_us

    ops, repeats = op_counts(nbytes, ops, repeats)
    per_op = graph_per_op_us(torch, fn, ops, repeats, dist)
    t = torch.tensor(per_op, device=torch.cuda.current_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return Timing.of(t.cpu().tolist())


def _wait_for(marker, seconds: float) -> str:
    """FlashInfer's background build: "ok", or why it cannot be used."""
    from pathlib import Path

    if not marker:
        return "not built"
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if Path(marker).exists():
            return Path(marker).read_text().strip() or "error: empty build marker"
        time.sleep(1.0)
    return f"error: FlashInfer's kernels were not built within {seconds:.0f} s"


def _flashinfer_ready(torch, dist, opts) -> str | None:
    """None once FlashInfer's kernels are built on every rank, else why not (the same
    answer on every rank, so that both skip or both run)."""
    state = _wait_for(opts["flashinfer_marker"], opts["flashinfer_wait"])
    if not _agree(torch, dist, state != "ok"):
        return None
    return state.removeprefix("error: ") if state != "ok" else "the other rank's build failed"


def _flashinfer_all_reduce(torch, dist, rank, world, tokens, hidden):
    """FlashInfer's workspace on every rank, or (None, why) on every rank."""
    try:
        fi, why = peers.FlashInferAllReduce(torch, dist, rank, world, tokens, hidden,
                                            torch.bfloat16), None
    except Exception as exc:  # noqa: BLE001
        fi, why = None, f"no workspace: {type(exc).__name__}: {str(exc)[:300]}"
    if _agree(torch, dist, fi is None):
        return None, why or "no workspace on the other rank"
    return fi, None


def _failed(provider, coll, nbytes, count, why):
    from purlin.bench.metrics import Record, Timing

    nan = float("nan")
    return Record.make(provider, coll, 2, nbytes, count, "bfloat16",
                       "sum" if coll in ("all-reduce", "reduce-scatter", "reduce") else "none",
                       "graph", Timing(nan, nan, nan, 0), -1, error=why).to_dict()


# -- process mode: Purlin's Communicator, FlashInfer, the norm, the replays ---------------------
def process_worker(rank, world, opts):
    import torch
    import torch.distributed as dist

    from purlin.torch import Communicator

    warnings.simplefilter("ignore", FutureWarning)
    device = torch.device("cuda", torch.cuda.current_device())
    out = {"records": [], "norm": [], "replays": [], "skipped": []}
    comm = Communicator(staging_bytes=opts["staging"], timeout=10.0, protocol="auto",
                        zero_copy=True)
    t0 = time.monotonic()
    for coll, nbytes in opts["process_points"]:
        if _agree(torch, dist, time.monotonic() - t0 > opts["budget"]):
            out["skipped"].append(f"purlin-process {coll} {peers.size_text(nbytes)}: the "
                                  f"{opts['budget']:.0f} s budget of process mode ran out")
            continue
        out["records"].append(_process_point(torch, dist, comm, coll, nbytes, rank, world,
                                             device))
    _save(rank, opts, out)
    if opts["replays"]:
        out["replays"] = _replays(torch, dist, comm, rank, device, opts["replays"])
    if opts["norm_shapes"]:
        out["norm"] = [_norm_purlin(torch, dist, comm, rank, rows, hidden, device)
                       for rows, hidden in opts["norm_shapes"]]
    comm.check()
    _save(rank, opts, out)
    fi_points = opts["flashinfer_points"]
    if opts["flashinfer"] and (fi_points or opts["norm_shapes"]):
        why = _flashinfer_ready(torch, dist, opts)
        if why:
            out["skipped"].append(f"flashinfer: {why}")
        else:
            _flashinfer(torch, dist, comm, rank, world, device, opts, out)
    _save(rank, opts, out)
    return out


def _save(rank, opts, out) -> None:
    """Rank 0's results so far, for the parent should the processes not come back."""
    if rank == 0 and opts.get("partial"):
        with open(opts["partial"], "w") as f:
            json.dump(out, f, default=str)


def _process_point(torch, dist, comm, coll, nbytes, rank, world, device):
    """Check one collective of the Communicator against NCCL, then time it (graph replay)."""
    from process_mode import check_function  # bench/process_mode.py

    from purlin.bench.metrics import Record

    dtype = torch.bfloat16
    count = max(world, nbytes // 2 // world * world)
    part = count // world
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        try:
            wrong = check_function(torch, dist, comm, FUNCTION[coll], count * 2, dtype, rank,
                                   world, device, 1)
            t = torch.tensor([max(wrong, 0)], device=device)
            dist.all_reduce(t)
            wrong = int(t.item()) if wrong >= 0 else -1
            x = torch.randint(-8, 9, (count,), device=device).to(dtype)
            small = torch.empty(part, dtype=dtype, device=device)
            y = torch.empty_like(x)
            fn = {"all-reduce": lambda: comm.all_reduce(x),
                  "all-gather": lambda: comm.all_gather_into_tensor(x, small),
                  "reduce-scatter": lambda: comm.reduce_scatter_tensor(small, x),
                  "all-to-all": lambda: comm.all_to_all_single(y, x),
                  "broadcast": lambda: comm.broadcast(x, src=0),
                  "reduce": lambda: comm.reduce(x, dst=0)}[coll]
            fn()  # the eager first call prepares this size
            torch.cuda.synchronize()
            comm.check()
            ran = next((p for p in comm.plans() if p.get("function") == coll
                        and p.get("dtype") == "bfloat16" and p.get("count") in (count, part)
                        and not p.get("root")),
                       None)
            if ran is None or "unprepared" in ran:  # torch.distributed ran it, not Purlin
                why = ran["unprepared"] if ran else "no Purlin plan for this size"
                return _failed("purlin-process", coll, nbytes, count, f"fell back: {why}")
            timing = _timed(torch, dist, fn, nbytes)
            comm.check()
        except Exception as exc:  # noqa: BLE001 - one line in the notes
            return _failed("purlin-process", coll, nbytes, count,
                           f"{type(exc).__name__}: {str(exc)[:300]}")
    fell = sorted({str(w.message) for w in caught if "falls back" in str(w.message)})
    if fell:
        return _failed("purlin-process", coll, nbytes, count, f"fell back: {fell[0][:300]}")
    extra = {k: ran.get(k) for k in ("strategy", "chunks", "lanes", "protocol", "pdl",
                                     "blocks_per_lane") if k in ran}
    redop = "sum" if coll in ("all-reduce", "reduce-scatter", "reduce") else "none"
    return Record.make("purlin-process", coll, world, nbytes, count, "bfloat16", redop, "graph",
                       timing, wrong, **extra).to_dict()


def _replays(torch, dist, comm, rank, device, replays):
    """A captured comm.all_reduce replayed ``replays`` times, a new input before each, every
    result compared with NCCL's (integers: every sum is exact in bf16)."""
    rows = []
    for nbytes in REPLAY_SIZES:
        count = nbytes // 2
        try:
            idx = torch.arange(count, device=device, dtype=torch.int32)
            tmp = torch.empty_like(idx)
            static = torch.zeros(count, dtype=torch.bfloat16, device=device)
            ref = torch.empty_like(static)
            comm.all_reduce(static)  # the eager first call prepares this size
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                comm.all_reduce(static)
            wrong = torch.zeros((), dtype=torch.int64, device=device)
            t0 = time.perf_counter()
            for i in range(replays):
                torch.add(idx, i * 7 + rank * 3, out=tmp)
                tmp.remainder_(17)
                static.copy_(tmp)
                static.sub_(8)
                ref.copy_(static)
                dist.all_reduce(ref)
                graph.replay()
                wrong += (static != ref).sum()
            torch.cuda.synchronize()
            comm.check()
            dist.all_reduce(wrong)
            rows.append({"nbytes": nbytes, "replays": replays, "wrong": int(wrong.item()),
                         "seconds": round(time.perf_counter() - t0, 2)})
        except Exception as exc:  # noqa: BLE001
            rows.append({"nbytes": nbytes, "replays": replays,
                         "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
    return rows


def _norm_inputs(torch, rank, rows, hidden, device, salt=0):
    gen = torch.Generator(device=device).manual_seed(rows * 7 + hidden)
    weight = (torch.rand(hidden, generator=gen, device=device) + 0.5).to(torch.bfloat16)
    residual = torch.randn(rows, hidden, generator=gen, device=device).to(torch.bfloat16)
    g = torch.Generator(device=device).manual_seed(salt * 100 + rank)
    x = torch.randn(rows, hidden, generator=g, device=device).to(torch.bfloat16)
    return weight, residual, x


def _norm_reference(torch, dist, x, residual, weight):
    from purlin.torch.comm import add_rms_norm

    ref, ref_r = x.clone(), residual.clone()
    dist.all_reduce(ref)
    add_rms_norm(ref, ref_r, weight, EPS)
    return ref, ref_r


def _norm_wrong(torch, dist, got, got_r, ref, ref_r):
    """Elements beyond a bf16 rounding in the norm and the residual, summed over the ranks."""
    tol = 1.6e-2
    far = ((got.float() - ref.float()).abs() > tol * (1 + ref.float().abs())).sum()
    far_r = ((got_r.float() - ref_r.float()).abs() > tol * (1 + ref_r.float().abs())).sum()
    t = torch.stack([far, far_r]).to(torch.int64)
    dist.all_reduce(t)
    return int(t[0].item()), int(t[1].item())


def _norm_purlin(torch, dist, comm, rank, rows, hidden, device):
    """all_reduce_add_rms_norm, checked, then timed beside its unfused equivalents."""
    row = {"rows": rows, "hidden": hidden, "nbytes": rows * hidden * 2}
    try:
        weight, residual, x = _norm_inputs(torch, rank, rows, hidden, device)
        ref, ref_r = _norm_reference(torch, dist, x, residual, weight)
        t, r = x.clone(), residual.clone()
        comm.all_reduce_add_rms_norm(t, r, weight, EPS)
        row["purlin-epilogue_wrong"] = _norm_wrong(torch, dist, t, r, ref, ref_r)
        ran = next((p for p in comm.plans() if p.get("function") == "all-reduce-add-rms-norm"
                    and p.get("count") == rows * hidden), {})
        row["kernel"] = ran.get("norm_kernel")
        r.zero_()

        def plain(ar):
            def fn():
                ar(t)
                r.add_(t)
                return torch.rms_norm(r, (hidden,), weight, EPS)
            return fn

        for name, fn in (("purlin-epilogue", lambda: comm.all_reduce_add_rms_norm(
                t, r, weight, EPS)), ("purlin+torch", plain(comm.all_reduce)),
                ("nccl+torch", plain(lambda z: dist.all_reduce(z)))):
            row[f"{name}_us"] = _timed(torch, dist, fn, row["nbytes"], 20, 10).median_us
        comm.check()
    except Exception as exc:  # noqa: BLE001
        row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    return row


def _flashinfer(torch, dist, comm, rank, world, device, opts, out):
    """FlashInfer's fused all-reduce + residual + RMSNorm at the norm shapes (beside
    Purlin's rows above), then its all-reduce at every planned size."""
    from purlin.bench.metrics import Record

    shapes = opts["norm_shapes"]
    if shapes:
        fi, why = _flashinfer_all_reduce(torch, dist, rank, world, max(r for r, _ in shapes),
                                         max(h for _, h in shapes))
        if fi is None:
            out["skipped"].append(f"flashinfer-fused: {why}")
        for row in out["norm"]:
            if fi is None or "error" in row:
                continue
            rows, hidden = row["rows"], row["hidden"]
            try:
                weight, residual, x = _norm_inputs(torch, rank, rows, hidden, device)
                ref, ref_r = _norm_reference(torch, dist, x, residual, weight)
                variants = [("oneshot", True)] + ([("twoshot", False)] if rows > world else [])
                for tag, oneshot in variants:
                    t, r = x.clone(), residual.clone()
                    fi.add_rms_norm(t, r, weight, EPS, oneshot)
                    row[f"flashinfer-{tag}_wrong"] = _norm_wrong(torch, dist, t, r, ref, ref_r)
                    row[f"flashinfer-{tag}_us"] = _timed(
                        torch, dist, lambda: fi.add_rms_norm(t, r, weight, EPS, oneshot),
                        row["nbytes"], 20, 10).median_us
            except Exception as exc:  # noqa: BLE001
                row["flashinfer_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    points = opts["flashinfer_points"]
    if not points:
        return
    biggest = max(n for _, n in points) // 2
    fi, why = _flashinfer_all_reduce(torch, dist, rank, world,
                                     max(1, biggest // peers.FLASHINFER_MAX_HIDDEN),
                                     min(biggest, peers.FLASHINFER_MAX_HIDDEN))
    if fi is None:
        out["skipped"].append(f"flashinfer all-reduce: {why}")
        return
    for provider, nbytes in points:
        tokens, hidden = peers.flashinfer_shape(nbytes)
        count = tokens * hidden
        oneshot = provider.endswith("oneshot")
        try:
            idx = torch.arange(count, device=device, dtype=torch.int32)
            inp = ((idx + 3 * rank) % 17 - 8).to(torch.bfloat16).view(tokens, hidden)
            res = torch.empty_like(inp)
            ref = inp.clone()
            dist.all_reduce(ref)
            fi.all_reduce(inp, res, oneshot)
            bad = (res != ref).sum().to(torch.int64)
            dist.all_reduce(bad)
            timing = _timed(torch, dist, lambda: fi.all_reduce(inp, res, oneshot), nbytes)
            out["records"].append(Record.make(provider, "all-reduce", world, nbytes, count,
                                              "bfloat16", "sum", "graph", timing,
                                              int(bad.item()), tokens=tokens,
                                              hidden=hidden).to_dict())
        except Exception as exc:  # noqa: BLE001
            out["records"].append(_failed(provider, "all-reduce", nbytes, count,
                                          f"{type(exc).__name__}: {str(exc)[:300]}"))


# -- the TP=2 decoder step ---------------------------------------------------------------------
def tp_worker(rank, world, opts):
    import torch
    import torch.distributed as dist

    import tp_decoder as tpd  # bench/tp_decoder.py: the layer, its mixes, its checks
    from purlin.bench.torch_dist import graph_median_us
    from purlin.torch import Communicator

    warnings.simplefilter("ignore", FutureWarning)
    device = torch.device("cuda", torch.cuda.current_device())
    comm = Communicator(staging_bytes=512 << 20, timeout=10.0, protocol="auto", zero_copy=True)
    fi, why = None, None
    if opts["flashinfer"]:
        why = _flashinfer_ready(torch, dist, opts)
        if why is None:
            fi, why = _flashinfer_all_reduce(torch, dist, rank, world,
                                             max(b for _, b in opts["configs"]),
                                             max(h for h, _ in opts["configs"]))
    rows = []
    for hidden in sorted({h for h, _ in opts["configs"]}):
        layer = tpd.Layer(torch, hidden, world, rank, device)
        mix_of = tpd.mixes(torch, layer)
        make_fn, first = mix_of["fn"]
        make_epi, _ = mix_of["epi"]

        def staging(tokens, hidden=hidden):  # all_reduce_add_rms_norm's own input region
            return comm.input_buffer("all_reduce_add_rms_norm", tokens * hidden,
                                     torch.bfloat16, hidden=hidden).view(tokens, hidden)

        def fi_mix(o, x, w):
            fi.add_rms_norm(o, x, w, tpd.EPS)
            return x, o.view(x.shape)

        providers = {"nccl": (make_fn(lambda t: dist.all_reduce(t)), None),
                     "purlin-epi": (make_epi(comm), staging),
                     "none-fn": (make_fn(lambda t: None), None)}
        if fi is not None:
            providers["flashinfer"] = (fi_mix, None)
        for _, batch in [c for c in opts["configs"] if c[0] == hidden]:
            row = {"hidden": hidden, "batch": batch, "layers": opts["layers"],
                   "allreduce_bytes": batch * hidden * 2}
            try:
                gen = torch.Generator(device=device).manual_seed(42 + batch)
                state = tpd.make_state(torch, layer, batch, 1, opts["kv"], device, True, gen)
                x0 = torch.randn(batch, 1, hidden, generator=gen, device=device).to(
                    torch.bfloat16)
                res = torch.empty_like(x0)
                outs = {}
                for name, (mix, stage) in providers.items():
                    result = torch.empty_like(x0)

                    def step(mix=mix, stage=stage, result=result, layers=opts["layers"]):
                        res.copy_(x0)
                        x, h = res, first(res, layer.norm1)
                        for _ in range(layers):
                            x, h = layer.forward(x, h, state, mix, stage)
                        result.copy_(h)

                    step(layers=1)
                    outs[name] = result.float()
                    row[f"{name}_us"] = graph_median_us(torch, step, 1, opts["replays"], dist)
                comm.check()
                tpd._agreement(torch, row, outs)
                for name in ("purlin-epi", "flashinfer", "none-fn"):
                    if f"{name}_us" in row:
                        row[f"{name}_vs_nccl"] = row["nccl_us"] / row[f"{name}_us"]
                if "flashinfer_us" in row:
                    row["purlin-epi_vs_flashinfer"] = row["flashinfer_us"] / row["purlin-epi_us"]
            except Exception:  # noqa: BLE001 - keep the other configurations
                row["error"] = traceback.format_exc(limit=4)
            rows.append(row)
            torch.cuda.empty_cache()
        layer = None
    return {"rows": rows, "skipped": [f"flashinfer in the TP=2 decoder: {why}"] if why else []}


# -- the parent: phases, tables, JSON ----------------------------------------------------------
def start_flashinfer_build(out_dir):
    """Build FlashInfer's communication kernels in the background (nvcc, CPU cores only):
    returns (process, marker path); the marker says "ok" or why not once it is done."""
    import torch

    if "FLASHINFER_CUDA_ARCH_LIST" not in os.environ:
        major, minor = torch.cuda.get_device_capability(0)
        os.environ["FLASHINFER_CUDA_ARCH_LIST"] = f"{major}.{minor}{'a' if major == 9 else ''}"
    os.environ.setdefault("FLASHINFER_NVCC_THREADS", "4")
    marker = os.path.join(out_dir, "flashinfer-build.marker")
    if os.path.exists(marker):
        os.remove(marker)
    log = open(os.path.join(out_dir, "flashinfer-build.log"), "w")
    proc = subprocess.Popen([sys.executable, "-c", FI_BUILD, marker], stdout=log,
                            stderr=subprocess.STDOUT)
    return proc, marker


def run_single_process(plan, args, deadline):
    """Purlin on ``Cluster.local(2)``: each provider at its planned collectives and sizes."""
    from purlin.bench.sweep import Results, Sweep
    from purlin.runtime.cluster import Cluster

    cluster = Cluster.local(args.ranks)
    res = Results([], {})
    groups: dict = {}
    for p in plan.points:
        if peers.BY_NAME[p.peer].mode == "single":
            g = groups.setdefault(p.peer, ([], []))
            if p.collective not in g[0]:
                g[0].append(p.collective)
            if p.nbytes not in g[1]:
                g[1].append(p.nbytes)
    # auto first, then copy engines (the best at 64 MiB and up), then the strategies
    order = sorted(groups, key=lambda n: (n != "purlin:auto", n != "ce:auto"))
    for provider in order:
        colls, sizes = groups[provider]
        left = deadline - time.monotonic()
        if left < 5:
            res.skipped.append(f"{provider}: the single-process budget ran out")
            continue
        res = res + Sweep(collectives=colls, sizes=sorted(sizes), providers=[provider],
                          nranks=args.ranks, ops=50, repeats=15, time_limit=left,
                          cluster=cluster).run(progress=False)
        print(f"# {provider}: done at {time.monotonic() - T0:.0f} s", flush=True)
    import torch

    torch.cuda.empty_cache()  # the processes of the next phases need the memory
    return res


T0 = time.monotonic()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="outputs/peers", help="folder (default outputs/peers)")
    ap.add_argument("--quick", action="store_true", help="4 sizes, 2 norm shapes, 2 decoder "
                    "configurations, 1000 replays: a smoke test of the whole run")
    ap.add_argument("--dry-run", action="store_true",
                    help="print the plan and what would be skipped here; touch no GPU")
    ap.add_argument("--sizes", default=None, help="8:1GiB or a list 8,64KiB,1MiB")
    ap.add_argument("--collectives", default="all")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--no-strategies", action="store_true",
                    help="only purlin:auto (and ce:auto) in one process")
    ap.add_argument("--no-norm", action="store_true")
    ap.add_argument("--no-tp", action="store_true")
    ap.add_argument("--replays", type=int, default=None, help="default 10000 (quick 1000)")
    ap.add_argument("--single-budget", type=float, default=None,
                    help="seconds for the single-process Purlin points (default 180, quick 60)")
    ap.add_argument("--process-budget", type=float, default=None,
                    help="seconds for process mode's six collectives (default 90, quick 40)")
    ap.add_argument("--staging", type=int, default=6 << 30,
                    help="process mode's symmetric staging bytes per GPU (default 6 GiB)")
    args = ap.parse_args(argv)

    from purlin.cli import size_list

    sizes = size_list(args.sizes) or list(peers.QUICK_SIZES if args.quick else peers.SIZES)
    colls = list(peers.SIX) if args.collectives == "all" else args.collectives.split(",")
    replays = args.replays if args.replays is not None else (1000 if args.quick else 10000)
    env = peers.probe()
    plan = peers.plan(colls, sizes, env, quick=args.quick, nranks=args.ranks,
                      strategies=not args.no_strategies, norm=not args.no_norm,
                      tp=not args.no_tp, replays=replays)
    if args.dry_run:  # the whole plan, as on 2 GPUs with every peer, then what is missing here
        full = peers.plan(colls, sizes, peers.Environment.complete(args.ranks),
                          quick=args.quick, nranks=args.ranks,
                          strategies=not args.no_strategies, norm=not args.no_norm,
                          tp=not args.no_tp, replays=replays)
        print(full.text(f"the plan on {args.ranks} GPUs with every peer present"))
        print(f"# here ({env.gpus} GPU{'s' if env.gpus != 1 else ''} visible): "
              + (f"{len(plan.skipped)} things would be skipped" if plan.skipped
                 else "nothing would be skipped"))
        print("\n".join(f"# skipped here: {s}" for s in plan.skipped))
        return 0
    print(plan.text(), flush=True)
    out_dir = str(folder(args.out))
    path = os.path.join(out_dir, "peers.json")
    if env.missing("gpus", args.ranks):
        write_json(path, {"plan": plan.text(), "skipped": plan.skipped, "records": []})
        print(f"# nothing measured: {env.missing('gpus', args.ranks)}; wrote {path}")
        return 2
    build = marker = None
    fi_wanted = env.flashinfer is None and env.nvcc is None
    if fi_wanted:
        build, marker = start_flashinfer_build(out_dir)
        print(f"# FlashInfer's kernels build in the background (~"
              f"{peers.COST['flashinfer_build'] / 60:.0f} CPU-minutes for the slowest source; "
              f"{marker})", flush=True)
    records, skipped, extra = [], list(plan.skipped), {}

    # 1. the torch.distributed baselines, one pair of processes
    from purlin.bench.metrics import Record
    from purlin.bench.torch_dist import run_baselines

    base = [(p.peer, p.collective, p.nbytes, "bfloat16",
             "sum" if p.collective in ("all-reduce", "reduce-scatter", "reduce") else "none",
             "graph") for p in plan.of(*BASELINE_PEERS)]
    if base:
        try:
            records += run_baselines(base, world=args.ranks, ops=50, repeats=15)
        except Exception as exc:  # noqa: BLE001 - the rest still runs
            skipped.append(f"{', '.join(BASELINE_PEERS)}: the baseline processes failed: "
                           f"{str(exc).strip().splitlines()[-1][:300]}")
        print(f"# baselines: done at {time.monotonic() - T0:.0f} s", flush=True)
        _checkpoint(out_dir, records, skipped, "baselines")

    # 2. Purlin in one process driving both GPUs
    budget = args.single_budget or peers.SINGLE_BUDGET[args.quick]
    single = run_single_process(plan, args, time.monotonic() + budget)
    records += single.records
    skipped += single.skipped
    _checkpoint(out_dir, records, skipped, "purlin single-process")

    # 3. process mode: the Communicator, the replays, the norm, FlashInfer
    from purlin.torch.testing import run_processes

    opts = {"process_points": [(p.collective, p.nbytes) for p in plan.of("purlin-process")],
            "staging": args.staging, "replays": plan.replays,
            "budget": args.process_budget or (40 if args.quick else 90),
            "norm_shapes": list(plan.norm_shapes), "flashinfer": fi_wanted,
            "flashinfer_points": [(p.peer, p.nbytes) for p in plan.of(
                "flashinfer-oneshot", "flashinfer-twoshot")],
            "flashinfer_marker": marker, "flashinfer_wait": 240.0,
            "partial": os.path.join(out_dir, "process-partial.json")}
    outcomes = run_processes(process_worker, args.ranks, opts, backend="nccl", timeout=480,
                             pg_timeout=120)
    extra["process"] = _collect(outcomes, "process mode", skipped, opts["partial"])
    if extra["process"]:
        records += [Record.from_dict(d) for d in extra["process"].pop("records")]
        skipped += extra["process"].pop("skipped")
    print(f"# process mode: done at {time.monotonic() - T0:.0f} s", flush=True)
    _checkpoint(out_dir, records, skipped, "process mode")

    # 4. the TP=2 decoder step
    if plan.tp_configs:
        tp_opts = {"configs": list(plan.tp_configs), "layers": 8 if args.quick else 32,
                   "kv": 1024, "replays": 10, "flashinfer": fi_wanted,
                   "flashinfer_marker": marker, "flashinfer_wait": 120.0}
        got = _collect(run_processes(tp_worker, 2, tp_opts, backend="nccl", timeout=300,
                                     pg_timeout=120), "TP decoder", skipped)
        if got:
            extra["tp"] = got["rows"]
            skipped += got["skipped"]
        print(f"# TP decoder: done at {time.monotonic() - T0:.0f} s", flush=True)
    if build is not None:
        if build.poll() is None:
            build.kill()
        extra["flashinfer_build"] = open(marker).read().strip() if os.path.exists(marker) \
            else "not finished"
    return report(records, skipped, extra, plan, out_dir)


def _checkpoint(out_dir, records, skipped, done: str) -> None:
    """peers.json with the records so far: a run cut short keeps what it measured."""
    from purlin.bench.sweep import Results

    obj = Results(list(records), {"script": "bench/peers.py", "done": done},
                  list(skipped)).to_json()
    write_json(os.path.join(out_dir, "peers.json"), obj)


def _collect(outcomes, what, skipped, partial=None):
    """Rank 0's result of a pair of processes; where it did not come back, one line saying
    why and what rank 0 saved before (``partial``), else None."""
    status, value = outcomes[0]
    if status == "ok":
        return value
    text = str(value).strip().splitlines() or [status]
    kept = None
    if partial and os.path.exists(partial):
        with open(partial) as f:
            kept = json.load(f)
    skipped.append(f"{what}: rank 0 {status}: {text[-1][:300]}"
                   + ("; kept the sections it finished before" if kept else ""))
    return kept


def report(records, skipped, extra, plan, out_dir) -> int:
    from purlin.bench.sweep import Results, environment

    ran, failed = peers.failures_as_skips(records)
    skipped = skipped + failed
    info = environment("sm", 2)
    info.update(script="bench/peers.py", seconds=round(time.monotonic() - T0, 1))
    res = Results(ran, info, skipped)
    print()
    print(peers.tables(ran))
    norm = (extra.get("process") or {}).get("norm") or []
    if norm:
        print("\n" + norm_table(norm))
    if extra.get("tp"):
        print("\n" + tp_table(extra["tp"]))
    replays = (extra.get("process") or {}).get("replays") or []
    for r in replays:
        print(f"# replays {peers.size_text(r['nbytes'])}: "
              + (f"{r['wrong']} wrong in {r['replays']}" if "error" not in r
                 else f"failed: {r['error']}"))
    for s in skipped:
        print(f"# skipped: {s}")
    obj = res.to_json()
    obj.update(plan=plan.text(), ratios=peers.ratios(ran), norm=norm, replays=replays,
               tp_decoder=extra.get("tp", []), flashinfer_build=extra.get("flashinfer_build"))
    path = os.path.join(out_dir, "peers.json")
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, default=str)
    try:
        figure = peers.write_figure(ran, os.path.join(out_dir, "peers.html"))
    except Exception as exc:  # noqa: BLE001 - no plotly on the GPU machine: draw it elsewhere
        figure = f"no figure ({exc})"
    bad = [r for r in ran if r.wrong > 0] + [r for r in replays if r.get("wrong")]
    print(f"\n# {len(ran)} records, {len(failed)} failure lines, {len(bad)} with wrong "
          f"results; {info['seconds']:.0f} s; wrote {path}; {figure}")
    return 1 if bad else 0


def norm_table(rows) -> str:
    """The fused all-reduce + residual + RMSNorm per [rows, hidden]: µs per call."""
    lines = ["# all-reduce + residual add + RMSNorm, bf16, us per call (graph replay, slowest "
             "rank); x FI = FlashInfer's best / Purlin's epilogue",
             f"{'rows x hidden':>13} {'epilogue':>9} {'fi 1shot':>9} {'fi 2shot':>9} "
             f"{'purlin+torch':>12} {'nccl+torch':>10} {'x FI':>6} {'x nccl':>6}  wrong"]
    for r in rows:
        shape = f"{r['rows']}x{r['hidden']}"
        if "error" in r:
            lines.append(f"{shape:>13} failed: {r['error']}")
            continue
        fi = [r[k] for k in ("flashinfer-oneshot_us", "flashinfer-twoshot_us") if k in r]
        epi, nccl = r.get("purlin-epilogue_us"), r.get("nccl+torch_us")
        wrong = {k[:-6]: v for k, v in r.items() if k.endswith("_wrong")}
        lines.append(
            f"{shape:>13} {_us(epi):>9} {_us(r.get('flashinfer-oneshot_us')):>9} "
            f"{_us(r.get('flashinfer-twoshot_us')):>9} {_us(r.get('purlin+torch_us')):>12} "
            f"{_us(r.get('nccl+torch_us')):>10} "
            f"{(f'{min(fi) / epi:.2f}x' if fi and epi else '-'):>6} "
            f"{(f'{nccl / epi:.2f}x' if epi and nccl else '-'):>6}  {wrong}"
            + (f"  flashinfer: {r['flashinfer_error']}" if "flashinfer_error" in r else ""))
    return "\n".join(lines)


def tp_table(rows) -> str:
    """The TP=2 decoder step per hidden and batch: µs per step and the ratios."""
    lines = ["# TP=2 decoder step, bf16, us per step (graph replay, slowest rank); x = nccl / "
             "provider, epi/FI = FlashInfer / Purlin's epilogue; bound = nccl / no all-reduce",
             f"{'hidden':>6} {'batch':>5} {'nccl':>9} {'purlin-epi':>10} {'flashinfer':>10} "
             f"{'none':>9} {'x epi':>6} {'x FI':>6} {'epi/FI':>6} {'bound':>6} agree"]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['hidden']:>6} {r['batch']:>5} failed: "
                         f"{r['error'].strip().splitlines()[-1]}")
            continue
        g = r.get
        lines.append(f"{r['hidden']:>6} {r['batch']:>5} {_us(g('nccl_us')):>9} "
                     f"{_us(g('purlin-epi_us')):>10} {_us(g('flashinfer_us')):>10} "
                     f"{_us(g('none-fn_us')):>9} {_r(g('purlin-epi_vs_nccl')):>6} "
                     f"{_r(g('flashinfer_vs_nccl')):>6} {_r(g('purlin-epi_vs_flashinfer')):>6} "
                     f"{_r(g('none-fn_vs_nccl')):>6} {'yes' if g('agree') else 'NO'}")
    return "\n".join(lines)


def _us(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def _r(v) -> str:
    return "-" if v is None else f"{v:.2f}x"


if __name__ == "__main__":
    sys.exit(main())
