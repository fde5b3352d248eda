"""Purlin against every peer at its best, on the same two GPUs in one run (``bench/peers.py``).

What the run is, as data: the peers and what each runs (:data:`PEERS`), the plan of peers x
collectives x sizes with a one-line reason for everything left out (:func:`plan`), the
per-size ratio of the best peer to Purlin (:func:`ratios`) and the tables. The GPU parts that
need no ``purlin.torch`` live here too: NCCL on buffers registered as a symmetric window
(:class:`NcclWindow`, used by :mod:`purlin.bench.torch_dist` for the ``nccl-window``
provider), FlashInfer's all-reduce kernels (:class:`FlashInferAllReduce`) and the stripping
of FlashInfer's wheel to what they need (:func:`strip_flashinfer`).

>>> p = plan(["all-reduce"], [8, 8 << 10], Environment(gpus=2, flashinfer=None,
...          nccl=None, window=None, symm=None, nvcc=None))
>>> sorted({pt.peer for pt in p.points})  # doctest: +NORMALIZE_WHITESPACE
['flashinfer-oneshot', 'nccl', 'nccl-window', 'purlin-process', 'purlin:auto',
 'purlin:direct-push', 'purlin:ring', 'purlin:two-phase', 'symm-one-shot', 'symm-two-shot']
>>> [s for s in p.skipped if s.startswith("flashinfer-oneshot")]  # doctest: +ELLIPSIS
['flashinfer-oneshot all-reduce 8 B: FlashInfer reduces rows of a multiple of 8 ...']
"""

from __future__ import annotations

import base64
import hashlib
import math
import os
import posixpath
import re
import shutil
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from purlin.bench.metrics import Record, Timing
from purlin.bench.sweep import SIX

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
SIZES = (8, 64, 512, 4 * KiB, 8 * KiB, 32 * KiB, 64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB,
         16 * MiB, 64 * MiB, 256 * MiB, 1 * GiB)
QUICK_SIZES = (8, 8 * KiB, 1 * MiB, 64 * MiB)
NORM_SHAPES = tuple((rows, hidden) for hidden in (4096, 8192) for rows in (1, 8, 32, 64))
QUICK_NORM_SHAPES = ((1, 4096), (64, 8192))
# copy engines pay their setup back from here (docs/BENCHMARKS.md, "Copy-engine datapath")
CE_MIN_BYTES = 64 * MiB
FLASHINFER_VEC = 8               # bf16 elements per 16-byte access: rows are multiples of it
FLASHINFER_MAX_HIDDEN = 4096     # the row width an all-reduce of many elements is cut into
FLASHINFER_MAX_COMM = 2147483647 & ~((1 << 21) - 1)  # its Lamport buffer's limit (bytes)
# its workspace is sized for the largest message: 256 MiB takes ~2 GiB per GPU, 1 GiB ~8 GiB
# with a Lamport buffer of more than 2^31 elements; TensorRT-LLM hands such sizes to NCCL
FLASHINFER_MAX_BYTES = 256 * MiB


@dataclass(frozen=True)
class Peer:
    """Who runs a point: ``side`` "purlin" or "peer"; ``mode`` "process" (one process per GPU)
    or "single" (one process drives both GPUs); ``needs``: what must be present here."""

    name: str
    side: str
    mode: str
    collectives: tuple
    what: str
    needs: tuple = ()


