"""A custom collective wherever the command line takes a standard one: a JSON file written from
``Collective.to_json`` or ``module:attribute`` (a Collective, or a function of the rank count)."""

import json
import textwrap

import pytest

from purlin.cli import main, resolve_collective
from purlin.spec import Collective, collectives, copy, reduce


def qkv_gather(n):
    """An all-gather into an interleaved QKV layout (tuple chunk names)."""
    return Collective([[(p, r) for p in "qkv"] for r in range(n)],
                      [[(p, r) for p in "qkv" for r in range(n)]] * n, copy,
                      name="qkv all-gather")


TWO_ROOTS = Collective([["x"]] * 3, [["x"], [], ["x"]], reduce.max, name="reduce to 0 and 2")


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("coll", [qkv_gather(3), TWO_ROOTS, collectives.broadcast(4, root=2),
                                  collectives.all_to_all(3), collectives.reduce(2, root=1, op="avg")],
                         ids=lambda c: c.name)
def test_to_json_and_from_json_round_trip(coll):
    back = Collective.from_json(json.loads(json.dumps(coll.to_json())))
    assert back == coll
    assert (back.name, back.root, str(back.op)) == (coll.name, coll.root, str(coll.op))
    assert back.describe() == coll.describe()


@pytest.fixture
def custom(tmp_path, monkeypatch):
    """A JSON file and a module beside the working folder, both holding custom collectives."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "qkv.json").write_text(json.dumps(qkv_gather(3).to_json()))
    (tmp_path / "my_collectives.py").write_text(textwrap.dedent("""
        from purlin.spec import Collective, copy, reduce

        TWO_ROOTS = Collective([["x"]] * 3, [["x"], [], ["x"]], reduce.max,
                               name="reduce to 0 and 2")

        def qkv(n):
            return Collective([[(p, r) for p in "qkv"] for r in range(n)],
                              [[(p, r) for p in "qkv" for r in range(n)]] * n, copy,
                              name="qkv all-gather")
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


@pytest.mark.parametrize("text, ranks", [
    ("qkv.json", None), ("qkv.json", 3), ("my_collectives:qkv", 3),
    ("my_collectives.py:qkv", 3),
])
def test_describe_takes_a_file_or_a_module_attribute(capsys, custom, text, ranks):
    argv = ["describe", text] + ([] if ranks is None else ["-n", str(ranks)])
    code, out, err = run(capsys, *argv)
    assert code == 0, err
    assert out == qkv_gather(3).describe() + "\n"
    assert resolve_collective(text, ranks) == qkv_gather(3)


def test_a_module_attribute_holding_a_collective(capsys, custom):
    code, out, _ = run(capsys, "describe", "my_collectives:TWO_ROOTS")
    assert code == 0 and out == TWO_ROOTS.describe() + "\n"


def test_describe_json_output_is_a_file_the_cli_takes_back(capsys, custom):
    code, out, _ = run(capsys, "describe", "reduce", "-n", "3", "--root", "1", "--json")
    (custom / "mine.json").write_text(out)
    code, out, _ = run(capsys, "describe", "mine.json")
    assert code == 0 and out == collectives.reduce(3, root=1).describe() + "\n"


def test_plan_a_custom_collective(capsys, custom):
    code, out, err = run(capsys, "plan", "qkv.json", "-s", "ring", "-b", "72")
    assert code == 0, err
    assert out.startswith("qkv all-gather (copy) on 3 ranks, ring")
    assert "chunk (q,0)" in out
    assert "outputs correct, no races, no deadlock" in out


@pytest.mark.parametrize("text", ["qkv.json", "my_collectives:TWO_ROOTS"])
def test_run_a_custom_collective_against_the_reference(capsys, custom, text):
    code, out, err = run(capsys, "run", text, "-b", "1KiB", "--calls", "1")
    assert code == 0, out + err
    assert "result: matches the reference" in out


def test_trace_a_custom_collective(capsys, custom):
    pytest.importorskip("plotly")
    code, out, err = run(capsys, "trace", "my_collectives:qkv", "-n", "3", "-b", "4KiB",
                         "--measure")
    assert code == 0, err
    assert "purlin: created folder outputs" in out
    assert f"wrote {custom / 'outputs' / 'timeline.html'}" in out
    assert "µs" in out and " us" not in out


def test_bench_a_custom_collective_on_the_cpu_datapath(capsys, custom):
    code, out, err = run(capsys, "bench", "qkv.json", "-b", "1KiB", "--datapath", "cpu",
                         "--providers", "purlin:ring", "--no-progress", "--repeats", "1",
                         "--ops", "1")
    assert code == 0, err
    assert "# qkv all-gather | purlin:ring | 3 ranks" in out


def test_bench_refuses_ranks_that_disagree_with_a_custom_collective(capsys, custom):
    code, out, err = run(capsys, "bench", "qkv.json", "-n", "2", "--datapath", "cpu")
    assert code == 2 and out == ""
    assert err == ("purlin: error: --ranks 2 does not match qkv.json, a collective of 3 ranks; "
                   "give --ranks 3 or leave it out\n")
