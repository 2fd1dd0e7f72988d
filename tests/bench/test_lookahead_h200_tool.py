"""tools/lookahead_h200.py at tiny sizes on the CPU: every variant runs, the replayed lookahead policy executes
exactly the stock path's depths (the trace), fixed depth runs every loop, and the JSON and the table land in --out."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # the tool's process (~8 s on 2 cores); its replay runs in-process in
# worker/test_lookahead_engine.py::test_a_replayed_pattern_in_graph_steps
def test_the_tool_writes_json_and_a_table(tmp_path):
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "lookahead_h200.py"), "--config", "tiny", "--device", "cpu",
                          "--dtype", "float32", "--concurrency", "2", "--input-len", "8", "--output-len", "6",
                          "--min-prompts", "2", "--out", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr
    record = json.loads((tmp_path / "lookahead_h200.json").read_text())
    assert [p["concurrency"] for p in record["results"]] == [2]
    for point in record["results"]:
        runs = {r["variant"]: r for r in point["runs"]}
        assert runs.keys() == {"lookahead_replayed", "stock_replayed", "fixed"}
        assert runs["lookahead_replayed"]["exit_depth_counts"] == runs["stock_replayed"]["exit_depth_counts"]
        assert set(runs["lookahead_replayed"]["exit_depth_counts"]) == {"2", "3", "4"}
        assert runs["fixed"]["mean_loops_per_token"] == 4.0
    table = (tmp_path / "lookahead_h200.md").read_text()
    assert table.count("| lookahead_replayed |") == 1 and "replayed" in table.splitlines()[0]