PEERS = (
    Peer("nccl", "peer", "process", SIX, "NCCL through torch.distributed, default buffers",
         ("gpus", "nccl")),
    Peer("nccl-window", "peer", "process", SIX,
         "NCCL on buffers registered as a symmetric window (ncclMemAlloc pool, "
         "ProcessGroupNCCL.register_mem_pool(pool, symm=True))", ("gpus", "nccl", "window")),
    Peer("symm-one-shot", "peer", "process", ("all-reduce",),
         "torch.ops.symm_mem.one_shot_all_reduce", ("gpus", "nccl", "symm")),
    Peer("symm-two-shot", "peer", "process", ("all-reduce",),
         "torch.ops.symm_mem.two_shot_all_reduce_", ("gpus", "nccl", "symm")),
    Peer("flashinfer-oneshot", "peer", "process", ("all-reduce",),
         "FlashInfer allreduce_fusion (TensorRT-LLM kernels), kAllReduce, one-shot",
         ("gpus", "nccl", "flashinfer", "nvcc")),
    Peer("flashinfer-twoshot", "peer", "process", ("all-reduce",),
         "FlashInfer allreduce_fusion (TensorRT-LLM kernels), kAllReduce, two-shot",
         ("gpus", "nccl", "flashinfer", "nvcc")),
    Peer("purlin:auto", "purlin", "single", SIX, "Cluster.local(2), strategy auto", ("gpus",)),
    Peer("purlin:direct-push", "purlin", "single", SIX, "Cluster.local(2), direct-push",
         ("gpus",)),
    Peer("purlin:two-phase", "purlin", "single", ("all-reduce", "reduce-scatter", "reduce"),
         "Cluster.local(2), two-phase", ("gpus",)),
    Peer("purlin:ring", "purlin", "single", SIX, "Cluster.local(2), ring", ("gpus",)),
    Peer("ce:auto", "purlin", "single", SIX, "Cluster.local(2), copy engines, from 64 MiB",
         ("gpus",)),
    Peer("purlin-process", "purlin", "process", SIX,
         "purlin.torch.Communicator(protocol='auto', zero_copy=True), one process per GPU",
         ("gpus", "nccl")),
)
BY_NAME = {p.name: p for p in PEERS}
STRATEGIES = ("purlin:direct-push", "purlin:two-phase", "purlin:ring")


def side(provider: str) -> str:
    """"purlin" for Purlin's providers (any ``purlin:``/``ce:`` configuration, process mode),
    else "peer"."""
    if provider in BY_NAME:
        return BY_NAME[provider].side
    return "purlin" if provider.startswith(("purlin", "ce:")) else "peer"


# -- what is here -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Environment:
    """What this machine has, as reasons something is missing (None: present)."""

    gpus: int
    nccl: str | None
    window: str | None
    symm: str | None
    flashinfer: str | None
    nvcc: str | None

    @classmethod
    def complete(cls, gpus: int = 2) -> "Environment":
        """A machine with ``gpus`` GPUs and every peer present (the plan a dry run shows)."""
        return cls(gpus, None, None, None, None, None)

    def missing(self, need: str, nranks: int = 2) -> str | None:
        if need == "gpus":
            if self.gpus >= nranks:
                return None
            seen = f"{self.gpus} {'is' if self.gpus == 1 else 'are'} visible"
            return f"needs {nranks} GPUs, one per rank, and {seen}"
        return getattr(self, need)


def probe(gpus: int | None = None) -> Environment:
    """Look at this machine without starting CUDA work: GPUs, torch's NCCL, NCCL window
    registration, PyTorch symmetric memory's all-reduce ops, FlashInfer and nvcc."""
    from purlin.bench.clusters import gpu_count

    gpus = gpu_count() if gpus is None else gpus
    try:
        import torch
        import torch.distributed as dist
    except Exception as exc:  # noqa: BLE001 - any import failure is the reason
        why = f"torch does not import here ({type(exc).__name__}: {exc})"
        return Environment(gpus, why, why, why, why, _nvcc())
    nccl = None if dist.is_available() and dist.is_nccl_available() else \
        f"torch {torch.__version__} is built without NCCL"
    return Environment(gpus, nccl, _window_reason(torch, dist) if nccl is None else nccl,
                       _symm_reason(torch), _flashinfer_reason(), _nvcc())


def _window_reason(torch, dist) -> str | None:
    """NCCL window registration as torch offers it: a MemPool of NCCL's own allocator
    (``ProcessGroupNCCL.mem_allocator``, ncclMemAlloc) registered with
    ``register_mem_pool(pool, symm=True)``, which calls ncclCommWindowRegister with
    NCCL_WIN_COLL_SYMMETRIC (torch >= 2.9, NCCL >= 2.27)."""
    pg = getattr(getattr(dist, "distributed_c10d", None), "ProcessGroupNCCL", None)
    if pg is None or not hasattr(pg, "register_mem_pool"):
        return (f"torch {torch.__version__} has no ProcessGroupNCCL.register_mem_pool (NCCL "
                "window registration)")
    if not hasattr(torch.cuda, "MemPool"):
        return f"torch {torch.__version__} has no torch.cuda.MemPool"
    try:
        version = tuple(torch.cuda.nccl.version())
    except Exception:  # noqa: BLE001 - no CUDA build
        return None
    if version < (2, 27, 0):
        return (f"NCCL {'.'.join(map(str, version))} has no symmetric kernels (they came "
                "with 2.27)")
    return None


