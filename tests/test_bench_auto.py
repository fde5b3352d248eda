"""strategy="auto": the tuning table wins (by GPU name and rank count, nearest size), the cost
model decides on unknown GPUs, the rules on the cpu datapath; blocks per lane reach sm.bind."""

import json
from types import SimpleNamespace

import pytest

from purlin.errors import SpecError
from purlin.runtime import Cluster
from purlin.runtime import auto
from purlin.runtime.auto import Choice, TuningTable, choose, select, slug, tuning_path
from purlin.spec import collectives

KiB, MiB = 1 << 10, 1 << 20


def _entry(collective, nbytes, strategy, chunks, lanes, bpl, **more):
    return {"collective": collective, "nbytes": nbytes, "dtype": "bfloat16",
            "strategy": strategy, "chunks": chunks, "lanes": lanes, "blocks_per_lane": bpl,
            "time_us": 1.0, **more}


@pytest.fixture
def table():
    return TuningTable("NVIDIA H200", {2: [
        _entry("all-reduce", 8 * KiB, "direct-push", 1, 1, 2),
        _entry("all-reduce", 16 * MiB, "two-phase", 4, 8, 8,
               per_strategy={"ring": {"chunks": 8, "lanes": 16, "blocks_per_lane": 4}}),
        _entry("all-gather", 1 * MiB, "ring", 2, 4, 4),
    ], 4: [_entry("all-reduce", 8 * KiB, "ring", 1, 2, 1)]})


@pytest.fixture(autouse=True)
def no_env(monkeypatch):
    monkeypatch.delenv("PURLIN_TUNING", raising=False)


def test_nearest_size_by_ratio_and_rank_count(table):
    ar2, ar4 = collectives.all_reduce(2), collectives.all_reduce(4)
    cpu2, cpu4 = Cluster.cpu(2), Cluster.cpu(4)
    assert select(ar2, cpu2, nbytes=256 * KiB, table=table).strategy == "direct-push"
    big = select(ar2, cpu2, nbytes=1 * MiB, table=table)  # 1 MiB: 16x from 16 MiB, 128x
    assert (big.strategy, big.chunks, big.lanes, big.blocks_per_lane) == ("two-phase", 4, 8, 8)
    assert big.source == f"table NVIDIA H200 @ {16 * MiB} B"
    assert select(ar4, cpu4, nbytes=1 * MiB, table=table).strategy == "ring"


def test_a_fixed_strategy_takes_its_own_best_configuration(table):
    c = select(collectives.all_reduce(2), Cluster.cpu(2), nbytes=64 * MiB, table=table,
               strategy="ring")
    assert (c.strategy, c.chunks, c.lanes, c.blocks_per_lane) == ("ring", 8, 16, 4)
    # a strategy the table never measured: the rules give its chunks and lanes
    c = select(collectives.all_reduce(2), Cluster.cpu(2), nbytes=64 * MiB, table=table,
               strategy="direct-pull")
    assert c.strategy == "direct-pull" and c.source == "rules"


def test_unknown_collective_or_ranks_fall_back(table):
    c = select(collectives.broadcast(2), Cluster.cpu(2), nbytes=1 * MiB, table=table)
    assert c.source == "rules"
    c = select(collectives.all_gather(8), Cluster.cpu(8), nbytes=1 * MiB, table=table)
    assert c.source == "rules"


def test_table_from_a_file_argument_and_from_purlin_tuning(table, tmp_path, monkeypatch):
    path = table.save(tmp_path / "h200.json")
    assert TuningTable.load(path).entries == table.entries
    c = select(collectives.all_gather(2), Cluster.cpu(2), nbytes=2 * MiB, table=path)
    assert (c.strategy, c.blocks_per_lane) == ("ring", 4)
    monkeypatch.setenv("PURLIN_TUNING", str(path))
    assert choose(collectives.all_gather(2), Cluster.cpu(2), nbytes=2 * MiB) == ("ring", 2, 4)


