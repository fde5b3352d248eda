"""strategy="auto": pick strategy, chunks, lanes and blocks per lane for a collective, size and
rank count -- from a tuning table, else on GPUs the fused fast path, else rules
(ARCHITECTURE.md, "Runtime").

>>> from purlin.spec import collectives
>>> from purlin.runtime import Cluster
>>> choose(collectives.all_reduce(2), Cluster.cpu(2), nbytes=8192)
('direct-push', 1, 1)
>>> choose(collectives.all_reduce(8), Cluster.cpu(8), nbytes=256 << 20)
('two-phase', 8, 16)
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path

from purlin.atom.sm import is_fused
from purlin.errors import SpecError
from purlin.snac import strategies as _strategy_registry

SMALL = 256 << 10
TUNING_DIR = Path(__file__).with_name("tuning")
MODEL_PROFILE = "H200-measured"
VIRTUAL_PROFILE = "H200-virtual"  # (virtual ranks share one GPU's memory, not NVLink)
STRATEGY_ORDER = ("direct-push", "direct-pull", "two-phase", "ring")
FORMAT = 1


@dataclass(frozen=True)
class Choice:
    """A configuration for one collective at one size; ``blocks_per_lane=None`` lets the
    datapath decide. ``source`` says where it came from ("table ...", "model ...", "rules")."""

    strategy: str
    chunks: int
    lanes: int
    blocks_per_lane: int | None = None
    source: str = "rules"
    protocol: str = "simple"
    pdl: bool = False
    lanes_by: str = "piece"

    def __repr__(self) -> str:
        bpl = "" if self.blocks_per_lane is None else f", blocks_per_lane={self.blocks_per_lane}"
        more = (f", protocol={self.protocol!r}" if self.protocol != "simple" else "") + \
            (", pdl=True" if self.pdl else "") + \
            (f", lanes_by={self.lanes_by!r}" if self.lanes_by != "piece" else "")
        return (f"Choice({self.strategy}, chunks={self.chunks}, lanes={self.lanes}{bpl}{more}, "
                f"from {self.source})")

    def sm_options(self) -> dict:
        """What the sm datapath's bind takes from this choice beyond strategy, chunks, lanes
        (its protocol and PDL always named: a bind that names none takes the fast path)."""
        return {"blocks_per_lane": self.blocks_per_lane, "protocol": self.protocol,
                "pdl": bool(self.pdl)}


def launch_options(blocks_per_lane, protocol: str = "simple", pdl: bool = False) -> dict:
    """The sm bind's keyword arguments for blocks per lane, protocol and PDL, the last two only
    where they differ from the defaults (as tuning tables store them).

    >>> launch_options(1, "ll", True), launch_options(8)
    ({'blocks_per_lane': 1, 'protocol': 'll', 'pdl': True}, {'blocks_per_lane': 8})
    """
    out = {"blocks_per_lane": blocks_per_lane}
    if protocol != "simple":
        out["protocol"] = protocol
    if pdl:
        out["pdl"] = True
    return out


# -- tuning tables ---------------------------------------------------------------------------
@dataclass
class TuningTable:
    """Measured best configurations of one GPU model: ``entries[nranks]`` is a list of dicts
    with ``collective``, ``nbytes``, ``strategy``, ``chunks``, ``lanes``, ``blocks_per_lane``
    and optionally ``protocol`` ("ll"), ``pdl`` (true), ``dtype``, ``time_us``, ``threads``
    and ``per_strategy`` (the best configuration of every strategy tried,
    ``{strategy: {chunks, lanes, ...}}``)."""

    gpu: str
    entries: dict = field(default_factory=dict)
    info: dict = field(default_factory=dict)
    path: str = ""
    virtual: dict = field(default_factory=dict)  # the same, measured on one GPU's virtual ranks

    def lookup(self, collective: str, nranks: int, nbytes: int, *, dtype: str | None = None,
               strategy: str | None = None, is_reduce: bool = True,
               virtual: bool = False) -> Choice | None:
        """The entry of ``collective`` on ``nranks`` (virtual ranks of one GPU with
        ``virtual``) nearest to ``nbytes`` (same dtype first); with ``strategy``, that
        strategy's best configuration there. Without ``strategy``: the entry's winner, or
        direct-push where it measured within ``TIE`` of it (:func:`preferred`); a fused choice
        of the virtual section comes with the bind's launch (:func:`own_launch`)."""
        best = self.entry(collective, nranks, nbytes, dtype=dtype, strategy=strategy,
                          virtual=virtual)
        if best is None:
            return None
        cfg = _config_of(best, strategy or preferred(best))
        if cfg["strategy"] == "two-phase" and not is_reduce:
            return None
        where = f"table {self.gpu}{' virtual' if virtual else ''} @ {best['nbytes']} B"
        protocol = cfg.get("protocol", "simple")
        choice = Choice(cfg["strategy"], int(cfg["chunks"]), int(cfg["lanes"]),
                        cfg.get("blocks_per_lane"), where, protocol, bool(cfg.get("pdl", False)))
        return own_launch(choice) if virtual and is_fused(protocol) else choice

    def entry(self, collective: str, nranks: int, nbytes: int, *, dtype: str | None = None,
              strategy: str | None = None, virtual: bool = False) -> dict | None:
        """The row :meth:`lookup` reads: ``collective``'s on ``nranks`` nearest to ``nbytes``
        in ratio (same dtype first; with ``strategy``, among the rows that timed it)."""
        section = self.virtual if virtual else self.entries
        rows = [e for e in section.get(int(nranks), []) if e["collective"] == collective]
        if dtype is not None and any(e.get("dtype") == dtype for e in rows):
            rows = [e for e in rows if e.get("dtype") == dtype]
        if strategy is not None:
            rows = [e for e in rows if _config_of(e, strategy)]
        if not rows:
            return None
        return min(rows, key=lambda e: (abs(math.log2(max(e["nbytes"], 1) / max(nbytes, 1))),
                                        e["nbytes"]))

    def add(self, nranks: int, entry: dict, virtual: bool = False) -> None:
        """Add or replace the entry of the same collective, size and dtype (of the virtual
        ranks' section with ``virtual``)."""
        rows = (self.virtual if virtual else self.entries).setdefault(int(nranks), [])
        key = (entry["collective"], entry["nbytes"], entry.get("dtype"))
        rows[:] = [e for e in rows if (e["collective"], e["nbytes"], e.get("dtype")) != key]
        rows.append(entry)
        rows.sort(key=lambda e: (e["collective"], e["nbytes"], str(e.get("dtype"))))

    def merge(self, other: "TuningTable") -> "TuningTable":
        """This table with every entry of ``other`` added (other's win on equal keys)."""
        out = TuningTable(self.gpu, {n: list(rows) for n, rows in self.entries.items()},
                          {**self.info, **other.info}, self.path,
                          {n: list(rows) for n, rows in self.virtual.items()})
        for virtual, section in ((False, other.entries), (True, other.virtual)):
            for n, rows in section.items():
                for e in rows:
                    out.add(n, e, virtual)
        return out

    def to_json(self) -> dict:
        out = {"format": FORMAT, "gpu": self.gpu, "info": self.info,
               "nranks": {str(n): rows for n, rows in sorted(self.entries.items())}}
        if self.virtual:
            out["virtual_nranks"] = {str(n): rows for n, rows in sorted(self.virtual.items())}
        return out

    @classmethod
    def from_json(cls, obj, path: str = "") -> "TuningTable":
        if obj.get("format", FORMAT) != FORMAT or "nranks" not in obj:
            raise SpecError(f"tuning table {path or '(given)'} is not a format-{FORMAT} table: "
                            "expected {\"format\": 1, \"gpu\": ..., \"nranks\": {\"2\": [...]}}")
        return cls(obj.get("gpu", ""), {int(n): list(rows) for n, rows in obj["nranks"].items()},
                   obj.get("info", {}), path,
                   {int(n): list(rows) for n, rows in obj.get("virtual_nranks", {}).items()})

    def save(self, path=None) -> Path:
        """Write the table (default: where :func:`tuning_path` looks for this GPU)."""
        path = Path(path) if path is not None else tuning_path(self.gpu)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        return path

    @classmethod
    def load(cls, path) -> "TuningTable":
        path = Path(path)
        return _load(str(path), path.stat().st_mtime_ns)


