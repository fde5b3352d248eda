"""The way in: ``./dev.sh`` checks what creating ``.venv`` needs and says what to install, and
the README's command examples run and write nothing into the checkout.

dev.sh runs here from a copy in a temporary folder with stub interpreters (``PYTHON``) and a
stub ``df`` on ``PATH``: every case stops at a prerequisite, so no virtual environment is made.
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BASH = shutil.which("bash")
pytestmark = pytest.mark.skipif(BASH is None, reason="dev.sh is a bash script")


def stub(folder: Path, name: str, body: str) -> Path:
    path = folder / name
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    return path


def python_stub(folder: Path, version="3.11.4", bundled_pip="24.0") -> Path:
    """An interpreter that answers dev.sh's probe: its version, then ensurepip's pip."""
    return stub(folder, "python3-stub", f"echo {version}\necho {bundled_pip}")


def df_stub(folder: Path, free_kb: int) -> Path:
    bindir = folder / "bin"
    bindir.mkdir(exist_ok=True)
    stub(bindir, "df", "echo 'Filesystem 1024-blocks Used Available Capacity Mounted on'\n"
                       f"echo '/dev/stub 99999999 1 {free_kb} 1% /'")
    return bindir


def dev_sh(tmp_path: Path, *argv, python=None, path_first=None):
    """Run a copy of dev.sh in ``tmp_path/checkout`` (so a venv could never land in the real
    checkout); returns (exit status, stderr, checkout)."""
    checkout = tmp_path / "checkout"
    checkout.mkdir(exist_ok=True)
    shutil.copy(ROOT / "dev.sh", checkout / "dev.sh")
    (checkout / "pyproject.toml").write_text("")
    env = dict(os.environ)
    env.pop("PURLIN_SKIP_TORCH", None)
    if python is not None:
        env["PYTHON"] = str(python)
    if path_first is not None:
        env["PATH"] = f"{path_first}{os.pathsep}{env['PATH']}"
    done = subprocess.run([BASH, str(checkout / "dev.sh"), *argv], capture_output=True,
                          text=True, env=env, timeout=60, cwd=tmp_path)
    return done.returncode, done.stdout + done.stderr, checkout


def assert_no_venv(checkout: Path):
    assert not (checkout / ".venv").exists(), "a failed prerequisite must not leave a venv"


def test_a_missing_python_says_what_to_install(tmp_path):
    code, out, checkout = dev_sh(tmp_path, "purlin", "list", python=tmp_path / "no-python")
    assert code == 2
    assert "no-python not found. Install Python >= 3.10" in out
    assert "sudo apt-get install python3 python3-venv" in out and "PYTHON=" in out
    assert_no_venv(checkout)


def test_an_old_python_is_refused_with_its_version(tmp_path):
    code, out, checkout = dev_sh(tmp_path, "demo", python=python_stub(tmp_path, "3.8.10"))
    assert code == 2
    assert "is Python 3.8.10; Purlin needs >= 3.10" in out
    assert "apt-get install python3.11 python3.11-venv" in out
    assert_no_venv(checkout)


def test_a_python_without_venv_names_the_debian_package(tmp_path):
    code, out, checkout = dev_sh(tmp_path, "test", python=python_stub(tmp_path, "3.12.3", "none"))
    assert code == 2
    assert "(Python 3.12.3) has no venv module with ensurepip" in out
    assert "sudo apt-get install python3.12-venv" in out and "python3-venv" in out
    assert_no_venv(checkout)


def test_a_python_that_does_not_run(tmp_path):
    broken = stub(tmp_path, "python3-broken", "exit 1")
    code, out, checkout = dev_sh(tmp_path, "purlin", python=broken)
    assert code == 2 and "does not run" in out
    assert_no_venv(checkout)


def test_too_little_disk_is_refused_with_the_numbers(tmp_path):
    bindir = df_stub(tmp_path, free_kb=1_200_000)  # 1.1 GB
    code, out, checkout = dev_sh(tmp_path, "purlin", "list", python=python_stub(tmp_path),
                                 path_first=bindir)
    assert code == 2
    assert re.search(r"only 1\.1 GB free on the disk of \S+checkout; \.venv takes about "
                     r"2\.3 GB: free at least 3 GB", out), out
    assert_no_venv(checkout)


def test_the_real_python_passes_the_checks_up_to_the_disk(tmp_path):
    """This machine's interpreter (the one running the tests) meets the version and venv
    checks: with a stub df saying the disk is full, dev.sh stops at the disk only."""
    bindir = df_stub(tmp_path, free_kb=10)
    code, out, checkout = dev_sh(tmp_path, "purlin", python=sys.executable, path_first=bindir)
    assert code == 2 and "GB free on the disk" in out, out
    assert_no_venv(checkout)


def test_help_lists_the_purlin_command(tmp_path):
    code, out, _ = dev_sh(tmp_path, "help")
    assert code == 0
    assert "./dev.sh purlin ..." in out and "outputs/demo-timeline.html" in out


def test_dev_sh_purlin_runs_where_it_was_called(tmp_path):
    """``./dev.sh purlin`` goes back to the caller's folder before it runs, so ``--out x``
    lands where the user is; a stub venv stands in for the installed one."""
    checkout = tmp_path / "checkout"
    venv_bin = checkout / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    (checkout / "pyproject.toml").write_text("")
    shutil.copy(ROOT / "dev.sh", checkout / "dev.sh")
    stub(venv_bin, "python", f'exec {sys.executable} "$@"')
    stub(venv_bin, "purlin", 'echo "cwd=$PWD args=$*"')
    # a stamp that says the notebook extra is installed: no pip runs
    digest = subprocess.run(
        [sys.executable, "-c", "import hashlib; print(hashlib.sha256(b'\\0skip_torch=0')"
                               ".hexdigest())"], capture_output=True, text=True).stdout.strip()
    (checkout / ".venv" / "purlin-install.stamp").write_text(f"{digest}\nnotebook\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    done = subprocess.run([BASH, str(checkout / "dev.sh"), "purlin", "trace", "--out", "t.html"],
                          capture_output=True, text=True, timeout=60, cwd=elsewhere,
                          env={k: v for k, v in os.environ.items() if k != "PURLIN_SKIP_TORCH"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"cwd={elsewhere} args=trace --out t.html"


# -- the demo reads cleanly --------------------------------------------------------------------


@pytest.mark.slow
def test_the_demo_output_reads_cleanly(tmp_path, capsys):
    pytest.importorskip("nbclient")
    from purlin.cli import main

    assert main(["demo", "--out", str(tmp_path / "demo")]) == 0
    printed = capsys.readouterr().out
    blocks = [b for b in printed.split("\n\n") if b.count("\n") >= 2]
    twice = {b for b in blocks if blocks.count(b) > 1}
    assert not twice, f"printed twice: {twice}"
    assert "array(" not in printed, "no bare numpy repr"
    assert "(measured (" not in printed
    assert not re.search(r"\d us\b", printed), "microseconds are µs everywhere"
    assert not [line for line in printed.splitlines() if line.endswith("\\")], \
        "tables print whole, not wrapped"
    assert "rank 0 gathered [0.0, 0.0, 1.0, 1.0" in printed
    assert f"timeline page:     {tmp_path / 'demo' / 'demo-timeline.html'}" in printed


def test_the_demo_writes_under_outputs_by_default():
    from purlin.cli import build_parser

    assert build_parser().parse_args(["demo"]).out == "outputs"
    import inspect

    from purlin.notebooks import demo

    assert inspect.signature(demo).parameters["out"].default == "outputs"


# -- the README's command examples ---------------------------------------------------------------


def readme_code_lines() -> list[str]:
    """The lines inside the README's fenced code blocks."""
    inside, lines = False, []
    for line in (ROOT / "README.md").read_text().splitlines():
        if line.startswith("```"):
            inside = not inside
        elif inside:
            lines.append(line)
    return lines


