"""``purlin tune``: measure candidate configurations on the GPUs and keep the fastest correct
one per collective and size, as the tuning table that ``strategy="auto"`` reads.

Which candidates, and why in that order: ARCHITECTURE.md, "Benchmarks".

>>> from purlin.spec import collectives
>>> cands = candidates(collectives.all_reduce(2), 64 << 20, sms=132)
>>> all(c.lanes * c.blocks_per_lane <= 132 for c in cands), cands[0].strategy
(True, 'direct-push')
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

from purlin.atom.sm import FUSED_MAX_BYTES, LL_MAX_BYTES, is_fused
from purlin.bench.metrics import Record, Timing
from purlin.bench.sweep import Progress, Results, environment
from purlin.errors import CapabilityError
from purlin.runtime.auto import launch_options

KiB, MiB = 1 << 10, 1 << 20
PDL_MAX_BYTES = 1 * MiB     # above this the launch gap PDL hides is lost in the transfer time


@dataclass(frozen=True)
class Config:
    """One candidate configuration of the sm datapath."""

    strategy: str
    chunks: int
    lanes: int
    blocks_per_lane: int
    protocol: str = "simple"
    pdl: bool = False

    @property
    def blocks(self) -> int:
        return self.lanes * self.blocks_per_lane

    def __repr__(self) -> str:
        return (f"{self.strategy} c{self.chunks} l{self.lanes} b{self.blocks_per_lane}"
                f"{launch_suffix(self.protocol, self.pdl)}")

    def bind_options(self) -> dict:
        """The keyword arguments of ``cluster.bind`` beyond strategy, chunks and lanes."""
        return launch_options(self.blocks_per_lane, self.protocol, self.pdl)


def launch_suffix(protocol: str = "simple", pdl: bool = False) -> str:
    """" ll", " fused", " pdl", " ll pdl" or "": how configurations print their launch
    options."""
    return f"{'' if protocol == 'simple' else ' ' + protocol}{' pdl' if pdl else ''}"


def sm_budget(sms: int = 132, threads: int = 512, ranks_per_launch: int = 1) -> int:
    """Blocks one rank may launch so that every block of the launch is resident at once
    (the same rule the sm datapath checks when it binds).

    >>> sm_budget(132, threads=512), sm_budget(132, threads=128)
    (132, 528)
    """
    from purlin.kernels.occupancy import resident_blocks

    return max(1, resident_blocks(sms, threads) // max(1, ranks_per_launch))


def pieces(sizing, strategy: str, chunks: int) -> int:
    """How many pieces (routes) a plan has: more lanes than pieces leaves lanes idle."""
    from purlin.snac.planner import split
    from purlin.snac.segments import segments
    from purlin.snac.strategies import parts_of

    return sum(len(split(pcount, chunks)) for seg in segments(sizing)
               for _, pcount in split(seg.count, parts_of(seg, strategy)))


def _grid(nbytes: int, budget: int):
    """(chunks, lanes, blocks per lane) options worth trying at this size."""
    if nbytes <= 64 * KiB:
        return [1, 2], [1, 2, 4], [1, 2, 4, 8]
    if nbytes <= 1 * MiB:
        return [1, 2, 4], [1, 2, 4, 8], [1, 2, 4, 8, 16, 32, 64]
    if nbytes <= 16 * MiB:
        return [1, 2, 4, 8], [1, 2, 4, 8, 16], [1, 2, 4, 8, 16, 33, 66, 128]
    return [1, 2, 4, 8, 16, 32], [1, 4, 8, 16, 32], [2, 4, 8, 16, 33, 66, 128]


def candidates(collective, nbytes: int, dtype: str = "bfloat16", *, sms: int = 132,
               threads: int = 512, ranks_per_launch: int = 1, limit: int | None = None,
               strategies=None) -> list[Config]:
    """Candidate configurations for ``collective`` at ``nbytes``, within the SM budget, most
    plausible first, strategies interleaved; at most ``limit`` per strategy.

    >>> from purlin.spec import collectives
    >>> [c for c in candidates(collectives.all_reduce(2), 8 << 10, sms=132, limit=1)
    ...  if c.strategy == "direct-push"]  # doctest: +NORMALIZE_WHITESPACE
    [direct-push c1 l1 b8 fused-ll pdl, direct-push c1 l1 b8 fused-ll,
     direct-push c1 l1 b4 fused-ll pdl, direct-push c1 l1 b16 fused-ll pdl,
     direct-push c1 l1 b4 fused pdl, direct-push c1 l1 b8 fused pdl,
     direct-push c1 l1 b1 ll pdl, direct-push c1 l1 b1 ll, direct-push c2 l2 b1 ll pdl,
     direct-push c2 l2 b1 ll, direct-push c4 l4 b1 ll pdl, direct-push c4 l4 b1 ll,
     direct-push c1 l1 b1, direct-push c1 l1 b1 pdl]
    """
    from purlin.runtime.auto import rules, strategies_for
    from purlin.spec.sizing import fit_nbytes

    sizing = collective.sized(nbytes=fit_nbytes(collective, nbytes, dtype), dtype=dtype)
    size = sizing.message_bytes
    budget = sm_budget(sms, threads, ranks_per_launch)
    # ~16 KiB of message per block: where the measured optimum sat on 2 x H200 (all-reduce
    # 64 KiB: 8 blocks, 1 MiB: 64, >= 16 MiB: every SM)
    target_blocks = min(budget, max(1, size // (16 * KiB)))
    per_strategy = []
    for strategy in strategies or strategies_for(collective):
        rule = rules(collective, size, strategy)
        chunk_opts, lane_opts, bpl_opts = _grid(size, budget)
        lane_opts, bpl_opts = lane_opts + [1], bpl_opts + [1]  # something fits a small budget
        found = {}
        for chunks in sorted(set(chunk_opts) | {rule.chunks}):
            n_pieces = pieces(sizing, strategy, chunks)
            for lanes in sorted(set(lane_opts) | {rule.lanes}):
                if lanes > max(1, n_pieces):
                    continue
                for bpl in sorted(set(bpl_opts) | {_default_bpl(size, lanes, sms)}):
                    blocks = lanes * bpl
                    if blocks > budget or (blocks > 1 and size // blocks < 2 * KiB):
                        continue
                    score = (abs(math.log2(blocks / target_blocks))
                             + 0.5 * abs(math.log2(chunks / rule.chunks))
                             + 0.25 * abs(math.log2(lanes / rule.lanes)))
                    found[Config(strategy, chunks, lanes, bpl)] = score
        # the rule of thumb with the datapath's default blocks goes first when it fits
        first = Config(strategy, rule.chunks, rule.lanes, _default_bpl(size, rule.lanes, sms))
        if first in found:
            found[first] = -1.0
        ranked = _diverse(sorted(found, key=lambda c: (found[c], c.blocks, c.chunks)))
        ranked = ranked[:limit] if limit else ranked
        per_strategy.append(_fused_configs(sizing, strategy, sms, budget, ranks_per_launch)
                            + _ll_configs(sizing, strategy, lane_opts, sms)
                            + _with_pdl(ranked, size))
    out = []
    for k in range(max((len(r) for r in per_strategy), default=0)):
        out += [r[k] for r in per_strategy if k < len(r)]
    return out


def _with_pdl(configs: list[Config], size: int) -> list[Config]:
    """Each configuration, followed by its PDL launch where that can pay (small messages)."""
    if size > PDL_MAX_BYTES:
        return configs
    return [v for c in configs for v in (c, replace(c, pdl=True))]


def _fused_budget(nbytes: int, unit: int, sms: int, budget: int,
                  ranks_per_launch: int | None) -> int:
    """The blocks per rank a fused launch of ``nbytes`` in ``unit``-byte items may take:
    within the residency of the fused kernel's own threads (``atom.fused.grid``: 128 or 256
    for small messages), not the interpreter's 512 that ``budget`` counts -- on 8 virtual
    ranks of 132 SMs 33 blocks of 256 threads fit per rank where 16 of 512 do.

    >>> _fused_budget(64 << 10, 8, 132, 16, 8), _fused_budget(64 << 10, 8, 132, 16, None)
    (33, 16)
    """
    from purlin.atom.fused import grid

    if ranks_per_launch is None:
        return budget
    threads = grid(max(1, nbytes // unit), sms=sms, unit=unit)[1]
    return max(budget, sm_budget(sms, threads, ranks_per_launch))


def _fused_configs(sizing, strategy: str, sms: int, budget: int,
                   ranks_per_launch: int | None = None) -> list[Config]:
    """Fused-kernel candidates up to FUSED_MAX_BYTES, one lane each: with LL transfers for
    direct-push up to LL_MAX_BYTES, and with flags (a slot per block) for every strategy, at
    the kernel's default blocks per rank (with PDL up to PDL_MAX_BYTES) and twice as many;
    direct-push also with half as many, and two chunks where the strategy relays. Larger:
    two-phase with 1, 2, 4 and 8 chunks pipelined through its one lane (the 256 MiB all-reduce's
    best on 2 x H200, 345.6 GB/s with 4 chunks, in the run that added them)."""
    from purlin.atom.fused import grid

    size = sizing.message_bytes
    budget, ll_budget = (_fused_budget(size, unit, sms, budget, ranks_per_launch)
                         for unit in (16, 8))
    blocks = min(budget, grid(max(1, size // 16), sms=sms)[0])
    if size > FUSED_MAX_BYTES:
        if strategy != "two-phase":
            return []
        return [Config(strategy, c, 1, blocks, "fused") for c in (1, 2, 4, 8)
                if c == 1 or pieces(sizing, strategy, c) > pieces(sizing, strategy, 1)]
    more = min(budget, 2 * blocks)
    pdl = size <= PDL_MAX_BYTES
    out = []
    if strategy == "direct-push" and size <= LL_MAX_BYTES:
        units = min(ll_budget, grid(max(1, size // 8), sms=sms, unit=8)[0])  # 8-byte LL units
        out += [Config(strategy, 1, 1, units, "fused-ll", True),
                Config(strategy, 1, 1, units, "fused-ll")]
        out += [Config(strategy, 1, 1, b, "fused-ll", True)
                for b in sorted({max(1, units // 2), min(ll_budget, 2 * units)} - {units})]
    out.append(Config(strategy, 1, 1, blocks, "fused", pdl))
    if more != blocks:
        out.append(Config(strategy, 1, 1, more, "fused", pdl))
    if strategy in ("two-phase", "ring") and pieces(sizing, strategy, 2) > 1:
        out.append(Config(strategy, 2, 1, blocks, "fused", pdl))
    return out


def _ll_configs(sizing, strategy: str, lane_opts, sms: int) -> list[Config]:
    """LL candidates (PDL first), for direct-push up to LL_MAX_BYTES, the strategy whose
    Stage+Notify pairs the lowering can turn into LL transfers: one block per lane, and the
    datapath's default blocks (about 16 KiB of message per block) where that is more."""
    size = sizing.message_bytes
    if strategy != "direct-push" or size > LL_MAX_BYTES:
        return []
    out = []
    for lanes in sorted(set(lane_opts)):
        chunks = lanes  # a piece per lane
        if lanes > max(1, pieces(sizing, strategy, chunks)) or size // lanes < 2 * KiB \
                and lanes > 1:
            continue
        for bpl in sorted({1, _default_bpl(size, lanes, sms)}):
            out += [Config(strategy, chunks, lanes, bpl, "ll", True),
                    Config(strategy, chunks, lanes, bpl, "ll")]
    return out[:6]