def own_launch(choice: Choice) -> Choice:
    """``choice`` with no blocks (the bind sizes its launch) and PDL: what a fused entry of a
    table's virtual-rank section gives. ``purlin tune`` kept every candidate within 512-thread
    blocks x ranks of the launch <= the resident blocks (16 per rank on 8 virtual ranks of
    132 SMs) while the fused kernel runs 128 or 256 threads where two or four times as many
    fit, so its blocks there were never compared with the launch the bind sizes itself
    (``atom.sm.fused_launch``: about one item per thread of the program's own items, which
    also follows a custom layout's uneven items); and it tried PDL only up to 1 MiB. Against
    the plain fused binds (that launch, with PDL), the entries' launches measured up to 1.5x
    slower on 8 virtual ranks (64 KiB all-reduce: 16 blocks, no PDL) and never faster; on 4
    ranks within a few percent either way below 16 MiB, slower at 16 MiB (no PDL)."""
    return Choice(choice.strategy, choice.chunks, choice.lanes, None,
                  f"{choice.source}, bind's launch", choice.protocol, True, choice.lanes_by)


TIE = 1.05  # a winner within this of direct-push's best did not beat it beyond noise


def preferred(entry: dict) -> str:
    """The strategy ``auto`` takes from a table entry: its fastest, unless direct-push (the
    plain binds' plan, the latency one) was measured within ``TIE`` of it -- a win inside the
    noise of one tuning run, often between launches the tuning cut short, is no reason to
    leave it.

    >>> preferred({"strategy": "ring", "time_us": 10.0,
    ...            "per_strategy": {"direct-push": {"time_us": 10.3}}})
    'direct-push'
    >>> preferred({"strategy": "ring", "time_us": 10.0,
    ...            "per_strategy": {"direct-push": {"time_us": 11.0}}})
    'ring'
    """
    push = entry.get("per_strategy", {}).get("direct-push") or {}
    won, mine = entry.get("time_us"), push.get("time_us")
    if entry["strategy"] != "direct-push" and won and mine and mine <= TIE * won:
        return "direct-push"
    return entry["strategy"]


