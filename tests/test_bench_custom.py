"""bench/custom_vs_standard.py on the cpu datapath with tiny sizes: every case runs, is right,
and the JSON has what the GPU run's table is made of."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_custom_vs_standard_runs_on_the_cpu_datapath(tmp_path):
    out = tmp_path / "cvs.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "custom_vs_standard.py"),
                           "--datapath", "cpu", "--quick", "--ranks", "2,3", "--sizes", "512",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads(out.read_text())
    rows = data["rows"]
    cases = {r["case"] for r in rows}
    assert cases == {"reversed all-gather", "gqa all-gather", "gqa all-gather, odd pieces",
                     "rotated reduce-scatter max",
                     "rotated reduce-scatter avg", "uneven all-to-all", "two-root broadcast",
                     "partial all-reduce to the others", "all-gather, own chunk twice",
                     "all-reduce + 1 element"}
    assert len(rows) == 2 * len(cases)  # 2 and 3 ranks, one size
    for r in rows:
        assert r["status"] == "ok", r
        assert {"case", "twin", "nranks", "cluster", "nbytes", "dtype", "input_bytes", "custom",
                "standard", "custom_best", "standard_best", "ratio_auto", "ratio_best",
                "auto_vs_best"} <= set(r)
        assert r["cluster"] == "cpu" and r["dtype"] == "float16"
        for side in ("custom", "standard"):
            auto = r[side]["auto"]
            assert auto["wrong"] == 0 and auto["us"] > 0, (r["case"], side, auto)
        assert r["ratio_best"] > 0 and r["custom_best"] in r["custom"]
        if r["case"] != "all-reduce + 1 element" and r["twin"] != "reduce":
            custom, standard = r["input_bytes"]
            if r["case"] == "all-gather, own chunk twice":  # n + 1 chunks out against n:
                custom = custom * (r["nranks"] + 1) / r["nranks"]  # the same bytes written
            assert abs(custom - standard) <= 0.1 * standard, r  # the same bytes, near enough
    assert data["refusals"] == [] and data["default_refusals"] == 0
    assert data["info"]["quick"] is True and "not GPU numbers" in data["info"]["measured"]
    assert "custom/standard (best) geomean" in proc.stdout and "refusals: 0" in proc.stdout
