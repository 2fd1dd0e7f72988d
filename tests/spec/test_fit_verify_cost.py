"""tools/fit_verify_cost.py: the verify step cost implied by spec_speed records, and the refit of the model."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from loopline.core.speculation import VERIFY_EXTRA, VERIFY_PER_QUERY, verify_step_cost

ROOT = Path(__file__).resolve().parents[2]


def _tool():
    spec = importlib.util.spec_from_file_location("fit_verify_cost", ROOT / "tools" / "fit_verify_cost.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _records(e: float, q: float, accept: float = 1.0) -> list[dict]:
    """spec_speed runs whose times follow the model with constants (e, q): R = 4, d = 1, 2C requests of 128
    tokens, plain steps of 1 ms at C = 1 and 2 ms at C = 8."""
    runs = []
    for c, step in ((1, 1e-3), (8, 2e-3)):
        tokens = 256 * c
        runs.append({"spec": None, "concurrency": c, "branch_scale": 1.0, "repeat": 0, "output_tokens": tokens,
                     "seconds": tokens / c * 4 * step, "steps_per_token": 4.0 / c})
        for k in (1, 2, 3, 6):
            length = (k + 1) * accept if c > 1 else 1 + k * accept
            rounds = tokens / c / length
            seconds = rounds * ((k + 1) + 3 * verify_step_cost(k, c, e, q)) * step
            runs.append({"spec": {"K": k, "d": 1, "pinned": True, "scheme": "draft_verify"}, "concurrency": c,
                         "branch_scale": 1.0, "repeat": 0, "output_tokens": tokens, "seconds": seconds,
                         "mean_acceptance_length": length})
    return runs


def test_the_fit_recovers_the_constants_the_times_were_made_with():
    fit = _tool()
    points = fit.implied_costs(_records(0.8, 0.15))
    assert {(p["C"], p["K"]) for p in points} == {(c, k) for c in (1, 8) for k in (1, 2, 3, 6)}
    for p in points:
        assert p["R"] == 4 and p["verify_cost"] == pytest.approx(verify_step_cost(p["K"], p["C"], 0.8, 0.15))
    assert fit.fit(points) == pytest.approx((0.8, 0.15))


def test_runs_that_cannot_be_read_are_left_out():
    fit = _tool()
    runs = _records(1.0, 0.1, accept=0.7)  # C = 8 rounds not in lockstep: only C = 1 is read
    assert {p["C"] for p in fit.implied_costs(runs)} == {1}
    unpinned = [dict(r, spec=dict(r["spec"], pinned=False)) if r["spec"] else r for r in runs]
    assert fit.implied_costs(unpinned) == []
    assert fit.implied_costs([r for r in runs if r["spec"]]) == []  # no plain run to compare with
    with pytest.raises(ValueError, match="two or more K"):
        fit.fit([p for p in fit.implied_costs(runs) if p["K"] == 3])


def test_command_line(tmp_path):
    fit = _tool()
    for e, q in ((VERIFY_EXTRA + 0.5, VERIFY_PER_QUERY), (VERIFY_EXTRA / 2, VERIFY_PER_QUERY / 2)):
        path = tmp_path / "spec.json"
        path.write_text(json.dumps({"args": {}, "runs": _records(e, q)}))
        out = subprocess.run([sys.executable, str(ROOT / "tools/fit_verify_cost.py"), str(path)], capture_output=True,
                             text=True, check=True, cwd=ROOT).stdout
        assert f"refit (least squares): VERIFY_EXTRA={e:.3f}, VERIFY_PER_QUERY={q:.3f}" in out
        above = 8 if e > VERIFY_EXTRA else 0  # every point above the model's constants, or none
        assert f"{above} of 8 measured points above the model" in out
        assert len(fit.implied_costs(_records(e, q))) == 8