def _config_of(entry: dict, strategy: str) -> dict | None:
    if entry["strategy"] == strategy:
        return entry
    cfg = entry.get("per_strategy", {}).get(strategy)
    return {**cfg, "strategy": strategy} if cfg else None


@lru_cache(maxsize=16)
def _load(path: str, mtime_ns: int) -> TuningTable:
    try:
        obj = json.loads(Path(path).read_text())
    except json.JSONDecodeError as exc:
        raise SpecError(f"tuning table {path} is not valid JSON: {exc}") from None
    return TuningTable.from_json(obj, path)


def slug(gpu: str) -> str:
    """A file name for a GPU model: ``"NVIDIA H200"`` -> ``"nvidia-h200"``."""
    return re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-") or "unknown"


def tuning_path(gpu: str) -> Path:
    """Where the table of ``gpu`` lives: ``$PURLIN_TUNING`` if it names a folder (or a file),
    else ``purlin/runtime/tuning/``."""
    env = os.environ.get("PURLIN_TUNING")
    if env:
        p = Path(env)
        if p.is_dir() or not p.suffix:
            return p / f"{slug(gpu)}.json"
        return p
    return TUNING_DIR / f"{slug(gpu)}.json"


def gpu_name(cluster) -> str | None:
    """The GPU model a cluster runs on (None for the cpu datapath or without CUDA)."""
    if getattr(cluster, "datapath", "cpu") == "cpu":
        return None
    try:
        import torch

        devices = getattr(cluster, "devices", ()) or (torch.cuda.current_device(),)
        return torch.cuda.get_device_name(devices[0])
    except Exception:
        return None


def find_table(table=None, gpu: str | None = None) -> TuningTable | None:
    """The table to use: ``table`` (a TuningTable or a path), else ``$PURLIN_TUNING`` when it
    names a file, else the file of ``gpu`` (if it exists)."""
    if isinstance(table, TuningTable):
        return table
    if table is not None:
        return TuningTable.load(table)
    env = os.environ.get("PURLIN_TUNING")
    if env and Path(env).is_file():
        return TuningTable.load(env)
    if gpu is None:
        return None
    path = tuning_path(gpu)
    return TuningTable.load(path) if path.is_file() else None


