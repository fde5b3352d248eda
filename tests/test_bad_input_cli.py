"""Every mistake on the command line is answered with one line, ``purlin: error: ...``, exit
status 2, and nothing written; ``PURLIN_DEBUG=1`` shows the traceback instead."""

import json

import pytest

from purlin import cli
from purlin.cli import main
from purlin.spec import collectives


@pytest.fixture
def here(tmp_path, monkeypatch):
    """An empty working folder: whatever a command writes lands here."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PURLIN_DEBUG", raising=False)
    return tmp_path


def one_line_error(capsys, argv, code=2):
    got = main(argv)
    out, err = capsys.readouterr()
    assert got == code, (out, err)
    assert err.startswith("purlin: error: "), err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err[len("purlin: error: "):].rstrip("\n")


MISTAKES = [
    # unknown collective names, in every command that takes a collective
    (["describe", "all-reduse", "-n", "4"], "unknown collective 'all-reduse'"),
    (["plan", "allreduce", "-n", "4"], "unknown collective 'allreduce'"),
    (["run", "ring-reduce", "-n", "2"], "or give a JSON file written from Collective.to_json"),
    (["trace", "frob", "-n", "2"], "unknown collective 'frob'"),
    # sizes
    (["plan", "all-reduce", "-n", "4", "-b", "12XB"], "cannot read size '12XB'"),
    (["run", "all-reduce", "-n", "2", "-b", "1.3B"], "not a whole, non-negative number of bytes"),
    (["trace", "all-reduce", "-n", "2", "-b", "KiB"], "cannot read size 'KiB'"),
    (["plan", "all-reduce", "-n", "2", "-b", "10"], "10 bytes is not a whole number of float32"),
    # files and module paths
    (["describe", "missing.json"], "no file 'missing.json'"),
    (["plan", "sub/missing.json", "-n", "2"], "no file 'sub/missing.json'"),
    (["describe", "no_such_module_xyz:coll"], "cannot import 'no_such_module_xyz'"),
    (["describe", "json:no_such_attribute"], "module 'json' has no attribute 'no_such_attribute'"),
    (["describe", "json:loads", "-n", "2"], "json:loads(2) raised TypeError"),
    (["describe", "json:dumps", "-n", "2"], "json:dumps(2) returned a str, not a Collective"),
    (["describe", "json:dumps"], "json:dumps is a function of the rank count: give --ranks N"),
    (["describe", "json:decoder"], "json:decoder is a module, not a Collective"),
    (["describe", "missing.py:coll"], "no file 'missing.py'"),
    (["describe", "json:"], "write module:attribute"),
    # ranks and options
    (["describe", "all-gather"], "all-gather needs a rank count: give --ranks N"),
    (["describe", "all-gather", "-n", "1"], "needs n >= 2 ranks, got 1"),
    (["plan", "broadcast", "-n", "4", "--root", "7"], "root 7 is outside the ranks 0..3"),
    (["plan", "all-reduce", "-n", "2", "--rank", "5"], "--rank 5 is outside the ranks 0..1"),
    # a PurlinError from planning
    (["plan", "all-gather", "-n", "3", "-s", "two-phase"], "cannot plan all-gather on 3 ranks"),
    (["trace", "all-gather", "-n", "3", "-s", "two-phase"], "cannot plan all-gather on 3 ranks"),
    (["run", "all-reduce", "-n", "2", "-s", "zigzag"], "zigzag"),
]


@pytest.mark.parametrize("argv, fragment", MISTAKES, ids=[" ".join(a) for a, _ in MISTAKES])
def test_a_mistake_is_one_line_exit_2_and_writes_nothing(capsys, here, argv, fragment):
    message = one_line_error(capsys, argv)
    assert fragment in message
    assert list(here.iterdir()) == [], "nothing is written after a mistake"


def custom_file(folder, coll):
    path = folder / "custom.json"
    path.write_text(json.dumps(coll.to_json()))
    return path


def test_ranks_must_agree_with_a_custom_collective(capsys, here):
    custom_file(here, collectives.all_gather(3))
    message = one_line_error(capsys, ["plan", "custom.json", "-n", "4"])
    assert message == ("--ranks 4 does not match custom.json, a collective of 3 ranks; "
                       "give --ranks 3 or leave it out")
    assert sorted(p.name for p in here.iterdir()) == ["custom.json"]


def test_root_and_op_do_not_apply_to_a_custom_collective(capsys, here):
    custom_file(here, collectives.all_reduce(2))
    assert "--op applies to the standard collectives" in one_line_error(
        capsys, ["describe", "custom.json", "--op", "max"])
    assert "--root applies to the standard collectives" in one_line_error(
        capsys, ["describe", "custom.json", "--root", "1"])


@pytest.mark.parametrize("text, fragment", [
    ("{not json", "custom.json is not JSON"),
    ('{"input": [[0]]}', "needs the keys 'input', 'output' and 'op'"),
    ('{"input": [[0], [1]], "output": [[0], [2]], "op": "copy"}',
     "custom.json: output name '2' at rank 1 position 0 has no source"),
    ('{"input": [[0], [1]], "output": [[0], [1]], "op": "frobnicate"}', "custom.json"),
])
def test_a_file_that_is_not_a_collective(capsys, here, text, fragment):
    (here / "custom.json").write_text(text)
    assert fragment in one_line_error(capsys, ["describe", "custom.json"])


def test_out_that_is_a_folder_is_refused_before_anything_runs(capsys, here):
    (here / "figs").mkdir()
    message = one_line_error(capsys, ["trace", "all-gather", "-n", "2", "--out", "figs"])
    assert message == "figs is a folder; give a file name, e.g. figs/timeline.html"
    assert list((here / "figs").iterdir()) == []


def test_out_under_a_file_is_one_line(capsys, here):
    pytest.importorskip("plotly")
    (here / "afile").write_text("")
    message = one_line_error(capsys, ["trace", "all-gather", "-n", "2", "--out", "afile/t.html"])
    assert message.startswith("cannot write or read afile")


def test_a_missing_output_folder_is_created_and_said(capsys, here):
    pytest.importorskip("plotly")
    assert main(["trace", "all-gather", "-n", "2", "--out", "newdir/deeper/t.html",
                 "--perfetto", "newdir/t.json"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert "purlin: created folder newdir/deeper" in out
    assert f"wrote {here / 'newdir/deeper/t.html'}" in out
    assert f"wrote {here / 'newdir/t.json'}" in out
    assert (here / "newdir/deeper/t.html").stat().st_size > 10_000


def test_an_unexpected_error_is_one_line_and_PURLIN_DEBUG_shows_the_traceback(
        capsys, here, monkeypatch):
    def broken(args):
        """A command with a bug."""
        raise ValueError("boom\nsecond line")

    monkeypatch.setitem(cli.COMMANDS, "list", cli.Command("list", broken, ()))
    message = one_line_error(capsys, ["list"], code=1)
    assert message == ("unexpected ValueError: boom (PURLIN_DEBUG=1 shows the rest)")
    monkeypatch.setenv("PURLIN_DEBUG", "1")
    with pytest.raises(ValueError, match="boom"):
        main(["list"])


def test_purlin_debug_raises_a_purlin_error_with_its_traceback(here, monkeypatch):
    from purlin.errors import SpecError

    monkeypatch.setenv("PURLIN_DEBUG", "1")
    with pytest.raises(SpecError, match="unknown collective 'frob'"):
        main(["describe", "frob", "-n", "2"])


def test_a_missing_figure_package_is_one_line_naming_it(capsys, here, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "plotly", None)  # `import plotly` now fails as if absent
    monkeypatch.setitem(sys.modules, "plotly.graph_objects", None)
    line = one_line_error(capsys, ["trace", "all-reduce", "-n", "2", "-s", "ring"])
    assert "needs the plotly package" in line and "pip install" in line, line
    assert not list(here.iterdir())
