"""bench/fp8_deterministic.py on the cpu datapath with tiny sizes: both tables run, every
bind is right, FP8 moves half the bytes of bfloat16's stand-in, and the JSON is written."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_fp8_deterministic_bench_runs_on_the_cpu_datapath(tmp_path):
    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "fp8_deterministic.py"),
                           "--datapath", "cpu", "--ranks", "4", "--sizes", "8KiB",
                           "--out", str(out)], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "all-gather, same elements" in proc.stdout and "all-reduce float16" in proc.stdout
    rows = json.loads(out.read_text())["rows"]
    assert [r["table"] for r in rows] == ["all-gather", "all-reduce"]
    gather, reduce = rows
    assert gather["fp8"]["output_bytes"] * 2 == gather["bf16"]["output_bytes"]
    assert gather["fp8"]["wrong"] == 0 and gather["ratio"] > 0
    assert reduce["deterministic"]["same_bits"] and reduce["deterministic"]["wrong"] == 0
    assert all(r["status"] == "ok" for r in rows)