# -- choosing ----------------------------------------------------------------------------------
def select(collective, cluster=None, *, count=None, nbytes=None, dtype="float32",
           chunk_sizes=None, strategy: str | None = None, table=None, gpu: str | None = None,
           model: bool | None = None, virtual: bool | None = None,
           deterministic: bool = False) -> Choice:
    """The configuration for ``collective`` at this size on ``cluster``: from the tuning table
    of its GPU model, rank count and kind (``virtual``: one GPU's virtual ranks; by default
    ``cluster.kind == "virtual"``), else on GPUs the fast path (:func:`fast_choice`), else
    the rules (the cpu datapath; ``model=True``: the cost model's strategy there too).
    ``strategy`` fixes the strategy and picks only its chunks, lanes and blocks. A fused
    protocol is only chosen where the fused kernel can run the plan. ``deterministic``: only
    strategies whose every sum is one rank-ordered step (ring gives way to two-phase, the
    other bandwidth choice; anything else to direct-push).

    >>> from purlin.spec import collectives
    >>> from purlin.runtime import Cluster
    >>> table = TuningTable("NVIDIA H200", {2: [{"collective": "all-reduce", "nbytes": 1 << 20,
    ...     "strategy": "ring", "chunks": 2, "lanes": 4, "blocks_per_lane": 8}]})
    >>> select(collectives.all_reduce(2), Cluster.cpu(2), nbytes=2 << 20, table=table)
    Choice(ring, chunks=2, lanes=4, blocks_per_lane=8, from table NVIDIA H200 @ 1048576 B)
    """
    if deterministic and strategy is None and collective.op.is_reduce:
        from purlin.snac.determinism import DETERMINISTIC_STRATEGIES

        size = dict(count=count, nbytes=nbytes, dtype=dtype, chunk_sizes=chunk_sizes,
                    table=table, gpu=gpu, model=model, virtual=virtual)
        choice = select(collective, cluster, **size)
        if choice.strategy in DETERMINISTIC_STRATEGIES:
            return choice
        return select(collective, cluster, **size, strategy="two-phase"
                      if choice.strategy == "ring" else "direct-push")
    sizing = collective.sized(count, nbytes=nbytes, dtype=dtype, chunk_sizes=chunk_sizes)
    size = sizing.message_bytes
    datapath = getattr(cluster, "datapath", "cpu") if cluster is not None else "cpu"
    if virtual is None:
        virtual = getattr(cluster, "kind", None) == "virtual"
    if strategy is not None:
        from purlin.snac.strategies import check_strategy

        check_strategy(strategy, collective)
    profile = VIRTUAL_PROFILE if virtual else MODEL_PROFILE
    found = find_table(table, gpu if gpu is not None else gpu_name(cluster))
    if found is not None:
        choice = found.lookup(collective.name, collective.nranks, size,
                              dtype=sizing.dtype.name, strategy=strategy,
                              is_reduce=collective.op.is_reduce, virtual=bool(virtual))
        if choice is not None:
            return runnable(choice, sizing, strategy, profile) if datapath != "cpu" else choice
        twin = borrowed(found, sizing, virtual) if datapath != "cpu" and strategy is None \
            else None
        if twin is not None:
            return runnable(twin, sizing, profile=profile)
    if datapath != "cpu" and model is not False:
        return fast_choice(sizing, strategy, profile)
    if strategy is not None:
        return rules(collective, size, strategy)
    if model:
        return model_choice(sizing)
    return rules(collective, size)


def _choice_plan(sizing, choice: Choice):
    """``choice``'s plan for ``sizing`` (unverified: the bind verifies it; the fused kernel's
    question is about the lowered rows only), or why there is none."""
    from purlin.snac import plan

    try:
        return plan(sizing.collective, choice.strategy, sizing=sizing, chunks=choice.chunks,
                    lanes=choice.lanes, lanes_by=choice.lanes_by, check=False)
    except Exception as exc:  # a plan that does not verify is nothing to run
        return str(exc)


def _fused_problem(sizing, choice: Choice, protocol: str):
    """Why the fused kernel cannot run ``choice``'s plan with ``protocol`` (None: it can)."""
    got = _plan_problems(sizing, choice.strategy, choice.chunks, choice.lanes, choice.lanes_by)
    return got if isinstance(got, str) else got[protocol]


