"""``purlin plan`` and ``purlin run`` on the cpu datapath."""

import json

from purlin.cli import main, parse_size
from purlin.snac import Schedule, verify


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_prints_every_rank_and_a_passing_report(capsys):
    code, out, err = run(capsys, "plan", "all-reduce", "-n", "4", "-s", "two-phase",
                         "--bytes", "1MiB")
    assert code == 0 and err == ""
    for r in range(4):
        assert f"rank {r}: " in out and f"\nrank {r}: " in out
    assert "Stage    copy chunk" in out and "Notify   rank" in out and "Consume  wait for" in out
    assert "{'" not in out, "no raw dict in the readable summary"
    assert "outputs correct, no races, no deadlock" in out
    assert "remote hops" in out


def test_plan_says_whether_the_fused_kernel_runs_it(capsys):
    code, out, _ = run(capsys, "plan", "all-reduce", "-n", "2", "-s", "direct-push", "-b", "64KiB")
    assert code == 0 and "fused kernel (sm): fused: yes; fused-ll: yes" in out
    code, out, _ = run(capsys, "plan", "all-reduce", "-n", "2", "-s", "ring", "-b", "64KiB",
                       "--chunks", "2", "--lanes", "2")
    assert code == 0  # (a program a lane: purlin.atom.fused_lanes)
    assert "fused kernel (sm): fused: yes" in out


def test_plan_json_round_trips_to_a_verified_schedule(capsys):
    code, out, _ = run(capsys, "plan", "all-gather", "-n", "3", "-s", "ring", "-b", "4KiB",
                       "--json")
    assert code == 0
    data = json.loads(out)
    assert data["verified"] is True and data["problems"] == []
    schedule = Schedule.from_json(data["schedule"])
    assert schedule.strategy == "ring" and schedule.nranks == 3
    assert verify(schedule).ok


def test_plan_splits_sizes_that_do_not_divide_as_evenly_as_it_can(capsys):
    code, out, err = run(capsys, "plan", "all-gather", "-n", "3", "-b", "64KiB")
    assert code == 0 and err == ""
    assert "message 64 KiB: 3 chunks of 21844 B or 21848 B" in out


def test_plan_ir_prints_the_exact_program(capsys):
    code, out, _ = run(capsys, "plan", "all-reduce", "-n", "2", "-s", "ring", "-b", "64", "--ir")
    assert code == 0
    assert "rank 0  (scratch 8 elements)" in out
    assert "stage copy r0.input[8:16] -> r1.scratch[0:8]" in out


def test_plan_summary_names_peers_chunks_and_bytes(capsys):
    code, out, _ = run(capsys, "plan", "all-reduce", "-n", "2", "-s", "ring", "-b", "64",
                       "--rank", "1")
    assert code == 0
    lines = out.splitlines()
    assert lines[1] == "message 64 B: 2 chunks of 32 B each"
    assert "rank 0:" not in out
    steps = lines[lines.index("rank 1: 6 steps, scratch 32 B") + 1:][:6]
    assert [line.split()[1] for line in steps] == ["Stage", "Notify", "Consume"] * 2
    assert steps[0].split(None, 1)[1] == "Stage    copy chunk 0 32 B to rank 0"
    assert steps[2].endswith("Consume  wait for rank 0 >= 1; then sum chunk 1 32 B local")
    assert "in all: 4 Stage, 4 Notify, 4 Consume; 4 remote hops, 128 B over links" in out
    assert "outputs correct, no races, no deadlock" in out


def test_plan_refuses_two_phase_for_a_copy_collective(capsys):
    code, out, err = run(capsys, "plan", "all-gather", "-n", "3", "-s", "two-phase")
    assert code == 2
    assert "two-phase" in err and "copy collective" in err


def test_run_on_cpu_matches_the_reference(capsys):
    code, out, err = run(capsys, "run", "reduce-scatter", "-n", "3", "-s", "ring", "-b", "3KiB",
                         "--chunks", "2", "--lanes", "2", "--calls", "2")
    assert code == 0, out + err
    assert out.count("max |error| vs reference") == 2
    assert "result: matches the reference" in out


def test_parse_size_units_and_errors():
    assert parse_size("2GiB") == 2 << 30
    assert parse_size("1.5KiB") == 1536
    for bad in ("", "12XB", "-4", "1.3B"):
        try:
            parse_size(bad)
        except Exception as exc:
            assert "size" in str(exc)
        else:
            raise AssertionError(f"{bad!r} was accepted")


def test_trace_writes_html_and_perfetto_with_a_measured_cpu_timeline(capsys, tmp_path):
    pytest = __import__("pytest")
    pytest.importorskip("plotly", reason="plotly draws the figure (pip install .[viz])")
    html, trace = tmp_path / "t.html", tmp_path / "t.json"
    code, out, err = run(capsys, "trace", "all-gather", "-n", "3", "-s", "ring", "-b", "3KiB",
                         "--measure", "--out", str(html), "--perfetto", str(trace))
    assert code == 0, err
    assert "measured on the cpu datapath, 3 ranks" in out and "predicted by profile H200" in out
    assert html.stat().st_size > 10_000 and "plotly" in html.read_text()[:200_000].lower()
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["ph"] for e in events} >= {"X", "s", "f"}