def _diverse(ranked: list[Config], per_blocks: int = 2) -> list[Config]:
    """The same candidates, at most ``per_blocks`` of each total block count first, so a
    short list still spans a few grid sizes."""
    seen: dict[int, int] = {}
    first, rest = [], []
    for c in ranked:
        seen[c.blocks] = seen.get(c.blocks, 0) + 1
        (first if seen[c.blocks] <= per_blocks else rest).append(c)
    return first + rest


def _default_bpl(size: int, lanes: int, sms: int) -> int:
    """The sm datapath's own default (about 16 KiB of message per block)."""
    from purlin.atom.sm import default_blocks_per_lane

    return default_blocks_per_lane(size, lanes, sms)


@dataclass
class TuneResult:
    """The tuning table and every timed candidate (as sweep Results)."""

    table: object
    results: Results

    def save(self, path=None):
        return self.table.save(path)


def tune(cluster, collectives, sizes, dtype: str = "bfloat16", *, limit: int | None = 8,
         threads: int = 512, ops: int = 20, repeats: int = 5, time_limit: float | None = None,
         progress: bool = True, table=None, log=None) -> TuneResult:
    """Time the candidates of every collective (names or Collectives) at every size on
    ``cluster`` (CUDA-graph replays), keep the fastest with no wrong element, and return the
    tuning table (merged into ``table`` when given) with all the timed candidates. With
    ``time_limit`` (seconds) each point gets an equal share of what is left; a point always
    times the first candidate of every strategy."""
    import torch

    from purlin.bench.providers import time_purlin
    from purlin.bench.sweep import Sweep
    from purlin.runtime.auto import TuningTable

    if cluster.kind == "cpu":
        raise CapabilityError("purlin tune measures the sm datapath and needs GPUs; none is "
                              "visible here (see `purlin tune --list` for the candidates)")
    dev = cluster.devices[0]
    props = torch.cuda.get_device_properties(dev)
    sms, gpu = props.multi_processor_count, torch.cuda.get_device_name(dev)
    per_launch = cluster.nranks if cluster.kind == "virtual" else 1
    colls = Sweep(collectives=list(collectives), nranks=cluster.nranks, datapath="sm",
                  providers=["purlin:auto"]).built()
    info = environment("sm", cluster.nranks)
    info.update(dtype=dtype, threads=threads, sms=sms, kind=cluster.kind)
    out = TuningTable(gpu, {}, {"date": info["date"], "commit": info["commit"],
                                "torch": info.get("torch"), "gpus": info.get("gpus"),
                                "measured": "CUDA-graph replay, device time per op"})
    work = [(c, s) for c in colls for s in sizes]
    cands = {(c.name, s): candidates(c, s, dtype, sms=sms, threads=threads,
                                     ranks_per_launch=per_launch, limit=limit)
             for c, s in work}
    bar = Progress(sum(len(v) for v in cands.values()), progress, "purlin tune")
    t0, records = time.monotonic(), []
    try:
        for k, (coll, size) in enumerate(work):
            todo = cands[(coll.name, size)]
            left = None if time_limit is None else time_limit - (time.monotonic() - t0)
            share = None if left is None else max(0.0, left) / (len(work) - k)
            start, nstrat = time.monotonic(), len({c.strategy for c in todo})
            timed = []
            for i, cfg in enumerate(todo):
                if share is not None and i >= nstrat and time.monotonic() - start > share:
                    bar.update(len(todo) - i)
                    break
                rec = _time(time_purlin, cluster, coll, size, dtype, cfg, threads, ops,
                            repeats)
                records.append(rec)
                timed.append((cfg, rec))
                bar.update(1, f"{coll.name} {size} B {cfg}")
                torch.cuda.empty_cache()
            entry = best_entry(coll.name, timed, dtype, threads)
            if entry is not None:
                out.add(cluster.nranks, entry, virtual=cluster.kind == "virtual")
                if log is not None:
                    print(f"{coll.name:>15} {entry['nbytes']:>11} B  {entry['strategy']:>11} "
                          f"c{entry['chunks']} l{entry['lanes']} b{entry['blocks_per_lane']}"
                          f"{launch_suffix(entry.get('protocol', 'simple'), entry.get('pdl'))}  "
                          f"{entry['time_us']:9.2f} us  ({len(timed)} timed)", file=log,
                          flush=True)
    finally:
        bar.close()
    info["seconds"] = round(time.monotonic() - t0, 1)
    if table is not None:
        out = TuningTable.load(table).merge(out) if not isinstance(table, TuningTable) \
            else table.merge(out)
    return TuneResult(out, Results(records, info))