def _symm_reason(torch) -> str | None:
    try:
        ops = torch.ops.symm_mem
        missing = [n for n in ("one_shot_all_reduce", "two_shot_all_reduce_")
                   if not hasattr(ops, n)]
    except Exception as exc:  # noqa: BLE001
        return f"torch.ops.symm_mem is not available ({type(exc).__name__})"
    if missing:
        return f"torch {torch.__version__} has no torch.ops.symm_mem.{missing[0]}"
    return None


def _flashinfer_reason() -> str | None:
    import importlib.util

    if importlib.util.find_spec("flashinfer") is None:
        return ("flashinfer is not installed here (bash bench/wheels.sh --peers fetches it, "
                "stripped to its communication kernels, into .whl/)")
    try:
        import flashinfer.comm.allreduce  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure is the reason
        return f"flashinfer.comm does not import: {type(exc).__name__}: {str(exc)[:200]}"
    return None


def _nvcc() -> str | None:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if (home and Path(home, "bin", "nvcc").exists()) or shutil.which("nvcc"):
        return None
    return ("FlashInfer compiles its kernels on first use and needs nvcc (CUDA_HOME or PATH); "
            "none is here")


# -- the plan -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class PlanPoint:
    peer: str
    collective: str
    nbytes: int


@dataclass
class Plan:
    """The points to measure and one line for each thing left out, with the seconds each
    phase is expected to take on 2 x H200."""

    points: list
    skipped: list
    norm_shapes: tuple = ()
    tp_configs: tuple = ()
    replays: int = 0
    estimate: dict = field(default_factory=dict)

    def of(self, *peers) -> list:
        return [p for p in self.points if p.peer in peers]

    def sizes(self, peer: str, collective: str) -> list:
        return [p.nbytes for p in self.points if p.peer == peer and p.collective == collective]

    def text(self, head: str = "peers x collectives x sizes") -> str:
        """The plan as the dry run prints it: per peer and collective, the sizes that run."""
        lines = [f"# {head} (bf16, CUDA-graph replay, slowest rank)"]
        for peer in PEERS:
            for coll in SIX:
                sizes = self.sizes(peer.name, coll)
                if sizes:
                    lines.append(f"{peer.name:<20} {coll:<15} {len(sizes):>2} sizes: "
                                 f"{size_text(sizes[0])} .. {size_text(sizes[-1])}")
        if self.norm_shapes:
            shapes = ", ".join(f"{r}x{h}" for r, h in self.norm_shapes)
            lines.append(f"{'fused all-reduce + residual + RMSNorm':<37} rows x hidden: {shapes}")
        if self.tp_configs:
            cfg = ", ".join(f"h{h} b{b}" for h, b in self.tp_configs)
            lines.append(f"{'TP=2 decoder step':<37} {cfg}")
        if self.replays:
            lines.append(f"{'graph replays, new inputs each time':<37} {self.replays} per size")
        lines += [f"# skipped: {s}" for s in self.skipped]
        if self.estimate:
            total = sum(self.estimate.values())
            lines.append("# estimate on 2 x H200: " + ", ".join(
                f"{k} {v:.0f} s" for k, v in self.estimate.items()) + f"; total {total:.0f} s")
        return "\n".join(lines)


