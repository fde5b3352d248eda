"""The cost model reproduces hand-computed times; links are shared fairly; profiles and
calibration round-trip."""

import json
import math

import pytest

from purlin.errors import SpecError
from purlin.snac import plan
from purlin.snac.ir import Region, Schedule, Stage
from purlin.spec import collectives
from purlin.trace import PROFILES, Profile, calibrate, get_profile, predict, predict_latency

BETA = 1e9  # 1 byte per ns keeps the arithmetic readable
ALPHA = 1000.0
BARE = Profile("bare", link_bandwidth=BETA, alpha_ns=ALPHA)  # HBM free, no overheads


@pytest.mark.parametrize("n", [2, 4, 8])
def test_ring_all_gather_is_n_minus_1_hops_of_alpha_plus_a_chunk(n):
    m = 4 * 1024 * n  # bytes of the whole output; one chunk is m / n
    s = plan(collectives.all_gather(n), "ring", nbytes=m, dtype="float32")
    assert predict(s, BARE).end_ns == pytest.approx((n - 1) * (ALPHA + m / (n * BETA) * 1e9),
                                                    rel=1e-12)


def test_ring_all_gather_with_local_copies_at_hbm_bandwidth():
    # every hop also copies the chunk from scratch (or input) to the output locally: read and
    # write through HBM, 2 m/n bytes; n such copies lie on each rank's path
    n, m, hbm = 4, 1 << 20, 4e9
    s = plan(collectives.all_gather(n), "ring", nbytes=m, dtype="float32")
    p = BARE.replace(hbm_bandwidth=hbm)
    chunk = m / n
    want = (n - 1) * (ALPHA + chunk / BETA * 1e9) + n * (2 * chunk / hbm * 1e9)
    assert predict(s, p).end_ns == pytest.approx(want, rel=1e-12)


def test_launch_and_step_costs_add_up_on_a_one_hop_schedule():
    # broadcast 0 -> 1 of 1000 B. Rank 0: consume (its only wait is on an earlier call: issue
    # 10 ns, push 1000 ns), notify (10). Rank 1: wait until the notify + alpha, copy (HBM free),
    # notify (10). Everything starts after the 500 ns launch.
    s = plan(collectives.broadcast(2), "direct-push", count=250, dtype="float32")
    t = predict(s, BARE.replace(step_ns=10.0, launch_ns=500.0))
    push = t.where(rank=0, kind="consume").events[0]
    assert (push.start_ns, push.end_ns, push.peer, push.bytes) == (510.0, 1510.0, 1, 1000)
    notify = t.where(rank=0, kind="notify").events[0]
    assert (notify.start_ns, notify.end_ns) == (1510.0, 1520.0)
    wait = t.where(rank=1, kind="wait").events[0]
    assert (wait.start_ns, wait.end_ns) == (500.0, 1520.0 + ALPHA)
    assert t.end_ns == 1520.0 + ALPHA + 10.0


def test_two_transfers_on_one_link_share_its_bandwidth():
    # all-gather on 2 ranks, 2 chunks: with 2 lanes both chunks cross 0 -> 1 at once
    count = 2000  # output elements per rank: each input is 1000 float32, two pieces of 2000 B
    one = plan(collectives.all_gather(2), "direct-push", count=count, chunks=2, lanes=1)
    two = plan(collectives.all_gather(2), "direct-push", count=count, chunks=2, lanes=2)
    chunk_ns = 2000 / BETA * 1e9  # one piece at the link's full speed
    seq = [e for e in predict(one, BARE).where(rank=0, kind="stage") if e.peer == 1]
    par = [e for e in predict(two, BARE).where(rank=0, kind="stage") if e.peer == 1]
    assert [e.duration_ns for e in seq] == pytest.approx([chunk_ns, chunk_ns])
    assert [e.duration_ns for e in par] == pytest.approx([2 * chunk_ns, 2 * chunk_ns])
    assert par[0].start_ns == par[1].start_ns == 0.0


