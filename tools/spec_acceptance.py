"""Acceptance of loop self-speculation on the bundled demo model, and what it predicts (issue #41).

    python tools/spec_acceptance.py [--prompts 16] [--new-tokens 128] [--windows 16] [--record PATH]
                                    [--draft-adapter DIR]
    python tools/spec_acceptance.py --loop-changes [--prompts 16] [--new-tokens 128]

Two measurements, both fp32 on the CPU, both from the dense model (``forward_dense``, every loop):

* **generated** (exact for greedy at fixed depth): ``--prompts`` prompts of 32 held-out tokens, each
  continued greedily at full depth (``plain_generate``); the dense forward of prompt + continuation gives,
  per generated token, whether the head of loop ``d`` at the previous position picks the same token
  (a draft at fixed depth reads only loops ``1..d``, which are the target's own, so this is exactly the
  draft that speculation would make there). Rounds of draft-then-verify and the depth pipeline are replayed
  over these matches (``loopline.spec.cost``): per-position acceptance given the accepted prefix, tokens
  per round, loop passes per token.
* **teacher-forced on held-out text**: ``--windows`` windows of 512 held-out tokens; the same match rate
  and the overlap ``sum(min(p_d, p_R))`` at T=1 and T=0.5 (the acceptance rate of rejection sampling for
  one draft token in that context). Held-out text is not what the model samples, so these are estimates
  of the sampling acceptance, not replays of it.

Prints markdown tables; ``--record`` writes the per-position acceptance as JSON.
"""
from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from loopline.models.loader import load_model
from loopline.models.plain import plain_generate
from loopline.models.tiny import default_checkpoint
from loopline.spec import cost
from loopline.train.engine_eval import heldout_stream

KS = range(1, 9)
#: H200 decode step per loop on Ouro-1.4B shapes (ms) by rows in the step, as measured for issue #41;
#: 3 rows is interpolated between the measured 2 and 4.
H200_STEP_MS = {1: 0.93, 2: 1.53, 3: (1.53 + 1.74) / 2, 4: 1.74}


def draft_logits(model, out, adapter=None):
    """``[R, T, V]`` fp32 logits of each loop of a one-sequence dense forward; with a trained draft adapter
    (``loopline.spec.adapter``), loop ``d``'s logits are the head of its adapted state for each depth
    ``d`` it holds, as the engine's drafts are (the last loop, the target, is never adapted)."""
    if adapter is None:
        return out.logits[:, 0]
    hidden = out.hidden_states[:, 0]  # [R, T, H]
    rows = [adapter(hidden[r], r + 1) if r + 1 in adapter.depths else hidden[r] for r in range(hidden.shape[0])]
    return model.head(torch.stack(rows)).float()


@torch.no_grad()
def generated_matches(model, stream: list[int], prompts: int, prompt_len: int, new_tokens: int,
                      adapter=None) -> dict[int, list[list[bool]]]:
    """Per draft depth: one match list per generated sequence (index 0, the prefill's token, is unused).
    ``adapter``: drafts from the trained draft adapter's logits (:func:`draft_logits`)."""
    loops = model.config.total_ut_steps
    stride = len(stream) // prompts
    out: dict[int, list[list[bool]]] = {d: [] for d in range(1, loops)}
    for i in range(prompts):
        prompt = stream[i * stride:i * stride + prompt_len]
        gen = plain_generate(model, prompt, new_tokens, exit_threshold=1.0).tokens
        ids = torch.tensor([prompt + gen])
        logits = draft_logits(model, model.forward_dense(ids), adapter)  # [R, T, V]
        greedy = logits.argmax(-1)  # [R, T]
        # Token j of gen is predicted at position prompt_len - 1 + j.
        cols = torch.arange(prompt_len - 1, prompt_len - 1 + len(gen))
        assert greedy[-1, cols].tolist() == gen, "the dense forward disagrees with plain_generate"
        for d in out:
            out[d].append([True] + (greedy[d - 1, cols[1:]] == greedy[-1, cols[1:]]).tolist())
    return out