def size_text(n: int) -> str:
    """``8 B``, ``64 KiB``, ``1 GiB``.

    >>> size_text(8), size_text(64 << 10), size_text(3 << 20)
    ('8 B', '64 KiB', '3 MiB')
    """
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def flashinfer_shape(nbytes: int, itemsize: int = 2) -> tuple[int, int] | None:
    """The [tokens, hidden] an all-reduce of ``nbytes`` runs as in FlashInfer (rows of up to
    :data:`FLASHINFER_MAX_HIDDEN` elements, a multiple of 8), or None where it cannot.

    >>> flashinfer_shape(8), flashinfer_shape(16), flashinfer_shape(1 << 20)
    (None, (1, 8), (128, 4096))
    """
    count = nbytes // itemsize
    if count < FLASHINFER_VEC or count % FLASHINFER_VEC:
        return None
    hidden = min(count, FLASHINFER_MAX_HIDDEN)
    while count % hidden:
        hidden //= 2
    return (count // hidden, hidden) if hidden % FLASHINFER_VEC == 0 else None


def size_reason(peer: str, collective: str, nbytes: int, nranks: int = 2) -> str | None:
    """Why ``peer`` leaves out this size (None: it runs it)."""
    if peer.startswith("flashinfer"):
        if nbytes > FLASHINFER_MAX_BYTES:
            return (f"FlashInfer runs up to {size_text(FLASHINFER_MAX_BYTES)} here: its "
                    "workspace, sized for the largest message, would take ~8 GiB per GPU "
                    "with a Lamport buffer of more than 2^31 elements (TensorRT-LLM hands "
                    "such sizes to NCCL)")
        shape = flashinfer_shape(nbytes)
        if shape is None:
            return (f"FlashInfer reduces rows of a multiple of {FLASHINFER_VEC} bf16 elements "
                    f"(16 B); {size_text(nbytes)} is {nbytes // 2}")
        tokens, _ = shape
        if peer.endswith("twoshot") and tokens <= nranks:
            return f"FlashInfer's two-shot kernel needs more than {nranks} rows; this is {tokens}"
        if peer.endswith("oneshot") and nbytes * nranks > FLASHINFER_MAX_COMM:
            return "FlashInfer's one-shot kernel needs a Lamport buffer above its 2 GiB limit"
    return None


# rough seconds on 2 x H200 (process start and NCCL setup, then per point), for the estimate;
# FlashInfer's build runs beside the first phases: its three sources took 136, 342 and 90 s
# of one CPU core with nvcc 13.0 (sm_90a), and build in parallel
COST = {"spawn": 15.0, "baseline": 0.35, "purlin": 1.2, "process": 0.6, "norm": 1.5,
        "tp": 2.5, "replay": 0.00012, "flashinfer_build": 342.0}


def plan(collectives, sizes, env: Environment, *, quick: bool = False, nranks: int = 2,
         strategies: bool = True, norm: bool = True, tp: bool = True,
         replays: int = 10000) -> Plan:
    """Every (peer, collective, size) that runs here, and why the rest does not: a peer whose
    needs are missing is one line, a size a peer cannot run is one line per size."""
    points, skipped = [], []
    sizes = sorted(sizes)
    every_other = sizes if quick or len(sizes) < 8 else sizes[::2]
    if sizes and sizes[-1] not in every_other:
        every_other = every_other + [sizes[-1]]
    for peer in PEERS:
        if peer.name in STRATEGIES and not strategies:
            continue
        why = "; ".join(dict.fromkeys(w for w in (env.missing(n, nranks) for n in peer.needs)
                                      if w))
        colls = [c for c in collectives if c in peer.collectives]
        if why:
            if colls:
                skipped.append(f"{peer.name}: {why}")
            continue
        for coll in colls:
            todo = every_other if peer.name in STRATEGIES else sizes
            if peer.name == "ce:auto":
                todo = [s for s in sizes if s >= CE_MIN_BYTES]
            for n in todo:
                why = size_reason(peer.name, coll, n, nranks)
                if why:
                    skipped.append(f"{peer.name} {coll} {size_text(n)}: {why}")
                else:
                    points.append(PlanPoint(peer.name, coll, n))
    shapes = (QUICK_NORM_SHAPES if quick else NORM_SHAPES) if norm else ()
    configs = (((4096, 1), (4096, 8)) if quick else
               tuple((h, b) for h in (4096, 8192) for b in (1, 8, 32, 64))) if tp else ()
    process = "; ".join(w for w in (env.missing("gpus", nranks), env.nccl) if w)
    fi = "; ".join(w for w in (env.flashinfer, env.nvcc) if w)
    if (shapes or configs) and fi:
        skipped.append(f"flashinfer-fused (all-reduce + residual + RMSNorm, and in the TP=2 "
                       f"decoder): {fi}")
    if (shapes or configs) and process:
        skipped.append(f"fused all-reduce + RMSNorm and the TP=2 decoder: {process}")
        shapes, configs = (), ()
    if replays and process:
        skipped.append(f"{replays} graph replays: {process}")
        replays = 0
    return Plan(points, skipped, shapes, configs, replays,
                estimate(points, shapes, configs, replays, SINGLE_BUDGET[quick]))


# seconds the single-process Purlin points may take (bench/peers.py --single-budget)
SINGLE_BUDGET = {False: 180, True: 60}


def estimate(points, shapes, configs, replays, single_budget: float = 170) -> dict:
    """Seconds per phase on 2 x H200 (:data:`COST`; process start included). FlashInfer's
    kernels build on the CPU cores meanwhile (about :data:`COST` ``flashinfer_build``)."""
    def count(*names):
        return sum(1 for p in points if p.peer in names)

    base = count("nccl", "nccl-window", "symm-one-shot", "symm-two-shot")
    single = sum(1 for p in points if BY_NAME[p.peer].mode == "single")
    proc = count("purlin-process")
    fi = count("flashinfer-oneshot", "flashinfer-twoshot")
    out = {}
    if base:
        out["baselines"] = COST["spawn"] + base * COST["baseline"]
    if single:
        out["purlin single-process"] = min(single * COST["purlin"], single_budget)
    if proc or shapes or replays or fi:
        out["process mode"] = (COST["spawn"] + proc * COST["process"]
                               + len(shapes) * COST["norm"] + 3 * replays * COST["replay"]
                               + fi * COST["baseline"])
    if configs:
        out["TP decoder"] = COST["spawn"] + len(configs) * COST["tp"] * 4
    return {k: round(v) for k, v in out.items()}


# -- NCCL on a symmetric window ----------------------------------------------------------------
class NcclWindow:
    """One input and one output buffer per rank, allocated with NCCL's own allocator
    (``ProcessGroupNCCL.mem_allocator``: ncclMemAlloc) and registered as a symmetric window
    (``register_mem_pool(pool, symm=True)`` -> ncclCommWindowRegister(...,
    NCCL_WIN_COLL_SYMMETRIC)), big enough for every point; a point's buffers are views at
    offset 0, so the offsets are the same on every rank, as the symmetric kernels require.
    Registration is collective: every rank builds it with the same sizes."""

    def __init__(self, torch, dist, device, in_bytes: int, out_bytes: int):
        backend = dist.group.WORLD._get_backend(device)
        self.pool = torch.cuda.MemPool(backend.mem_allocator)
        with torch.cuda.use_mem_pool(self.pool):
            self.inp = torch.zeros(max(in_bytes, 16), dtype=torch.uint8, device=device)
            self.out = torch.zeros(max(out_bytes, 16), dtype=torch.uint8, device=device)
        torch.cuda.synchronize(device)
        try:
            backend.register_mem_pool(self.pool, symm=True)
        except TypeError:  # the argument is positional in some builds
            backend.register_mem_pool(self.pool, True)
        self.backend = backend
        dist.barrier()

    @staticmethod
    def needs(points, world: int) -> tuple[int, int]:
        """The (input, output) bytes of the largest ``nccl-window`` point (nccl-tests sizes:
        ``nbytes`` is the largest per-rank buffer)."""
        need_in = need_out = 0
        for provider, coll, nbytes, *_ in points:
            if provider != "nccl-window":
                continue
            part = nbytes // world
            need_in = max(need_in, part if coll == "all-gather" else nbytes)
            need_out = max(need_out, part if coll == "reduce-scatter" else nbytes)
        return need_in, need_out

    def buffers(self, inp, out):
        """Copies of ``inp`` and ``out`` in the window (views of its buffers at offset 0)."""
        a = self.inp[: inp.numel() * inp.element_size()].view(inp.dtype)
        b = self.out[: out.numel() * out.element_size()].view(out.dtype)
        a.copy_(inp)
        b.copy_(out)
        return a, b


# -- FlashInfer -------------------------------------------------------------------------------
class FlashInferAllReduce:
    """FlashInfer's TensorRT-LLM all-reduce kernels on one rank: a workspace for up to
    ``max_tokens`` x ``hidden`` elements, then ``all_reduce`` (pattern kAllReduce) and
    ``add_rms_norm`` (kARResidualRMSNorm: all-reduce, residual add, RMSNorm in one kernel).
    Launched with PDL and fp32 accumulation, as inference engines run them on Hopper. The
    workspace comes from PyTorch symmetric memory (FlashInfer's multicast-free path), never
    NVLink multicast."""

    def __init__(self, torch, dist, rank: int, world: int, max_tokens: int, hidden: int,
                 dtype):
        os.environ.setdefault("FLASHINFER_CONFIDENTIAL_COMPUTE", "1")  # multicast-free
        from flashinfer.comm import allreduce as far
        from flashinfer.comm.trtllm_ar import AllReduceFusionPattern

        self.torch, self.far, self.pattern = torch, far, AllReduceFusionPattern
        self.world, self.rank, self.sums = world, rank, {}
        self.workspace = far.create_allreduce_fusion_workspace(
            backend="trtllm", world_size=world, rank=rank, max_token_num=max_tokens,
            hidden_dim=hidden, dtype=dtype, group=dist.group.WORLD)

    def all_reduce(self, inp, out, oneshot: bool | None):
        """``out = sum(inp)`` over the ranks; ``inp`` is [tokens, hidden] (see
        :func:`flashinfer_shape`); ``oneshot`` None: FlashInfer's own choice."""
        return self.far.allreduce_fusion(
            input=inp, workspace=self.workspace, pattern=self.pattern.kAllReduce,
            launch_with_pdl=True, output=out, use_oneshot=oneshot, fp32_acc=True)

    def add_rms_norm(self, t, residual, weight, eps: float, oneshot: bool | None = None):
        """``residual += sum(t)``; ``t = rms_norm(residual) * weight``, in place (as
        ``Communicator.all_reduce_add_rms_norm``)."""
        hidden = t.shape[-1]
        flat, res = t.view(-1, hidden), residual.view(-1, hidden)
        key = (tuple(flat.shape), flat.dtype, flat.device)
        if key not in self.sums:  # its all-reduce output, kept: no allocation per call
            self.sums[key] = self.torch.empty_like(flat)
        return self.far.allreduce_fusion(
            input=flat, workspace=self.workspace, pattern=self.pattern.kARResidualRMSNorm,
            launch_with_pdl=True, output=self.sums[key], residual_out=res, norm_out=flat,
            residual_in=res, rms_gamma=weight, rms_eps=eps, use_oneshot=oneshot,
            fp32_acc=True)


# FlashInfer's JIT sources for flashinfer.comm (jit/comm.py), and where it looks for headers
FLASHINFER_SOURCES = ("trtllm_allreduce.cu", "trtllm_allreduce_fusion.cu",
                      "trtllm_moe_allreduce_fusion.cu", "vllm_custom_all_reduce.cu")
FLASHINFER_INCLUDES = ("data/include", "data/csrc", "data/cutlass/include",
                       "data/cutlass/tools/util/include", "data/spdlog/include",
                       "data/cccl/libcudacxx/include", "data/cccl/cub", "data/cccl/thrust")
FLASHINFER_CCCL = "data/cccl/"
# the Python that `import flashinfer.comm.allreduce` loads, by folder (the rest of the package
# is attention, GEMM and MoE kernels this run does not touch)
FLASHINFER_PY = ("autotuner/", "cake_ulysses_backend/", "comm/", "cute_dsl/", "cutile/",
                 "jit/", "quantization/", "trace/")
STRIPPED_INIT = (b'"""FlashInfer stripped to flashinfer.comm and its JIT sources (see Purlin\'s '
                 b'bench/wheels.sh --peers); import flashinfer.comm."""\n'
                 b"from .version import __version__ as __version__\n")
_INCLUDE = re.compile(rb'^\s*#\s*include\s*[<"]([^>"]+)[>"]', re.M)


def strip_flashinfer(wheel, out_dir) -> Path:
    """Write a copy of FlashInfer's wheel that keeps only what its all-reduce kernels need:
    ``flashinfer/*.py`` and the folders of :data:`FLASHINFER_PY`, the JIT sources of
    :data:`FLASHINFER_SOURCES` and every header they include (followed through the vendored
    include folders; CUDA's, the C++ library's and tvm-ffi's come from the machine), all of
    the vendored CCCL, a top-level ``__init__`` that imports nothing else, and a new RECORD.
    Returns its path."""
    src = zipfile.ZipFile(wheel)
    names = set(src.namelist())
    root = "flashinfer/"
    keep = {n for n in names if ".dist-info/" in n and not n.endswith("/RECORD")}
    keep |= {n for n in names if n.endswith(".py") and n.startswith(root)
             and ("/" not in n[len(root):] or n[len(root):].startswith(FLASHINFER_PY))}
    dirs = [root + d for d in FLASHINFER_INCLUDES]
    todo, seen = [f"{root}data/csrc/{s}" for s in FLASHINFER_SOURCES if
                  f"{root}data/csrc/{s}" in names], set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for inc in _INCLUDE.findall(src.read(path)):
            inc = inc.decode()
            for d in [posixpath.dirname(path)] + dirs:
                cand = posixpath.normpath(posixpath.join(d, inc))
                if cand in names:
                    todo.append(cand)
                    break
    keep |= seen
    # the toolkit's own headers (cooperative_groups.h, ...) include CCCL too, and find the
    # vendored copy first: keep all of it, or two CCCL versions would mix
    keep |= {n for n in names if n.startswith(root + FLASHINFER_CCCL) and not n.endswith("/")}
    out = Path(out_dir) / Path(wheel).name
    out.parent.mkdir(parents=True, exist_ok=True)
    record_name = next((n for n in names if n.endswith(".dist-info/RECORD")),
                       "flashinfer.dist-info/RECORD")
    rows = []
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        for name in sorted(keep):
            data = STRIPPED_INIT if name == root + "__init__.py" else src.read(name)
            dst.writestr(name, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            rows.append(f"{name},sha256={digest.decode()},{len(data)}")
        dst.writestr(record_name, "\n".join(rows + [f"{record_name},,"]) + "\n")
    return out


# -- results --------------------------------------------------------------------------------------
def best_peer_records(records) -> list[Record]:
    """Per (collective, size, dtype, mode): a record "best peer" with the time of the fastest
    correct peer (``extra["peer"]`` names it), for ratios and the speed-up figure."""
    best: dict = {}
    for r in records:
        if side(r.provider) != "peer" or not r.ok or r.wrong != 0:
            continue
        key = (r.collective, r.nranks, r.nbytes, r.dtype, r.mode)
        if key not in best or r.time_us < best[key].time_us:
            best[key] = r
    out = []
    for r in best.values():
        t = Timing(r.time_us, r.p20_us, r.p80_us, 1)
        out.append(Record.make("best peer", r.collective, r.nranks, r.nbytes, r.count, r.dtype,
                               r.redop, r.mode, t, r.wrong, peer=r.provider))
    return out


def ratios(records) -> list[dict]:
    """Per collective and size (graph mode): the best peer and its time, Purlin's best (any
    configuration, either mode) and process mode's, and best peer time / Purlin time (> 1:
    Purlin faster).

    >>> t = lambda us: Timing(us, us, us, 1)
    >>> recs = [Record.make(p, "all-reduce", 2, 8192, 4096, "bfloat16", "sum", "graph",
    ...                     t(us), 0) for p, us in (("nccl", 12.0), ("symm-one-shot", 6.0),
    ...                                             ("purlin:auto", 3.0), ("purlin-process", 5.0))]
    >>> row = ratios(recs)[0]
    >>> row["best_peer"], row["ratio"], row["ratio_process"]
    ('symm-one-shot', 2.0, 1.2)
    """
    rows: dict = {}
    for r in records:
        if r.mode != "graph" or not r.ok or r.wrong != 0:
            continue
        row = rows.setdefault((r.collective, r.nbytes), {"collective": r.collective,
                                                          "nbytes": r.nbytes})
        if side(r.provider) == "peer":
            if r.time_us < row.get("best_peer_us", math.inf):
                row.update(best_peer=r.provider, best_peer_us=r.time_us)
        else:
            if r.time_us < row.get("purlin_us", math.inf):
                row.update(purlin=r.provider, purlin_us=r.time_us)
            if r.provider == "purlin-process":
                row["process_us"] = r.time_us
    out = []
    for (_, _), row in sorted(rows.items(), key=lambda kv: (SIX.index(kv[0][0])
                                                               if kv[0][0] in SIX else 99,
                                                               kv[0][1])):
        peer = row.get("best_peer_us")
        row["ratio"] = round(peer / row["purlin_us"], 3) if peer and "purlin_us" in row \
            else None
        row["ratio_process"] = round(peer / row["process_us"], 3) \
            if peer and "process_us" in row else None
        out.append(row)
    return out


def tables(records, skipped=()) -> str:
    """One table per collective: µs per op of every provider beside Purlin's, the best peer
    and best peer time / Purlin time (best Purlin, and process mode), per size."""
    graph = [r for r in records if r.mode == "graph"]
    provs = [p.name for p in PEERS if p.side == "purlin"] + \
        [p.name for p in PEERS if p.side == "peer"]
    provs += sorted({r.provider for r in graph} - set(provs))
    by = {(r.collective, r.nbytes, r.provider): r for r in graph}
    ratio_of = {(x["collective"], x["nbytes"]): x for x in ratios(graph)}
    blocks = []
    for coll in [c for c in SIX if any(r.collective == c for r in graph)] + sorted(
            {r.collective for r in graph} - set(SIX)):
        cols = [p for p in provs if any(k[0] == coll and k[2] == p for k in by)]
        short = [_short(p) for p in cols]
        head = (f"{'size':>9} " + " ".join(f"{s:>10}" for s in short)
                + f" {'best peer':>18} {'x best':>7} {'x proc':>7}")
        lines = [f"# {coll}: bf16 us per op (graph replay, slowest rank, median); x best = "
                 "best peer / best Purlin, x proc = best peer / process mode (> 1: Purlin "
                 "faster); * wrong elements, ! failed", head]
        for n in sorted({k[1] for k in by if k[0] == coll}):
            cells = []
            for p in cols:
                r = by.get((coll, n, p))
                if r is None:
                    cells.append(f"{'-':>9} ")
                elif not r.ok:
                    cells.append(f"{'!':>9} ")
                else:
                    cells.append(f"{r.time_us:>9.2f}{'*' if r.wrong else ' '}")
            x = ratio_of.get((coll, n), {})
            peer = x.get("best_peer", "-")
            lines.append(f"{size_text(n):>9} " + " ".join(cells)
                         + f" {_short(peer):>18} {_x(x.get('ratio')):>7} "
                         f"{_x(x.get('ratio_process')):>7}")
        blocks.append("\n".join(lines))
    text = "\n#\n".join(blocks)
    if skipped:
        text += "\n#\n" + "\n".join(f"# skipped: {s}" for s in skipped)
    return text


def _short(provider: str) -> str:
    return {"purlin:auto": "auto", "purlin:direct-push": "push", "purlin:two-phase": "2phase",
            "purlin:ring": "ring", "ce:auto": "ce", "purlin-process": "process",
            "symm-one-shot": "symm-1shot", "symm-two-shot": "symm-2shot",
            "flashinfer-oneshot": "fi-1shot", "flashinfer-twoshot": "fi-2shot",
            "nccl-window": "nccl-win"}.get(provider, provider)


def _x(v) -> str:
    return "-" if v is None else f"{v:.2f}x"


def failures_as_skips(records) -> tuple[list, list]:
    """Split records into those that ran and one skip line per (provider, reason) for those
    that failed: a peer that cannot run is a line, never a traceback."""
    ok, lines = [], {}
    for r in records:
        if r.ok:
            ok.append(r)
            continue
        err = str(r.extra.get("error", "failed")).strip().splitlines() or ["failed"]
        reason = err[-1].strip()[:240]
        key = (r.provider, reason)
        entry = lines.setdefault(key, [r.collective, []])
        entry[1].append(r.nbytes)
    out = [f"{prov} {coll} {', '.join(size_text(n) for n in sorted(ns)[:4])}"
           f"{' ...' if len(ns) > 4 else ''}: {reason}"
           for (prov, reason), (coll, ns) in lines.items()]
    return ok, out


def write_figure(records, path, title: str = "Purlin against every peer, 2 GPUs"):
    """Latency, bus bandwidth and speed-up over the best peer at each size (plotly, one HTML
    page; :mod:`purlin.bench.figures`)."""
    from purlin.bench.figures import figures, write_html

    graph = [r for r in records if r.mode == "graph" and r.ok]
    figs = figures(graph + best_peer_records(graph), baseline="best peer", title=title)
    return write_html(figs, path, title=title)