def _stages(pairs, nbytes=1000, nranks=5) -> Schedule:
    """A schedule of bare Stage steps: rank a pushes ``nbytes`` to rank b, one lane each."""
    steps = [[] for _ in range(nranks)]
    for a, b in pairs:
        lane = len(steps[a])
        steps[a].append(Stage(a, lane, "copy", (Region(a, "input", 0, nbytes // 4),),
                              Region(b, "scratch", 0, nbytes // 4)))
    return Schedule(collective=collectives.all_gather(nranks), dtype="int32", chunk_counts=(),
                    strategy="hand-made", chunks=1, lanes=2,
                    steps=tuple(tuple(s) for s in steps), scratch=(0,) * nranks)


def test_fair_sharing_is_max_min_over_send_and_receive_ports():
    # 0->1 and 0->2 share rank 0's send port; 0->2, 3->2, 4->2 share rank 2's receive port.
    # Rank 2's port gives each of its three a third; 0->1 takes the rest of 0's port (2/3),
    # finishes at 1.5 us; the others are still capped at a third by port 2 and end at 3 us.
    s = _stages([(0, 1), (0, 2), (3, 2), (4, 2)])
    ends = {(e.rank, e.peer): e.end_ns for e in predict(s, BARE)}
    assert ends[(0, 1)] == pytest.approx(1500.0)
    assert ends[(0, 2)] == ends[(3, 2)] == ends[(4, 2)] == pytest.approx(3000.0)


def test_mesh_topology_gives_every_pair_its_own_link():
    s = _stages([(0, 1), (0, 2), (3, 2)])
    switch = {(e.rank, e.peer): e.end_ns for e in predict(s, BARE)}
    mesh = {(e.rank, e.peer): e.end_ns for e in predict(s, BARE.replace(topology="mesh"))}
    assert mesh == {k: pytest.approx(1000.0) for k in mesh}
    assert switch[(0, 1)] == pytest.approx(2000.0)


def test_bandwidth_is_redivided_when_a_transfer_ends():
    # 0->1 of 1000 B and 0->1 of 3000 B: both at half speed until the short one ends at
    # 2 us, then the long one alone: 3000 - 1000 = 2000 B at full speed -> ends at 4 us
    s = _stages([(0, 1), (0, 1)])
    steps = list(s.steps)
    long = Stage(0, 1, "copy", (Region(0, "input", 0, 750),), Region(1, "scratch", 0, 750))
    steps[0] = (steps[0][0], long)
    s = Schedule(**{**s.__dict__, "steps": tuple(steps)})
    ends = sorted(e.end_ns for e in predict(s, BARE))
    assert ends == pytest.approx([2000.0, 4000.0])


def test_h200_measured_profile_reproduces_the_measured_small_all_reduce():
    # ARCHITECTURE.md, "GPU facts": naive one-shot all-reduce of 8 KiB bf16 on 2xH200, 4.5 us per op
    s = plan(collectives.all_reduce(2), "direct-push", nbytes=8192, dtype="bfloat16")
    assert predict_latency(s, "H200-measured") == pytest.approx(4500, rel=0.05)


def test_profiles_name_their_source_and_round_trip(tmp_path):
    assert set(PROFILES) >= {"A100", "H100", "H200", "B200", "PCIe-Gen5", "H200-measured"}
    assert PROFILES["A100"].link_bandwidth == 300e9
    assert PROFILES["H100"].hbm_bandwidth == 3.35e12 and PROFILES["H200"].hbm_bandwidth == 4.8e12
    assert PROFILES["B200"].link_bandwidth == 900e9 and PROFILES["B200"].hbm_bandwidth == 8e12
    assert PROFILES["PCIe-Gen5"].link_bandwidth == 64e9
    assert PROFILES["H200-measured"].link_bandwidth == 390e9
    for p in PROFILES.values():
        assert "datasheet" in p.source or "measured" in p.source
        assert Profile.from_json(json.loads(json.dumps(p.to_json()))) == p
    path = BARE.save(tmp_path / "bare.json")
    assert Profile.load(path) == BARE and math.isinf(Profile.load(path).hbm_bandwidth)
    assert get_profile(str(path)) == BARE and get_profile("H100") is PROFILES["H100"]


def test_virtual_ranks_share_one_gpus_memory():
    """On the "gpu" topology every step's bytes read and written go through one memory that
    all ranks share: a direct-pull all-gather moves each chunk once (read + write), a
    direct-push one twice (into the peer's scratch, then out of it), as a ring does hop by
    hop: pull wins at 16 MiB."""
    from purlin.snac import plan
    from purlin.spec import collectives

    p = PROFILES["H200-virtual"]
    assert p.topology == "gpu" and math.isinf(p.link_bandwidth)
    ag = collectives.all_gather(4)
    t = {s: predict(plan(ag, s, nbytes=16 << 20, dtype="bfloat16"), p).end_ns
         for s in ("direct-push", "direct-pull", "ring")}
    assert t["direct-pull"] < 0.7 * min(t["ring"], t["direct-push"]), t
    moved = 2 * 3 * (4 << 20)  # each rank reads and writes 3 peers' 4 MiB chunks
    assert t["direct-pull"] >= 4 * moved / p.hbm_bandwidth * 1e9  # four ranks share it


def test_the_virtual_profile_ranks_strategies_as_the_virtual_tuning_table_measured():
    """Over every entry of the H200 virtual-rank tuning table (4 and 8 ranks, six collectives,
    8 KiB to 16 MiB), the strategy H200-virtual predicts fastest (one lane, the rules' chunks,
    as ``auto``'s fast path plans it) measured within 1.02x of the fastest strategy in
    geomean, and never past 1.15x -- but at the 8-rank 1 MiB reduce-scatter, where the table
    measured direct-pull 1.19x faster than the direct-push the model ranks first (the model
    prices the plan's steps, a wait, copy and notify per peer; the fused kernel polls a
    pull's waits at once)."""
    from pathlib import Path

    from purlin.runtime.auto import rules

    table = json.loads((Path(__file__).resolve().parents[1] / "purlin" / "runtime" / "tuning"
                        / "nvidia-h200.json").read_text())
    regrets = []
    for n, rows in table["virtual_nranks"].items():
        for e in rows:
            coll = getattr(collectives, e["collective"].replace("-", "_"))(int(n))
            sizing = coll.sized(nbytes=e["nbytes"], dtype="bfloat16")
            times = {s: c["time_us"] for s, c in e["per_strategy"].items()}
            pred = {}
            for s in times:
                chunks = rules(coll, sizing.message_bytes, s).chunks if s == "two-phase" else 1
                pred[s] = predict_latency(plan(coll, s, sizing=sizing, chunks=chunks,
                                               check=False), "H200-virtual")
            regrets.append(((n, e["collective"], e["nbytes"]),
                            times[min(pred, key=pred.get)] / min(times.values())))
    assert len(regrets) == 48
    assert math.exp(sum(math.log(r) for _, r in regrets) / len(regrets)) <= 1.02
    past = {at: round(r, 2) for at, r in regrets if r > 1.15}
    assert past == {("8", "reduce-scatter", 1 << 20): 1.19}, past


def test_bad_profiles_are_refused():
    with pytest.raises(SpecError, match="unknown hardware profile 'Z100'"):
        get_profile("Z100")
    with pytest.raises(SpecError, match="link_bandwidth must be > 0"):
        Profile("x", link_bandwidth=0, alpha_ns=1.0)
    with pytest.raises(SpecError, match="topology"):
        Profile("x", link_bandwidth=1.0, alpha_ns=1.0, topology="torus")


SIZES = (1024, 64 * 1024, 1 << 20, 16 << 20)


def _runs():
    return [plan(collectives.all_reduce(4), strategy, nbytes=b, dtype="bfloat16")
            for b in SIZES for strategy in ("ring", "direct-push")]


def test_calibrate_recovers_alpha_and_beta_from_pairs(tmp_path):
    truth = PROFILES["H200"].replace(alpha_ns=2700.0, link_bandwidth=333e9)
    runs = _runs()
    fitted = calibrate([(s, predict_latency(s, truth)) for s in runs], base="H200",
                       path=tmp_path / "fit.json")
    assert fitted.alpha_ns == pytest.approx(2700.0, rel=1e-6)
    assert fitted.link_bandwidth == pytest.approx(333e9, rel=1e-6)
    assert Profile.load(tmp_path / "fit.json") == fitted
    assert "fitted to 8 measurement(s)" in fitted.source


def test_calibrate_with_a_callable_and_a_launch_cost():
    truth = BARE.replace(alpha_ns=2200.0, link_bandwidth=380e9, launch_ns=1800.0)
    measure = lambda s: predict_latency(s, truth) * 1.0  # noqa: E731  (stands in for a GPU run)
    fitted = calibrate(measure, _runs(), base=BARE, fit=("alpha_ns", "link_bandwidth",
                                                         "launch_ns"))
    assert fitted.alpha_ns == pytest.approx(2200.0, rel=1e-6)
    assert fitted.link_bandwidth == pytest.approx(380e9, rel=1e-6)
    assert fitted.launch_ns == pytest.approx(1800.0, rel=1e-6)


def test_calibrate_keeps_parameters_non_negative_on_noisy_data():
    runs = _runs()
    # a machine that is "faster than free" on small messages: the fit must clamp alpha at 0
    data = [(s, max(1.0, predict_latency(s, BARE.replace(alpha_ns=0.0)) - 500)) for s in runs]
    fitted = calibrate(data, base=BARE)
    assert fitted.alpha_ns >= 0 and fitted.link_bandwidth > 0
    with pytest.raises(SpecError, match="calibrate fits"):
        calibrate(data, base=BARE, fit=("gamma",))
    with pytest.raises(SpecError, match="give the schedules"):
        calibrate(lambda s: 1.0)
