"""The ``purlin`` command line: output, JSON, exit codes and error messages."""

import json
import subprocess
import sys

import pytest

from purlin.cli import COMMANDS, main
from purlin.spec import Collective, collectives
from purlin.spec.collectives import STANDARD


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_list_has_one_line_per_standard_collective(capsys):
    code, out, err = run(capsys, "list")
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert [line.split()[0] for line in lines] == list(STANDARD)
    assert lines[2].split()[1] == "reduce"  # all-reduce
    assert lines[0].split()[1] == "copy"  # all-gather
    assert all(len(line.split()) > 2 for line in lines), "every line has a description"


def test_describe_prints_the_collective_table(capsys):
    code, out, err = run(capsys, "describe", "all-reduce", "--ranks", "3")
    assert code == 0 and err == ""
    assert out == collectives.all_reduce(3).describe() + "\n"


def test_describe_accepts_underscores_root_and_op(capsys):
    code, out, _ = run(capsys, "describe", "reduce", "-n", "4", "--root", "2", "--op", "max")
    assert code == 0
    assert out.splitlines()[0] == "reduce (reduce:max), 4 ranks"
    code, out, _ = run(capsys, "describe", "all_gather", "-n", "2")
    assert code == 0 and out.startswith("all-gather (copy), 2 ranks")


def test_describe_json_round_trips(capsys):
    code, out, _ = run(capsys, "describe", "broadcast", "--ranks", "3", "--root", "1", "--json")
    assert code == 0
    coll = Collective.from_json(json.loads(out))
    assert coll == collectives.broadcast(3, root=1)
    assert coll.root == 1


@pytest.mark.parametrize("argv, message", [
    (["describe", "all-gather", "--ranks", "1"], "needs n >= 2 ranks, got 1"),
    (["describe", "ring-reduce", "--ranks", "4"], "unknown collective 'ring-reduce'"),
    (["describe", "broadcast", "--ranks", "4", "--root", "4"], "root 4 is outside the ranks 0..3"),
    (["describe", "all-gather", "--ranks", "4", "--op", "max"], "all-gather copies and takes no --op"),
    (["describe", "all-reduce", "--ranks", "4", "--root", "1"], "all-reduce has no root"),
    (["describe", "all-reduce"], "all-reduce needs a rank count: give --ranks N"),
])
def test_user_errors_exit_2_with_one_line(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert err.startswith("purlin: error: ") and message in err
    assert err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("argv", [[], ["frobnicate"],
                                  ["describe", "all-reduce", "-n", "4", "--op", "prod"]])
def test_usage_errors_exit_2(capsys, argv):
    code, _, err = run(capsys, *argv)
    assert code == 2
    assert "usage: purlin" in err and "error:" in err


def test_help_exits_0(capsys):
    code, out, _ = run(capsys, "--help")
    assert code == 0
    for name in COMMANDS:
        assert name in out


def test_demo_runs_the_tour_headless_and_says_where_its_output_goes(capsys):
    # the run itself is tests/test_notebooks.py::test_the_tour_runs_through_purlin_demo
    code, out, _ = run(capsys, "demo", "--help")
    assert code == 0
    assert "tour notebook" in out and "--out DIR" in out and "--gpu" in out


def test_python_dash_m_purlin_runs_the_cli():
    done = subprocess.run([sys.executable, "-m", "purlin", "describe", "gather", "-n", "2"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("gather (copy), 2 ranks")
    bad = subprocess.run([sys.executable, "-m", "purlin", "describe", "gather", "-n", "0"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2
    assert bad.stderr.startswith("purlin: error: ")