@lru_cache(maxsize=512)
def _plan_problems(sizing, strategy: str, chunks: int, lanes: int, lanes_by: str):
    """``fused_problems`` of a plan, or why there is none: lowered once per plan, however
    many of ``borrowed``'s and ``runnable``'s questions one bind asks about it."""
    from purlin.atom.fused import fused_problems

    schedule = _choice_plan(sizing, Choice(strategy, chunks, lanes, lanes_by=lanes_by))
    return schedule if isinstance(schedule, str) else fused_problems(schedule)


def runnable(choice: Choice, sizing, strategy: str | None = None,
             profile: str = MODEL_PROFILE) -> Choice:
    """``choice``, or where its fused protocol cannot run this sizing's plan (a table's
    choice at a nearby size: an odd size, a layout the fused kernel refuses) the fast path
    for this sizing (:func:`fast_choice`: the fused kernel with a plan it runs, else the
    interpreter): a table entry says how fast the fused kernel was, not the interpreter."""
    if not is_fused(choice.protocol) or \
            _fused_problem(sizing, choice, choice.protocol) is None:
        return choice
    return fast_choice(sizing, strategy, profile)


PDL_MAX_BYTES = 1 << 20  # where the tables found PDL faster: the launch gap is still visible


def twin_name(collective) -> str | None:
    """The standard collective whose tuning-table entries a custom layout borrows: for a
    copy, broadcast where at most half the ranks send, else all-gather; for a reduction,
    all-reduce where every rank gives and gets the same outputs, reduce where the ranks that
    get anything get the same outputs (each does what reduce's root does), reduce-scatter
    where every rank gives and gets its own (None otherwise).

    >>> from purlin.spec import Collective
    >>> twin_name(Collective([["a"], ["b"], [], []], [["a", "b"]] * 4, "copy"))
    'broadcast'
    >>> twin_name(Collective([[0, 1]] * 2, [[1], [0]], "max"))
    'reduce-scatter'
    >>> twin_name(Collective([["x"], ["x"], [], []], [[], [], ["x"], ["x"]], "sum"))
    'reduce'
    """
    n = collective.nranks
    if collective.op.is_reduce:
        outs = [tuple(collective.output[r]) for r in range(n)]
        every_input = all(len(collective.input[r]) for r in range(n))
        got = [o for o in outs if o]
        if len(set(got)) == 1:
            return "all-reduce" if len(got) == n and every_input else "reduce"
        names = [x for o in got for x in o]
        if every_input and len(got) == n and len(set(names)) == len(names):
            return "reduce-scatter"
        return None
    senders = sum(1 for r in range(n) if len(collective.input[r]))
    return "broadcast" if 2 * senders <= n else "all-gather"


PULL_MIN_BYTES = 1 << 20  # twin entries from here on: a copy layout on virtual ranks pulls


def borrowed(table, sizing, virtual: bool = False) -> Choice | None:
    """For a layout that ``table`` has no entry of (a custom one), its twin's
    (:func:`twin_name`) entry at the same size, or None. On virtual ranks a copy layout
    corrects it where the twin cannot see the layout's cost: from 1 MiB it pulls where the
    twin timed pull within ``TIE`` of its winner (a push copies each piece twice, a pull
    once); below 1 MiB it pushes where its receivers hear from more ranks than the twin's and
    the twin's winner is a pull (a small pull waits on a flag per source rank), and pulls
    on the fused kernel where the twin's winner is LL and the layout sends a peer several
    pieces the kernel cannot move on LL (:func:`_several_pieces_without_ll`). Why and what
    was measured: ARCHITECTURE.md, "Runtime"; docs/PERF_NOTES.md."""
    from purlin.spec.collectives import standard

    coll = sizing.collective
    name = twin_name(coll)
    if name is None or name == coll.name:
        return None
    where = dict(dtype=sizing.dtype.name, virtual=bool(virtual))
    choice = table.lookup(name, coll.nranks, sizing.message_bytes,
                          is_reduce=coll.op.is_reduce, **where)
    if choice is None:
        return None
    other = None  # the strategy a copy layout on virtual ranks takes instead
    if virtual and not coll.op.is_reduce:
        row = table.entry(name, coll.nranks, sizing.message_bytes, **where)
        if row["nbytes"] >= PULL_MIN_BYTES:
            pull = _config_of(row, "direct-pull") or {}
            if choice.strategy != "direct-pull" and pull.get("time_us") and \
                    row.get("time_us") and pull["time_us"] <= TIE * row["time_us"]:
                other = "direct-pull"
        elif choice.strategy == "direct-pull" and _config_of(row, "direct-push") and \
                senders_per_receiver(coll) > senders_per_receiver(standard(name, coll.nranks)):
            other = "direct-push"
        elif choice.protocol == "fused-ll" and _config_of(row, "direct-pull") and \
                _several_pieces_without_ll(sizing, choice):
            other = "direct-pull"
    if other is not None:
        choice = table.lookup(name, coll.nranks, sizing.message_bytes, strategy=other,
                              is_reduce=False, **where)
        if _fused_problem(sizing, choice, choice.protocol) is not None:
            choice = replace(choice, protocol="fused")
    return Choice(choice.strategy, choice.chunks, choice.lanes, choice.blocks_per_lane,
                  f"{choice.source} (its twin {name})", choice.protocol, choice.pdl,
                  choice.lanes_by)


