"""The datapath registry in purlin.atom is the one dispatch of a bind, and the runtime calls
into atom, never the other way round."""

from __future__ import annotations

import ast
import pathlib

import numpy as np
import pytest

from purlin import atom
from purlin.errors import CapabilityError
from purlin.runtime import Cluster
from purlin.spec import collectives

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_every_registered_datapath_has_the_same_front_door():
    for name in atom.DATAPATHS:
        module = atom.load(name)
        assert module.CAPABILITIES.name == name
        assert callable(module.bind) and module.RUNS_ON


def test_cluster_kinds_map_to_datapaths_through_the_registry():
    assert atom.runs_on("cpu") == ("cpu", "ce")
    assert atom.runs_on("local") == atom.runs_on("virtual") == ("sm", "ce")


def test_a_bind_goes_through_the_registry(monkeypatch):
    """Replacing the module a name maps to replaces what bind runs."""
    seen = []

    class Fake:
        CAPABILITIES = atom.capabilities("cpu")
        RUNS_ON = ("cpu",)

        @staticmethod
        def bind(cluster, schedule, *, timeout, **options):
            seen.append((cluster.kind, schedule.collective.name, timeout, options))
            return "bound"

    real = atom.load
    monkeypatch.setattr(atom, "load", lambda name: Fake if name == "cpu" else real(name))
    got = Cluster.cpu(2).bind(collectives.all_gather(2), count=2, timeout=2, lanes=1, extra=1)
    assert got == "bound" and seen == [("cpu", "all-gather", 2.0, {"extra": 1})]


def test_ce_on_a_cpu_cluster_plans_for_copy_engines_and_runs_on_the_cpu_datapath():
    bound = Cluster.cpu(2).bind(collectives.all_reduce(2), count=4, dtype="float64",
                                datapath="ce")
    engines = {s.engine for steps in bound.schedule.steps for s in steps if s.moves_data}
    assert engines == {"ce", "sm"}
    outs = bound([np.arange(4.0), np.ones(4)])
    assert [o.tolist() for o in outs] == [[1.0, 2.0, 3.0, 4.0]] * 2


def test_a_gpu_datapath_on_a_cpu_cluster_names_the_choices():
    with pytest.raises(CapabilityError, match="datapath 'sm' cannot run on Cluster.cpu"):
        Cluster.cpu(2).bind(collectives.all_reduce(2), count=4, datapath="sm")


def test_unknown_names_are_refused_by_the_registry():
    with pytest.raises(CapabilityError, match="unknown datapath 'nvls'; registered: cpu, sm, ce"):
        atom.load("nvls")


def test_refuse_stuck_asks_only_loaded_datapaths(monkeypatch):
    from purlin.atom import ce

    monkeypatch.setitem(ce.STUCK, 3, "a test")
    atom.refuse_stuck([0, 1])
    with pytest.raises(Exception, match="GPU 3 still runs a stuck copy-engine collective"):
        atom.refuse_stuck([3])


def _imports(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def test_atom_never_imports_the_runtime_and_the_runtime_never_peeks_at_atom_modules():
    for path in (ROOT / "purlin" / "atom").glob("*.py"):
        assert not any(m.startswith("purlin.runtime") for m in _imports(path)), path.name
    cluster = (ROOT / "purlin" / "runtime" / "cluster.py").read_text()
    assert "sys.modules" not in cluster and "cls" not in _call_arguments(cluster)


def _call_arguments(source: str) -> set[str]:
    """Names passed as arguments to calls on atom modules in ``source``."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            names.update(a.id for a in node.args if isinstance(a, ast.Name))
    return names


def test_import_purlin_hands_the_cost_model_to_auto_and_trace_does_not_import_the_runtime():
    import purlin.trace
    from purlin.runtime import auto

    assert auto._latency_model is purlin.trace.predict_latency
    for path in (ROOT / "purlin" / "trace").glob("*.py"):
        assert not any(m.startswith("purlin.runtime") for m in _imports(path)), path.name
