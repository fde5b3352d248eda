"""Kernel cases in the Numba CUDA simulator, run in one child process per test file: the
simulator is chosen when ``numba.cuda`` is first imported, so it cannot share the pytest
process with GPU tests.

A test file defines its cases (name -> function raising on a failure), its tests with
``verdicts, test_in_simulator = simulator_tests(__file__, CASES)``, and ``if __name__ ==
"__main__": run_cases(CASES, sys.argv[1])``.
"""

import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def simulator_verdicts(test_file, tmp_path_factory, timeout: int = 900) -> dict:
    """Run ``test_file`` as a script under the simulator; its verdict per case ("ok" or the
    traceback)."""
    pytest.importorskip("numba.cuda", reason="numba-cuda is needed for the kernel simulator")
    out = tmp_path_factory.mktemp("sim") / "verdicts.json"
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests"),
                                           os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(test_file), str(out)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    if not out.exists():
        pytest.fail(f"the simulator process failed (rc {proc.returncode}):\n"
                    f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def run_cases(cases: dict, out: str) -> None:
    """Run every case (in the child process), writing name -> "ok" or its traceback."""
    from numba.cuda import config

    if not config.ENABLE_CUDASIM:
        raise SystemExit("set NUMBA_ENABLE_CUDASIM=1 before running the simulator cases")
    verdicts = {}
    for name, fn in cases.items():
        try:
            fn()
            verdicts[name] = "ok"
        except Exception:  # noqa: BLE001 - every failure is reported to the parent test
            verdicts[name] = traceback.format_exc()
    Path(out).write_text(json.dumps(verdicts, indent=1))


def simulator_tests(test_file, cases: dict):
    """(the module's ``verdicts`` fixture, its ``test_in_simulator``: one test per case of
    ``cases``, passing where the case's verdict is "ok")."""
    @pytest.fixture(scope="module")
    def verdicts(tmp_path_factory):
        return simulator_verdicts(test_file, tmp_path_factory)

    @pytest.mark.parametrize("name", sorted(cases))
    def test_in_simulator(name, verdicts):
        assert name in verdicts, f"case {name} did not run"
        assert verdicts[name] == "ok", verdicts[name]

    return verdicts, test_in_simulator