def _several_pieces_without_ll(sizing, choice: Choice) -> bool:
    """Does ``choice``'s plan send a peer several pieces (GQA's q, k and v) and the fused
    kernel refuse it LL (``fuse_problem`` names the rule)? Then a pull is faster: one ready
    flag covers all of a peer's pieces, where a push's rows each carry one."""
    from purlin.atom.fused_rows import several_pieces

    schedule = _choice_plan(sizing, choice)
    return not isinstance(schedule, str) and several_pieces(schedule) and \
        _fused_problem(sizing, choice, "fused-ll") is not None


def senders_per_receiver(collective) -> int:
    """The most other ranks one rank's output comes from (a chunk from its first holder).

    >>> from purlin.spec import Collective, collectives
    >>> senders_per_receiver(collectives.broadcast(4))
    1
    >>> senders_per_receiver(Collective([["a"], ["b"], [], []], [["a", "b"]] * 4, "copy"))
    2
    """
    most = 0
    for r in range(collective.nranks):
        held = set(collective.input[r])
        senders = {collective.sources(x)[0][0] for x in collective.output[r]
                   if x not in held and collective.sources(x)}
        most = max(most, len(senders - {r}))
    return most


@lru_cache(maxsize=512)
def fast_choice(sizing, strategy: str | None = None, profile: str = MODEL_PROFILE) -> Choice:
    """The fused kernel for ``sizing`` where no table covers the cluster: one lane (what it
    runs), the strategy the cost model predicts fastest among those whose plan the fused
    kernel runs (or ``strategy``), LL up to ``LL_MAX_BYTES`` (one hop with the flag in the
    data), the rules' chunks for two-phase (pipelined through the one lane), the launch the
    bind sizes (no blocks given) with PDL at every size, as the plain fused binds launch;
    where the fused kernel runs none of them, the interpreter with the rules' chunks and
    lanes (LL for small messages, PDL up to ``PDL_MAX_BYTES``).

    >>> from purlin.spec import collectives
    >>> fast_choice(collectives.all_reduce(4).sized(4096, dtype="bfloat16")).protocol
    'fused-ll'
    """
    from purlin.atom.sm import LL_MAX_BYTES, fast_protocol

    coll, size = sizing.collective, sizing.message_bytes
    pdl = size <= PDL_MAX_BYTES
    if strategy:
        r = rules(coll, size, strategy)
        ranked = (Choice(strategy, r.chunks if strategy == "two-phase" else 1, 1),)
    else:  # fastest predicted first: the first one the fused kernel runs
        ranked = model_ranking(sizing, profile, True) or (rules(coll, size),)
    for cand in ranked:
        chunks = cand.chunks if cand.strategy == "two-phase" else 1
        where = cand.source if cand.source.startswith("model") else "rules"
        schedule = _choice_plan(sizing, Choice(cand.strategy, chunks, 1))
        protocol = "" if isinstance(schedule, str) else fast_protocol(schedule)
        if is_fused(protocol):  # (the one rule for the fused kernel's protocol)
            return Choice(cand.strategy, chunks, 1, None, f"fast path, {where}", protocol,
                          True)
    base = ranked[0]
    where = base.source if base.source.startswith("model") else "rules"
    r = rules(coll, size, base.strategy)  # the interpreter's chunks and lanes
    base = Choice(base.strategy, r.chunks, r.lanes, None, base.source)
    return Choice(base.strategy, base.chunks, base.lanes, None, f"interpreter, {where}",
                  "ll" if size <= LL_MAX_BYTES else "simple", pdl)