@torch.no_grad()
def heldout_overlap(model, stream: list[int], windows: int, seq_len: int,
                    adapter=None) -> tuple[dict, dict[int, list[list[bool]]]]:
    """Per draft depth on held-out windows: greedy match rate and overlap at T=1 and T=0.5, and the match
    lists (as if each window's text were the target's greedy output)."""
    loops = model.config.total_ut_steps
    stride = len(stream) // windows
    sums = {d: {"match": 0.0, "overlap_t1": 0.0, "overlap_t05": 0.0} for d in range(1, loops)}
    seqs: dict[int, list[list[bool]]] = {d: [] for d in range(1, loops)}
    count = 0
    for i in range(windows):
        ids = torch.tensor([stream[i * stride:i * stride + seq_len]])
        logits = draft_logits(model, model.forward_dense(ids), adapter)  # [R, T, V]
        count += logits.shape[1]
        for d in sums:
            match = logits[d - 1].argmax(-1) == logits[-1].argmax(-1)
            sums[d]["match"] += float(match.sum())
            seqs[d].append([True] + match[:-1].tolist())
            for key, t in (("overlap_t1", 1.0), ("overlap_t05", 0.5)):
                p, q = torch.softmax(logits[-1] / t, -1), torch.softmax(logits[d - 1] / t, -1)
                sums[d][key] += float(torch.minimum(p, q).sum())
    return {d: {k: v / count for k, v in s.items()} | {"positions": count} for d, s in sums.items()}, seqs


def adaptive_rounds(model, stream: list[int], prompts: int, prompt_len: int, new_tokens: int,
                    threshold: float) -> None:
    """Prints draft-then-verify rounds of the reference (``speculative_generate``) at an adaptive exit
    threshold: exact, but few tokens (it runs the model per round in Python)."""
    from loopline.spec import SpeculativeConfig
    from loopline.spec.reference import speculative_generate

    stride = len(stream) // prompts
    print(f"\n## draft then verify at exit threshold {threshold} (reference runs, exact; {prompts} x {new_tokens} "
          "greedy tokens)\n")
    print("| d | K | drafts accepted | tokens per round | mean exit depth | tokens exited by loop d |")
    print("|---|---|---|---|---|---|")
    for d in (1, 2):
        for k in (2, 4):
            spec = SpeculativeConfig(scheme="draft_verify", num_speculative_tokens=k, draft_loops=d)
            drafts = accepted = rounds = tokens = early = 0
            depth = 0
            for i in range(prompts):
                prompt = stream[i * stride:i * stride + prompt_len]
                out = speculative_generate(model, prompt, new_tokens, spec, exit_threshold=threshold)
                drafts, accepted, rounds = drafts + sum(out.drafts), accepted + sum(out.accepted), rounds + len(out.drafts)
                tokens += len(out.tokens) - 1
                depth += sum(out.exit_loops[1:])
                early += sum(e <= d for e in out.exit_loops[1:])
            print(f"| {d} | {k} | {accepted / drafts:.3f} | {(accepted + rounds) / rounds:.2f} | {depth / tokens:.2f} | "
                  f"{early / tokens:.3f} |")


@torch.no_grad()
def loop_changes(model, stream: list[int], prompts: int, prompt_len: int, new_tokens: int) -> None:
    """Prints, over greedy continuations at fixed depth (as :func:`generated_matches` makes them), how often each
    loop's greedy token differs from the loop before's (what re-drafting acts on; ``tools/spec_speed.py
    --replay-changes`` replays these rates), the joint patterns of those changes, and how often loop 1's token is
    the last loop's (what a draft at d = 1 without re-drafting needs)."""
    loops = model.config.total_ut_steps
    stride = len(stream) // prompts
    patterns: dict[tuple[int, ...], int] = {}
    same_first = 0
    for i in range(prompts):
        prompt = stream[i * stride:i * stride + prompt_len]
        gen = plain_generate(model, prompt, new_tokens, exit_threshold=1.0).tokens
        greedy = model.forward_dense(torch.tensor([prompt + gen])).logits[:, 0].argmax(-1)  # [R, T]
        # the tokens after the prefill's: each one's head at every loop, at the position before it
        heads = greedy[:, torch.arange(prompt_len, prompt_len - 1 + len(gen))]
        assert heads[-1].tolist() == gen[1:], "the dense forward disagrees with plain_generate"
        for t in range(heads.shape[1]):
            key = tuple(int(heads[r, t] != heads[r - 1, t]) for r in range(1, loops))
            patterns[key] = patterns.get(key, 0) + 1
            same_first += int(heads[0, t] == heads[-1, t])
    n = sum(patterns.values())
    print(f"# loop changes, demo model: {prompts} x {new_tokens} greedy tokens at fixed depth ({n} tokens)\n")
    print("| loop | token differs from the loop before's |")
    print("|---|---|")
    for r in range(1, loops):
        print(f"| {r + 1} | {sum(c for k, c in patterns.items() if k[r - 1]) / n:.3f} |")
    print(f"\nloop 1's token is loop {loops}'s: {same_first / n:.3f}\n")
    print("| changes at loops " + ", ".join(str(r + 1) for r in range(1, loops)) + " | share |")
    print("|---|---|")
    for key, c in sorted(patterns.items()):
        print(f"| {key} | {c / n:.4f} |")