def _time(time_purlin, cluster, coll, size, dtype, cfg: Config, threads, ops, repeats):
    try:
        return time_purlin(cluster, coll, size, dtype, cfg.strategy, cfg.chunks, cfg.lanes,
                           cfg.blocks_per_lane, mode="graph", ops=ops,
                           threads=None if is_fused(cfg.protocol) else threads,
                           repeats=repeats, provider=f"purlin:{cfg.strategy}",
                           protocol=cfg.protocol, pdl=cfg.pdl)
    except Exception as exc:  # a candidate that cannot bind or times out is no candidate
        nan = float("nan")
        return Record.make(f"purlin:{cfg.strategy}", coll.name, coll.nranks, size, 0, dtype,
                           coll.op.reduce_op or "none", "graph", Timing(nan, nan, nan, 0), -1,
                           strategy=cfg.strategy, chunks=cfg.chunks, lanes=cfg.lanes,
                           blocks_per_lane=cfg.blocks_per_lane,
                           error=f"{type(exc).__name__}: {exc}")


def best_entry(collective: str, timed, dtype: str, threads: int = 512) -> dict | None:
    """The table entry for one point: the fastest correct candidate, and the best of every
    strategy under ``per_strategy`` (so ``purlin:<strategy>`` finds its own best)."""
    good = [(cfg, r) for cfg, r in timed if r.ok and r.wrong == 0]
    if not good:
        return None
    per = {}
    for cfg, r in good:
        if cfg.strategy not in per or r.time_us < per[cfg.strategy][1].time_us:
            per[cfg.strategy] = (cfg, r)
    cfg, r = min(per.values(), key=lambda p: p[1].time_us)
    return {"collective": collective, "nbytes": r.nbytes, "dtype": dtype,
            "strategy": cfg.strategy, **_launch(cfg),
            "threads": r.extra.get("threads") or threads,
            "time_us": round(r.time_us, 3), "busbw_gbs": round(r.busbw_gbs, 2),
            "timed": len(timed),
            "per_strategy": {s: {**_launch(c), "time_us": round(rr.time_us, 3)}
                             for s, (c, rr) in per.items()}}


def _launch(cfg: Config) -> dict:
    """A table entry's configuration fields (protocol and pdl only where not the default)."""
    return {"chunks": cfg.chunks, "lanes": cfg.lanes, **cfg.bind_options()}