def choose(collective, cluster, *, count=None, nbytes=None, dtype="float32",
           chunk_sizes=None) -> tuple[str, int, int]:
    """(strategy, chunks, lanes) for this collective on this cluster; see :func:`select`."""
    c = select(collective, cluster, count=count, nbytes=nbytes, dtype=dtype,
               chunk_sizes=chunk_sizes)
    return c.strategy, c.chunks, c.lanes


def rules(collective, size: int, strategy: str | None = None) -> Choice:
    """The rule of thumb for ``size`` bytes (``strategy`` given: only its chunks and lanes)."""
    if size <= SMALL:
        return Choice(strategy or "direct-push", 1, 1)
    lanes = min(16, max(1, size // (1 << 20)))
    chunks = min(8, max(1, size // (4 << 20)))
    if strategy is None:
        reducing = collective.op.is_reduce and collective.name != "reduce"
        strategy = "two-phase" if reducing else "direct-push"
    return Choice(strategy, chunks, lanes)


# strategies meant for one datapath that `auto` and `purlin tune` leave to explicit choice
NOT_TUNED = ("push-pull",)   # engine split for the ce datapath (push on copy engines)


def strategies_for(collective) -> list[str]:
    """The registered strategies that can plan ``collective`` (each one's ``check`` says)."""
    from purlin.snac.strategies import STRATEGIES

    names = [s for s in STRATEGY_ORDER if s in STRATEGIES]
    names += [s for s in STRATEGIES if s not in names and s not in NOT_TUNED]
    return [s for s in names if not STRATEGIES[s].refusal(collective)]


def _forget_choices() -> None:
    """Every cached choice of this module may name a strategy since replaced or removed, or
    miss a new one: all are dropped when the registry changes."""
    for value in list(globals().values()):
        if callable(getattr(value, "cache_clear", None)):
            value.cache_clear()


_strategy_registry.on_change(_forget_choices)


_latency_model = None


def set_latency_model(fn) -> None:
    """Register ``fn(schedule, profile) -> ns``, the cost model ``auto`` ranks strategies with
    (``import purlin`` registers the trace layer's; the runtime does not import the layers
    above it)."""
    global _latency_model
    _latency_model = fn
    model_choice.cache_clear()


@lru_cache(maxsize=512)
def model_choice(sizing, profile: str = MODEL_PROFILE, one_lane: bool = False) -> Choice:
    """Rank the strategies by the cost model's predicted latency, each with its rule-of-thumb
    chunks and lanes (``one_lane``: one lane, chunks only for two-phase: what the fused
    kernel runs; the model does not see blocks; the datapath picks them). Without a
    registered model the rules decide."""
    ranked = model_ranking(sizing, profile, one_lane)
    return ranked[0] if ranked else rules(sizing.collective, sizing.message_bytes)


@lru_cache(maxsize=512)
def model_ranking(sizing, profile: str = MODEL_PROFILE, one_lane: bool = False) -> tuple:
    """:func:`model_choice`'s candidates, fastest predicted first (empty without a model)."""
    from purlin.snac import plan

    coll = sizing.collective
    predict_latency = _latency_model
    if predict_latency is None:
        return ()
    found = []
    for name in strategies_for(coll):
        cfg = rules(coll, sizing.message_bytes, name)
        if one_lane:
            cfg = Choice(name, cfg.chunks if name == "two-phase" else 1, 1)
        try:
            schedule = plan(coll, name, sizing=sizing, chunks=cfg.chunks, lanes=cfg.lanes,
                            check=False)
            ns = predict_latency(schedule, profile)
        except Exception:  # a strategy that cannot plan this collective is no candidate
            continue
        found.append((ns, len(found), cfg))
    return tuple(Choice(cfg.strategy, cfg.chunks, cfg.lanes, None,
                        f"model {profile}: {ns / 1e3:.3g} us") for ns, _, cfg in sorted(found))