def per_position(seqs: list[list[bool]], k: int) -> list[float]:
    """Acceptance of draft i (1..k) of a draft-then-verify round given drafts 1..i-1 were accepted."""
    reached, accepted = [0] * k, [0] * k
    for m in seqs:
        t = 0
        while t < len(m) - 1:
            i = 0
            while i < k and t + i + 1 < len(m):
                reached[i] += 1
                if not m[t + i + 1]:
                    break
                accepted[i] += 1
                i += 1
            t += min(i + 1, len(m) - 1 - t)
    return [a / r if r else float("nan") for a, r in zip(accepted, reached)]


def replay_tables(label: str, seqs: dict[int, list[list[bool]]], loops: int, plain_ms: float) -> dict:
    """Prints the per-position, draft-then-verify and pipeline tables of one source; returns them."""
    print(f"\n## per-position acceptance given the accepted prefix ({label}, K=8)\n")
    print("| d | " + " | ".join(f"draft {i}" for i in KS) + " |")
    print("|---|" + "---|" * len(KS))
    positions = {d: per_position(seqs[d], max(KS)) for d in seqs}
    for d, acc in positions.items():
        print(f"| {d} | " + " | ".join(f"{a:.3f}" for a in acc) + " |")

    print(f"\n## draft then verify ({label}): tokens per round / loop passes per token / H200-predicted ms "
          f"per token (plain: {loops} passes, {plain_ms:.2f} ms)\n")
    print("| d | " + " | ".join(f"K={k}" for k in KS) + " |")
    print("|---|" + "---|" * len(KS))
    table: dict[int, dict[int, dict]] = {}
    for d in seqs:
        cells, table[d] = [], {}
        for k in KS:
            r = _sum([cost.draft_verify(m, k, d, loops) for m in seqs[d]])
            ms = r.time(H200_STEP_MS)
            table[d][k] = {"tokens_per_round": r.tokens / r.rounds, "passes_per_token": r.passes_per_token,
                           "h200_ms_per_token": None if ms is None else ms / r.tokens}
            cells.append(f"{r.tokens / r.rounds:.2f} / {r.passes_per_token:.2f} / {_ms(r)}")
        print(f"| {d} | " + " | ".join(cells) + " |")

    print(f"\n## depth pipeline ({label}): loop passes per token, speedup in passes, rows per step, "
          "H200-predicted ms per token\n")
    print("| d | passes/token | vs plain | steps by rows | ms/token | vs plain |")
    print("|---|---|---|---|---|---|")
    pipe = {}
    for d in seqs:
        r = _sum([cost.pipeline(m, d, loops) for m in seqs[d]])
        t = r.time(H200_STEP_MS) / r.tokens
        pipe[d] = {"passes_per_token": r.passes_per_token, "rows": dict(sorted(r.rows.items()))}
        rows = ", ".join(f"{n}: {c}" for n, c in sorted(r.rows.items()))
        print(f"| {d} | {r.passes_per_token:.2f} | {loops / r.passes_per_token:.2f}x | {rows} | {t:.2f} | "
              f"{plain_ms / t:.2f}x |")
    return {"per_position_acceptance": {str(d): a for d, a in positions.items()},
            "draft_verify": {str(d): {str(k): v for k, v in t.items()} for d, t in table.items()},
            "pipeline": {str(d): v for d, v in pipe.items()}}