def test_table_found_by_gpu_name_in_a_folder(table, tmp_path, monkeypatch):
    monkeypatch.setenv("PURLIN_TUNING", str(tmp_path))
    assert tuning_path("NVIDIA H200") == tmp_path / "nvidia-h200.json"
    table.save()  # where tuning_path says
    c = select(collectives.all_reduce(2), Cluster.cpu(2), nbytes=8 * KiB, gpu="NVIDIA H200")
    assert c.source.startswith("table") and c.blocks_per_lane == 2
    other = select(collectives.all_reduce(2), Cluster.cpu(2), nbytes=8 * KiB, gpu="NVIDIA B200")
    assert other.source == "rules"
    assert slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert auto.TUNING_DIR.name == "tuning"


def test_model_decides_on_gpus_without_a_table():
    """Without a table: the fused kernel (one lane) with the model's strategy."""
    class Gpus:  # what select needs of a cluster: its datapath (and devices for the name)
        datapath, devices = "sm", ()

    small = select(collectives.all_reduce(2), Gpus(), nbytes=8 * KiB)
    assert small.source.startswith("fast path, model H200-measured")
    assert small.strategy == "direct-push" and small.protocol == "fused-ll"
    large = select(collectives.all_reduce(2), Gpus(), nbytes=256 * MiB)
    assert "model" in large.source and large.protocol == "fused" and large.lanes == 1
    # the cpu datapath keeps the cheap rules unless asked for the model
    assert select(collectives.all_reduce(2), Cluster.cpu(2), nbytes=8 * KiB).source == "rules"
    assert select(collectives.all_reduce(2), Cluster.cpu(2), nbytes=8 * KiB,
                  model=True).source.startswith("model")


def test_two_phase_entries_never_apply_to_copies():
    t = TuningTable("x", {2: [_entry("all-gather", 1 * MiB, "two-phase", 1, 1, 1)]})
    c = select(collectives.all_gather(2), Cluster.cpu(2), nbytes=1 * MiB, table=t)
    assert c.strategy != "two-phase"


def test_merge_replaces_equal_keys_and_keeps_the_rest(table):
    newer = TuningTable("NVIDIA H200", {2: [_entry("all-reduce", 8 * KiB, "ring", 1, 1, 1)]})
    merged = table.merge(newer)
    rows = merged.entries[2]
    assert len(rows) == 3
    assert next(r for r in rows if r["nbytes"] == 8 * KiB)["strategy"] == "ring"
    assert json.loads(json.dumps(merged.to_json()))["nranks"]["2"] == rows


