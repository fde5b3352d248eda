"""The tuner's candidate generator (SM budget, useful lanes, plausibility order) and how it
keeps the fastest correct candidate."""

import math

import pytest

from purlin.bench.metrics import Record, Timing
from purlin.bench.tune import (Config, _fused_budget, best_entry, candidates, pieces, sm_budget,
                               tune)
from purlin.errors import CapabilityError
from purlin.runtime import Cluster
from purlin.spec import collectives
from purlin.spec.sizing import fit_nbytes

KiB, MiB = 1 << 10, 1 << 20
COLLS = [collectives.all_reduce(2), collectives.all_gather(2), collectives.reduce_scatter(2),
         collectives.all_to_all(2), collectives.broadcast(2), collectives.reduce(2),
         collectives.all_reduce(8)]


@pytest.mark.parametrize("sms, threads, per_launch", [(132, 512, 1), (16, 512, 1),
                                                     (132, 256, 1), (132, 512, 4), (8, 512, 2)])
@pytest.mark.parametrize("nbytes", [8, 64 * KiB, 4 * MiB, 256 * MiB])
def test_candidates_stay_within_the_sm_budget(sms, threads, per_launch, nbytes):
    budget = sm_budget(sms, threads, per_launch)
    assert budget == max(1, sms * max(1, 65536 // (threads * 128)) // per_launch)
    for coll in COLLS:
        cands = candidates(coll, nbytes, sms=sms, threads=threads, ranks_per_launch=per_launch)
        assert cands, (coll.name, nbytes)
        size = coll.sized(nbytes=fit_nbytes(coll, nbytes, "bfloat16"),
                          dtype="bfloat16").message_bytes
        for c in cands:  # the fused kernel's within what fits at its own threads
            most = _fused_budget(size, 8 if c.protocol == "fused-ll" else 16, sms, budget,
                                 per_launch) if c.protocol.startswith("fused") else budget
            assert c.lanes * c.blocks_per_lane <= most, c
        assert len(set(cands)) == len(cands)


def test_fused_candidates_on_eight_virtual_ranks_reach_the_binds_launch():
    """On 8 virtual ranks of 132 SMs 512-thread blocks fit 16 per rank, the fused kernel's
    256-thread ones 33: the 64 KiB all-reduce's LL candidates include the 32 blocks its bind
    sizes itself (the table tuned before capped them at 16, 1.35x slower)."""
    cands = candidates(collectives.all_reduce(8), 64 * KiB, sms=132, ranks_per_launch=8)
    ll = {c.blocks_per_lane for c in cands if c.protocol == "fused-ll"}
    assert 32 in ll and max(ll) <= 33, ll


def test_candidates_give_every_lane_work_and_skip_two_phase_for_copies():
    for coll in COLLS:
        for nbytes in (64 * KiB, 16 * MiB):
            sizing = coll.sized(nbytes=fit_nbytes(coll, nbytes, "bfloat16"), dtype="bfloat16")
            for c in candidates(coll, nbytes):
                assert c.lanes <= max(1, pieces(sizing, c.strategy, c.chunks))
                assert c.strategy != "two-phase" or coll.op.is_reduce


def test_candidates_are_ordered_and_limited_per_strategy():
    cands = candidates(collectives.all_reduce(2), 64 * MiB, limit=3)
    strategies = [c.strategy for c in cands]
    assert strategies[:4] == ["direct-push", "direct-pull", "two-phase", "ring"]
    interpreted = [c.strategy for c in cands if not c.protocol.startswith("fused")]
    assert all(interpreted.count(s) == 3 for s in set(strategies))
    # above FUSED_MAX_BYTES the fused kernel runs two-phase only, chunks pipelined in its lane
    assert [c for c in cands if c.protocol == "fused"] == [
        Config("two-phase", k, 1, 132, "fused") for k in (1, 2, 4, 8)]
    small = candidates(collectives.all_reduce(2), 8 * KiB)
    assert small[0] == Config("direct-push", 1, 1, 8, "fused-ll", True)  # fused LL + PDL first
    pushes = [c for c in small if c.strategy == "direct-push"]
    assert pushes[4] == Config("direct-push", 1, 1, 4, "fused", True)  # then fused flags
    assert pushes[6] == Config("direct-push", 1, 1, 1, "ll", True)  # then the interpreter's LL
    simple = [c for c in small if c.protocol == "simple" and c.strategy == "direct-push"]
    assert simple[0] == Config("direct-push", 1, 1, 1)  # then the rule of thumb
    assert simple[1] == Config("direct-push", 1, 1, 1, pdl=True)  # each also with PDL


def test_launch_variants_only_where_they_can_pay():
    ar = collectives.all_reduce(2)
    for c in candidates(ar, 8 * KiB) + candidates(ar, 256 * KiB):
        assert c.protocol in ("simple", "fused") or c.strategy == "direct-push"
        assert not c.protocol.startswith("fused") or c.lanes == 1
    ll64 = {c.blocks_per_lane for c in candidates(ar, 64 * KiB) if c.protocol == "ll"}
    assert ll64 == {1, 4}  # one block, and the default ~16 KiB per block
    assert not any(c.protocol == "ll" for c in candidates(ar, 1 * MiB))
    assert any(c.pdl for c in candidates(ar, 1 * MiB))
    assert not any(c.pdl or c.protocol == "ll" for c in candidates(ar, 16 * MiB))
    assert Config("direct-push", 1, 1, 1, "ll", True).bind_options() == {
        "blocks_per_lane": 1, "protocol": "ll", "pdl": True}
    big = candidates(collectives.all_reduce(2), 256 * MiB)[:8]
    assert min(c.blocks for c in big) >= 32  # big messages start with many blocks
    assert len({c.blocks for c in candidates(collectives.all_reduce(2), 64 * MiB,
                                             limit=6)}) > 1


def _rec(us, wrong=0, nbytes=1 << 20):
    return Record.make("purlin:x", "all-reduce", 2, nbytes, nbytes // 2, "bfloat16", "sum",
                       "graph", Timing(us, us, us, 3), wrong)


def test_best_entry_keeps_the_fastest_correct_candidate():
    nan = float("nan")
    timed = [(Config("direct-push", 1, 1, 4), _rec(30.0)),
             (Config("two-phase", 2, 4, 8), _rec(10.0, wrong=5)),  # fast but wrong
             (Config("two-phase", 1, 2, 4), _rec(20.0)),
             (Config("ring", 2, 2, 2), _rec(nan))]                 # failed
    timed[3][1].extra["error"] = "PurlinTimeoutError: ..."
    e = best_entry("all-reduce", timed, "bfloat16")
    assert (e["strategy"], e["chunks"], e["lanes"], e["blocks_per_lane"]) == ("two-phase", 1, 2,
                                                                              4)
    assert set(e["per_strategy"]) == {"direct-push", "two-phase"}
    assert e["per_strategy"]["direct-push"]["time_us"] == 30.0 and e["timed"] == 4
    assert best_entry("all-reduce", timed[1:2], "bfloat16") is None
    assert not math.isnan(e["time_us"])


def test_tune_needs_gpus():
    with pytest.raises(CapabilityError, match="needs GPUs"):
        tune(Cluster.cpu(2), ["all-reduce"], [1024])


def test_best_entry_records_ll_and_pdl_for_auto():
    timed = [(Config("direct-push", 1, 1, 1, "ll", True), _rec(6.3, nbytes=8 * KiB)),
             (Config("direct-push", 1, 1, 1), _rec(7.6, nbytes=8 * KiB)),
             (Config("ring", 1, 1, 1, pdl=True), _rec(8.0, nbytes=8 * KiB))]
    e = best_entry("all-reduce", timed, "bfloat16")
    assert (e["protocol"], e["pdl"], e["blocks_per_lane"]) == ("ll", True, 1)
    assert e["per_strategy"]["ring"] == {"chunks": 1, "lanes": 1, "blocks_per_lane": 1,
                                         "pdl": True, "time_us": 8.0}
    from purlin.runtime.auto import TuningTable

    table = TuningTable("NVIDIA H200", {2: [e]})
    choice = table.lookup("all-reduce", 2, 8 * KiB)
    assert (choice.protocol, choice.pdl) == ("ll", True)
    assert table.lookup("all-reduce", 2, 8 * KiB, strategy="ring").pdl
