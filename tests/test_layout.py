"""The repository's layout: kernels/ at the top level imports as ``purlin.kernels`` three ways
(a built wheel, the editable install, a source checkout on PYTHONPATH), the package list in
pyproject matches the folders, and no module imports a layer above its own."""

from __future__ import annotations

import ast
import doctest
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
ARCHITECTURE = ROOT / "ARCHITECTURE.md"
GRAPH_START, GRAPH_END = "<!-- import-graph -->", "<!-- /import-graph -->"
REGENERATE = "PYTHONPATH=. python tests/test_layout.py --write"
PROBE = "import purlin, purlin.kernels.isa as isa; print(isa.__file__)"

# Lowest first: a module may import its own layer and those before it (ARCHITECTURE.md).
LAYERS = ["errors", "spec", "snac", "kernels", "atom", "runtime", "trace", "viz", "bench",
          "torch", "notebooks", "cli", "__init__", "__main__"]


def _run(code: str, env_path: str, cwd: Path) -> str:
    env = {**os.environ, "PYTHONPATH": env_path}
    done = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_top_level_matches_the_promised_layout():
    for name in ("purlin", "kernels", "notebooks", "tests", "environment.yml", "README.md",
                 "ARCHITECTURE.md"):
        assert (ROOT / name).exists(), f"{name} is missing from the repository's top level"
    assert not (ROOT / "purlin" / "kernels").exists(), "kernels/ belongs at the top level"


def test_pyproject_lists_every_package():
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setup["package-dir"] == {"purlin.kernels": "kernels"}
    found = {"purlin"} | {f"purlin.{p.parent.name}" for p in (ROOT / "purlin").glob("*/__init__.py")}
    found.add("purlin.kernels")
    assert sorted(setup["packages"]) == sorted(found)


def test_source_checkout_imports_kernels(tmp_path):
    assert _run(PROBE, str(ROOT), tmp_path) == str(ROOT / "kernels" / "isa.py")


def test_stale_purlin_kernels_folder_does_not_shadow_the_top_level_one(tmp_path):
    import shutil

    for name in ("purlin", "kernels"):
        shutil.copytree(ROOT / name, tmp_path / name,
                        ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "purlin" / "kernels" / "__pycache__").mkdir(parents=True)
    assert _run(PROBE, str(tmp_path), tmp_path) == str(tmp_path / "kernels" / "isa.py")


def test_installed_package_imports_kernels(tmp_path):
    if importlib.util.find_spec("setuptools") is None:
        pytest.skip("setuptools is not installed: no wheel can be built here")
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                            "-q", "-w", str(tmp_path / "wheel"), str(ROOT)],
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    wheel = next((tmp_path / "wheel").glob("purlin-*.whl"))
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                    str(site), str(wheel)], check=True, capture_output=True, timeout=300)
    assert _run(PROBE, str(site), tmp_path) == str(site / "purlin" / "kernels" / "isa.py")


def test_this_environment_imports_kernels_from_the_top_level_folder():
    import purlin.kernels.isa as isa

    assert Path(isa.__file__).resolve().parent in {ROOT / "kernels",
                                                   ROOT / "build" / "lib" / "purlin" / "kernels"}


@pytest.mark.parametrize("module", ["sim", "occupancy", "varlen", "executor", "compat"])
def test_kernel_doctests(module):
    mod = importlib.import_module(f"purlin.kernels.{module}")
    result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0 and result.attempted > 0


def _layer(path: Path) -> str:
    rel = path.relative_to(ROOT)
    if rel.parts[0] == "kernels":
        return "kernels"
    inner = rel.parts[1:]
    return inner[0].removesuffix(".py")


def import_edges() -> set[tuple[str, str, str]]:
    """(importing layer, imported layer, file) for every import of another purlin layer."""
    edges = set()
    files = list((ROOT / "purlin").rglob("*.py")) + list((ROOT / "kernels").glob("*.py"))
    for path in files:
        here = _layer(path)
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.module
                     and node.level == 0 else [])
            for name in names:
                parts = name.split(".")
                if parts[0] == "purlin" and len(parts) > 1 and parts[1] != here:
                    edges.add((here, parts[1], str(path.relative_to(ROOT))))
    return edges


def test_no_module_imports_a_layer_above_its_own():
    upward = sorted(f"{f}: {a} imports {b}" for a, b, f in import_edges()
                    if LAYERS.index(b) > LAYERS.index(a))
    assert not upward, "imports against the layer order:\n" + "\n".join(upward)


def render_import_graph() -> str:
    """The listing ARCHITECTURE.md shows: each layer, lowest first, and the layers it imports."""
    imports: dict[str, set[str]] = {layer: set() for layer in LAYERS}
    for here, there, _ in import_edges():
        imports[here].add(there)
    width = max(map(len, LAYERS))
    lines = [f"{layer:<{width}}  imports  {', '.join(sorted(imports[layer], key=LAYERS.index)) or '-'}"
             for layer in LAYERS]
    return "```\n" + "\n".join(lines) + "\n```"


def _documented_graph(text: str) -> str:
    start, end = text.find(GRAPH_START), text.find(GRAPH_END)
    if start < 0 or end < start:
        raise AssertionError(f"ARCHITECTURE.md lacks the markers {GRAPH_START} ... {GRAPH_END}")
    return text[start + len(GRAPH_START):end].strip()


def write_import_graph() -> None:
    """Paste the generated listing between ARCHITECTURE.md's markers."""
    text = ARCHITECTURE.read_text()
    old = _documented_graph(text)
    start = text.find(GRAPH_START) + len(GRAPH_START)
    end = text.find(GRAPH_END)
    ARCHITECTURE.write_text(text[:start] + "\n" + render_import_graph() + "\n" + text[end:])
    print("ARCHITECTURE.md: import graph " + ("unchanged" if old == render_import_graph()
                                               else "updated"))


def test_render_import_graph_lists_every_layer_once():
    listing = render_import_graph().splitlines()[1:-1]
    assert [line.split()[0] for line in listing] == LAYERS
    errors = next(line for line in listing if line.startswith("errors "))
    assert errors.endswith("imports  -")  # the lowest layer imports no other
    snac = next(line for line in listing if line.startswith("snac "))
    assert snac.split("imports")[1].strip() == "errors, spec"


def test_architecture_shows_the_current_import_graph():
    documented = _documented_graph(ARCHITECTURE.read_text())
    assert documented == render_import_graph(), (
        "the import graph in ARCHITECTURE.md differs from the code's; regenerate it from the "
        f"repository root with: {REGENERATE}")


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        write_import_graph()
    else:
        print(render_import_graph())