def test_bad_tables_are_refused(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(SpecError, match="not valid JSON"):
        TuningTable.load(bad)
    bad.write_text(json.dumps({"entries": []}))
    with pytest.raises(SpecError, match="format-1"):
        TuningTable.load(bad)


def test_cluster_bind_passes_the_tables_blocks_per_lane_to_sm(table, monkeypatch):
    from purlin.atom import sm

    seen = {}

    def fake_bind(cluster, schedule, **options):
        seen.update(options, strategy=schedule.strategy, chunks=schedule.chunks,
                    lanes=schedule.lanes)
        return "bound"

    monkeypatch.setattr(sm, "bind", fake_bind)
    monkeypatch.setattr(auto, "gpu_name", lambda cluster: "NVIDIA H200")
    monkeypatch.setattr(auto, "find_table", lambda table_=None, gpu=None: table)
    gpus = Cluster("local", 2, (0, 1))
    assert gpus.bind(collectives.all_reduce(2), "auto", nbytes=16 * MiB,
                     dtype="bfloat16") == "bound"
    assert seen == {"timeout": 5.0, "blocks_per_lane": 8, "strategy": "two-phase",
                    "chunks": 4, "lanes": 8, "fit": True}
    seen.clear()
    gpus.bind(collectives.all_reduce(2), "auto", nbytes=16 * MiB, dtype="bfloat16",
              blocks_per_lane=2)  # given by the caller: kept
    assert seen["blocks_per_lane"] == 2


def test_choice_repr():
    text = "Choice(ring, chunks=2, lanes=4, from rules)"
    assert repr(Choice("ring", 2, 4, None, "rules")) == text


def test_auto_passes_the_tables_protocol_and_pdl_to_the_sm_bind_only():
    from purlin.runtime.cluster import _auto_options

    ll = Choice("direct-push", 1, 1, 1, "table", "ll", True)
    assert _auto_options(ll, {}, sm=True) == {"blocks_per_lane": 1, "protocol": "ll",
                                              "pdl": True, "fit": True}
    assert _auto_options(ll, {"blocks_per_lane": None}, sm=True)["protocol"] == "ll"
    # the caller's blocks per lane replace the table's LL pair; its protocol wins too
    assert _auto_options(ll, {"blocks_per_lane": 8}, sm=True) == {"blocks_per_lane": 8,
                                                                  "pdl": True}
    assert _auto_options(ll, {"protocol": "simple"}, sm=True) == {"protocol": "simple",
                                                                  "pdl": True}
    assert _auto_options(ll, {}, sm=False) == {"blocks_per_lane": 1}  # ce: blocks only
    assert "protocol='ll', pdl=True" in repr(ll)


def test_a_tables_fused_protocol_may_fall_back_to_the_interpreter():
    """A fused choice was measured at a nearby size; at a size the fused kernel cannot run
    (rows that start unaligned) the sm bind falls back instead of failing -- only for auto."""
    from purlin.runtime.cluster import _auto_options

    fused = Choice("direct-push", 1, 1, 16, "table", "fused-ll", True)
    assert _auto_options(fused, {}, sm=True) == {"blocks_per_lane": 16, "protocol": "fused-ll",
                                                 "pdl": True, "fallback": True, "fit": True}
    assert "fallback" not in _auto_options(fused, {"protocol": "ll"}, sm=True)
    assert _auto_options(fused, {}, sm=False) == {"blocks_per_lane": 16}


def test_a_tables_fused_choice_that_cannot_run_this_size_takes_the_fast_path():
    """A table measured two-phase on the fused kernel for the whole-size all-reduce: one
    element more keeps it (its parts are cut on 16-byte items); a size too small for every
    part to start aligned cannot run it fused, so auto takes a fused plan that runs (the
    table says how fast the fused kernel was, not the interpreter)."""
    from purlin.atom.fused import fused_problems
    from purlin.runtime.auto import TuningTable, select
    from purlin.snac import plan

    row = {"collective": "all-reduce", "nbytes": 16 << 20, "dtype": "bfloat16",
           "strategy": "two-phase", "chunks": 1, "lanes": 1, "blocks_per_lane": 33,
           "protocol": "fused", "time_us": 40.0}
    table = TuningTable.from_json({"format": 1, "gpu": "NVIDIA H200", "nranks": {},
                                   "virtual_nranks": {"4": [row]}})
    coll = collectives.all_reduce(4)
    cluster = SimpleNamespace(datapath="sm", kind="virtual")
    whole = select(coll, cluster, nbytes=16 << 20, dtype="bfloat16", table=table)
    assert (whole.strategy, whole.protocol) == ("two-phase", "fused")
    odd = select(coll, cluster, count=(8 << 20) + 1, dtype="bfloat16", table=table)
    assert (odd.strategy, odd.protocol) == ("two-phase", "fused")
    tiny = 29  # four parts of 8, 7, 7, 7 elements: the third starts off a 16-byte item
    small = select(coll, cluster, count=tiny, dtype="bfloat16", table=table)
    assert small.protocol.startswith("fused") and small.strategy != "two-phase"
    schedule = plan(coll, small.strategy, count=tiny, dtype="bfloat16", chunks=small.chunks)
    assert fused_problems(schedule)[small.protocol] is None