def _sum(replays: list[cost.Replay]) -> cost.Replay:
    total = cost.Replay()
    for r in replays:
        total.tokens += r.tokens
        total.rows.update(r.rows)
        total.rounds += r.rounds
        total.accepted += r.accepted
    return total


def _ms(replay: cost.Replay) -> str:
    t = replay.time(H200_STEP_MS)
    return "n/a" if t is None else f"{t / replay.tokens:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--record", type=Path)
    ap.add_argument("--draft-adapter", type=Path, metavar="DIR",
                    help="also measure drafts through the trained draft adapter in DIR (loopline train draft), "
                         "each table without and with it")
    ap.add_argument("--loop-changes", action="store_true",
                    help="instead: how often each loop's greedy token differs from the loop before's (re-drafting; "
                         "tools/spec_speed.py --replay-changes)")
    ap.add_argument("--adaptive", type=float, metavar="THRESHOLD",
                    help="instead: draft-then-verify reference runs at this exit threshold (4 prompts x 48 tokens)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    t0 = time.time()
    model_dir = default_checkpoint()
    model = load_model(model_dir, dtype=torch.float32).eval()
    loops = model.config.total_ut_steps
    stream = heldout_stream(model_dir)
    if args.loop_changes:
        loop_changes(model, stream, args.prompts, args.prompt_len, args.new_tokens)
        return
    if args.adaptive is not None:
        adaptive_rounds(model, stream, 4, args.prompt_len, 48, args.adaptive)
        return
    variants = {"plain coda": None}
    if args.draft_adapter is not None:
        from loopline.spec.adapter import load_adapter

        variants["draft adapter"] = load_adapter(args.draft_adapter, model.config.hidden_size, loops)[0]
    plain_ms = cost.plain(1, loops).time(H200_STEP_MS)
    print(f"# demo model, {loops} loops; generated: {args.prompts} x {args.new_tokens} greedy tokens; "
          f"held-out: {args.windows} x {args.seq_len} tokens\n")
    results = {}
    for name, adapter in variants.items():
        gen = generated_matches(model, stream, args.prompts, args.prompt_len, args.new_tokens, adapter)
        held, held_seqs = heldout_overlap(model, stream, args.windows, args.seq_len, adapter)
        print(f"\n# drafts: {name}\n")
        print("| d | match, generated | match, held-out | overlap T=1, held-out | overlap T=0.5, held-out |")
        print("|---|---|---|---|---|")
        for d in gen:
            rate = sum(sum(m[1:]) for m in gen[d]) / sum(len(m) - 1 for m in gen[d])
            h = held[d]
            print(f"| {d} | {rate:.3f} | {h['match']:.3f} | {h['overlap_t1']:.3f} | {h['overlap_t05']:.3f} |")
        results[name] = (held, {"generated": replay_tables("generated, exact", gen, loops, plain_ms),
                                "heldout": replay_tables("held-out text, teacher-forced: an estimate", held_seqs,
                                                         loops, plain_ms)})
    held, tables = results["plain coda"]
    print(f"\n({time.time() - t0:.0f} s)")

    if args.record:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], check=False, cwd=ROOT, capture_output=True, text=True).stdout.strip()
        record = {
            "what": "greedy draft acceptance of loop self-speculation, demo model, fixed depth (issue #41)",
            "command": "python tools/spec_acceptance.py " + " ".join(sys.argv[1:]),
            "commit": commit, "host": platform.processor() or platform.machine(), "loops": loops,
            "generated": {"source": "greedy full-depth continuations of held-out prompts; matches from the "
                                    "dense forward (exact for greedy at fixed depth)"} | tables["generated"],
            "heldout": {"source": "held-out text teacher-forced (an estimate: not the model's own output)",
                        "overlap": {str(d): v for d, v in held.items()}} | tables["heldout"],
        }
        if args.draft_adapter is not None:
            a_held, a_tables = results["draft adapter"]
            record["draft_adapter"] = {"dir": str(args.draft_adapter), "generated": a_tables["generated"],
                                       "heldout": {"overlap": {str(d): v for d, v in a_held.items()}}
                                       | a_tables["heldout"]}
        args.record.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