def readme_commands() -> list[str]:
    """Every ``./dev.sh purlin ...`` line in the README's code blocks, comments dropped."""
    return [line.split("  #")[0].strip() for line in readme_code_lines()
            if line.startswith("./dev.sh purlin ")]


QKV_MODULE = '''
from purlin.spec import Collective, copy

def qkv(n):
    return Collective([[(p, r) for p in "qkv"] for r in range(n)],
                      [[(p, r) for p in "qkv" for r in range(n)]] * n, copy, name="qkv")
'''


def test_the_readme_shows_purlin_through_dev_sh_only():
    bare = [line for line in readme_code_lines() if line.startswith("purlin ")]
    assert not bare, f"README commands run through ./dev.sh purlin: {bare}"
    assert len(readme_commands()) >= 8


@pytest.mark.slow
def test_the_readme_commands_run_and_write_only_under_outputs(tmp_path, monkeypatch, capsys):
    """Each example, as ``main([...])`` in an empty folder (bench is left to its own tests):
    exit 0, and nothing written beside the folder but ``outputs/`` and the file the JSON
    example redirects to."""
    import shlex

    pytest.importorskip("plotly")
    from purlin.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "mymodule.py").write_text(QKV_MODULE)
    redirected = tmp_path / "redirected.json"
    ran = 0
    for line in readme_commands():
        line = line.replace("/tmp/ag3.json", str(redirected))
        argv = shlex.split(line)[2:]
        if argv[0] == "bench":
            continue
        target = None
        if ">" in argv:
            argv, target = argv[:argv.index(">")], argv[argv.index(">") + 1]
        code = main(argv)
        out, err = capsys.readouterr()
        assert code == 0, f"{line}: {err}"
        if target is not None:
            Path(target).write_text(out)
        ran += 1
    assert ran >= 8
    left = sorted(p.name for p in tmp_path.iterdir())
    assert set(left) <= {"outputs", "mymodule.py", "redirected.json", "__pycache__"}, left
    assert {p.name for p in (tmp_path / "outputs").iterdir()} == {
        "timeline.html", "ring.html", "ring.json"}
