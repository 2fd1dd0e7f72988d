"""What a verify step costs, read off `tools/spec_speed.py` records, and the verify-cost model refitted.

`loopline.core.speculation.round_cost` prices a draft-then-verify round in plain decoding steps: each of the
`(K+1)·d` draft steps costs one plain step, each of the `R-d` verify steps (`K+1` queries a request)

    v(K, C) = 1 + (VERIFY_EXTRA + VERIFY_PER_QUERY * (K+1)) / C**0.25

plain steps at `C` running requests. A pinned run (every round speculates, `K` drafts) at fixed depth `R`
commits `mean_acceptance_length` tokens a round, so with the plain run of the same set (its time per token
gives the plain step `p`, `R` steps a token):

    seconds = rounds * ((K+1)·d + (R-d)·v) * p,   rounds = tokens / mean_acceptance_length   (per request slot)

which this tool solves for `v`. At `C > 1` the requests share steps, so the formula holds only when they
run their rounds in lockstep: every round accepting every draft (`--replay-acceptance 1.0`; a mean
acceptance length of at least 0.9·(K+1), since `max_tokens` may cut a request's last round); other `C > 1`
runs are left out. Prefill time counts in both runs and is ignored.
Then `(v - 1)·C**0.25 = E + Q·(K+1)` is fitted by least squares over the kept runs, and the model's current
constants are checked against every point (they should be at or above each: speculation then stops
rather than cost throughput).

    python3 tools/spec_speed.py --config ouro-1.4b --replay-acceptance 1.0 \\
        --spec 1,1,pinned --spec 2,1,pinned --spec 3,1,pinned --spec 4,1,pinned --spec 6,1,pinned \\
        --concurrency 1,4,8 --json spec_k.json
    python3 tools/fit_verify_cost.py spec_k.json [more.json ...]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

from loopline.core.speculation import VERIFY_EXTRA, VERIFY_PER_QUERY, verify_step_cost


def implied_costs(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each usable pinned draft-then-verify run's verify step cost ``v`` in plain steps, against the plain run
    (``spec`` None) of the same concurrency, branch scale and repeat that precedes it."""
    plain: dict[tuple, dict[str, Any]] = {}
    out = []
    for r in runs:
        key = (r["concurrency"], r.get("branch_scale"), r.get("repeat", 0))
        spec = r.get("spec")
        if spec is None:
            plain[key] = r
            continue
        base = plain.get(key)
        if base is None or not spec.get("pinned") or spec.get("scheme", "draft_verify") != "draft_verify":
            continue
        c, k, d = r["concurrency"], spec["K"], spec["d"]
        accepted = r.get("mean_acceptance_length")
        lockstep = accepted is not None and accepted >= 0.9 * (k + 1)  # (a cut last round: slightly below)
        if accepted is None or (c > 1 and not lockstep):
            continue
        depth = round(base["steps_per_token"] * c)  # plain decoding: R steps per token, C tokens a step
        if depth <= d:
            continue
        tokens = base["output_tokens"] / c  # per request slot
        p = base["seconds"] / (tokens * depth)
        rounds = tokens / accepted
        v = (r["seconds"] / p - rounds * (k + 1) * d) / (rounds * (depth - d))
        out.append({"C": c, "K": k, "d": d, "R": depth, "acceptance_length": accepted, "verify_cost": v})
    return out


def fit(points: list[dict[str, Any]]) -> tuple[float, float]:
    """Least-squares ``(E, Q)`` of ``(v - 1)·C**0.25 = E + Q·(K+1)`` over ``points``."""
    if len({p["K"] for p in points}) < 2:
        raise ValueError("fitting needs pinned runs at two or more K")
    a = np.array([[1.0, p["K"] + 1.0] for p in points])
    b = np.array([(p["verify_cost"] - 1.0) * p["C"] ** 0.25 for p in points])
    (e, q), *_ = np.linalg.lstsq(a, b, rcond=None)
    return float(e), float(q)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("records", nargs="+", help="JSON records of tools/spec_speed.py (--json)")
    args = ap.parse_args()
    points = [p for path in args.records for p in implied_costs(json.loads(Path(path).read_text())["runs"])]
    if not points:
        raise SystemExit("no usable runs: pinned draft_verify runs after a plain run, at C=1 or accepting every draft")
    e, q = fit(points)
    print(f"{'C':>4} {'K':>3} {'d':>2} {'accept len':>10} {'v measured':>10} {'v model now':>11} {'v refit':>8}")
    for p in sorted(points, key=lambda p: (p["C"], p["K"])):
        print(f"{p['C']:>4} {p['K']:>3} {p['d']:>2} {p['acceptance_length']:>10.2f} {p['verify_cost']:>10.2f} "
              f"{verify_step_cost(p['K'], p['C']):>11.2f} {verify_step_cost(p['K'], p['C'], e, q):>8.2f}")
    below = [p for p in points if verify_step_cost(p["K"], p["C"]) < p["verify_cost"]]
    print(f"now: VERIFY_EXTRA={VERIFY_EXTRA}, VERIFY_PER_QUERY={VERIFY_PER_QUERY}; "
          f"{len(below)} of {len(points)} measured points above the model")
    print(f"refit (least squares): VERIFY_EXTRA={e:.3f}, VERIFY_PER_QUERY={q:.3f}")


if __name__ == "__main__":
    main()
