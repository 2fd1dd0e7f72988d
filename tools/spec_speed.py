"""Loop self-speculation's speed against its acceptance, on real shapes with random weights (GPU).

python3 tools/spec_speed.py --config ouro-1.4b --branch-scale 1.0,0.0 --spec 2,1 --spec 1,1 --concurrency 1
python3 tools/spec_speed.py --config demo --spec 3,1,pinned --scheme draft_verify,pipeline --concurrency 1
python3 tools/spec_speed.py --config ouro-1.4b --spec 3,1 --scheme draft_verify,pipeline --concurrency 1,8,32,128 \
    --replay-acceptance 0.89,0.71,0.68

``--replay-acceptance`` replays an acceptance pattern on random weights (loopline/spec/replay.py: each draft's
verdict is a seeded draw with the given per-position probability, e.g. the demo model's measured greedy
acceptance at d=1, 0.89 / 0.71 / 0.68; the engine does that pattern's work, its outputs are meaningless): rows
made with it are labelled ``replayed``. The pipeline's re-drafting (on by default) is judged at every loop past
the draft loop, not at the exit alone: ``--replay-changes q2,q3,...`` replays it too (the probability that loop
``l``'s greedy token differs from loop ``l - 1``'s; the demo model's, measured by ``tools/spec_acceptance.py``:
0.069, 0.029, 0.016); without it a replayed run turns re-drafting off. ``--spec 2,1,noredraft`` runs the
pipeline without re-drafting (with its verdicts at the exit drawn from ``P0``).

``--scheme`` runs every ``--spec`` once per scheme (a scheme the engine refuses is printed as refused and
skipped; the pipeline ignores K); ``--config demo`` loads the bundled model's weights
(their acceptance is real; the prompts are synthetic token ids).

Random weights give acceptance ~0: the loops' argmax tokens disagree (``loopline bench --speculative-config``
on random Ouro-1.4B weights accepts no draft). ``--branch-scale s`` multiplies every layer's residual
branches (``o_proj`` and ``down_proj``) by ``s``, the same shapes, kernels and bytes: at 0 the hidden state
never changes across loops, so every draft is accepted (the best case); at 1 almost none is (the worst).
In between, acceptance drops fast (a random model's logit margins are tiny: 0.001 accepted 10% of the
drafts on a small config), so the two ends bound what speculation can gain and lose on these shapes.
For each scale the tool runs plain decoding and each ``--spec K,d`` one after the other in one process
(the same weights), greedy, fixed depth, a closed loop of ``2 x C`` requests of ``--input-len`` prompt
tokens and ``--output-len`` generated ones, and prints output tok/s, the speedup over plain decoding,
mean steps per token, the acceptance rate and the most requests that ran at once (``max_running``: below
``C`` the KV pool, not the concurrency, bounded the batch; the KV pool is the engine's default unless
``--kv-gb`` sizes it). ``--repeat N`` runs the whole set N times, alternating plain and speculative runs, and
prints each run's speedup over the plain run before it and their median (one run each is within the noise of
a few percent). ``--json FILE`` writes the table. On a GPU each row also names the Triton kernels first launched
inside its measured loop (``compiles_in_clock``: a compile, or a load from Triton's disk cache, that the warm-up
should have left none of). ``--config tiny`` is a small config for a CPU check.
"""
from __future__ import annotations

import argparse
import functools
import gc
import json
import statistics
import time

import torch

from loopline.config import EngineArgs
from loopline.engine import LLMEngine
from loopline.errors import InvalidRequestError
from loopline.models.loader import load_model
from loopline.models.ouro import OuroConfig, OuroForCausalLM
from loopline.models.tiny import default_checkpoint, random_checkpoint_config
from loopline.sampling_params import SamplingParams
from loopline.spec.replay import AcceptanceReplay


# Triton's kernel-cache misses (tools/jit_misses.py's log, a GPU only): the measured loops' are named in their rows
COMPILES = None


def build_model(config: str, scale: float, dtype: torch.dtype, device: str) -> OuroForCausalLM:
    """A random-weight model of ``config`` (``tiny``: a small CPU config; ``demo``: the bundled demo model's
    trained weights) with its residual branches scaled."""
    if config == "demo":
        model = load_model(default_checkpoint(), dtype=dtype, device=device)
        return _scaled(model, scale)
    cfg = (OuroConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
           if config == "tiny" else random_checkpoint_config(config))
    torch.manual_seed(0)
    with torch.device(device):
        model = OuroForCausalLM(cfg).to(dtype)
    return _scaled(model, scale)


def _scaled(model: OuroForCausalLM, scale: float) -> OuroForCausalLM:
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(scale)
            layer.mlp.down_proj.weight.mul_(scale)
    return model


@functools.cache
def heldout() -> list[int]:
    """The demo model's held-out text (never trained on), encoded once per process."""
    from loopline.train.engine_eval import heldout_stream

    return heldout_stream(default_checkpoint())


def run(model: OuroForCausalLM, args: argparse.Namespace, spec: tuple | None, c: int, scheme: str = "draft_verify") -> dict:
    """One closed-loop run of ``c`` concurrent requests; returns tok/s, steps per token and the
    acceptance counters. ``spec``: ``(K, d)`` with speculation's defaults (it adapts), then any of the flags
    ``"pinned"`` (every round speculates: no adaptive stop, no batch bound) and ``"noredraft"`` (the pipeline's
    lanes keep their first draft) and ``"noguard"`` (no ``throughput_guard``)."""
    speculative = None if spec is None else {"method": "loop", "num_speculative_tokens": spec[0],
                                             "draft_loops": spec[1], "scheme": scheme}
    if spec is not None and "pinned" in spec[2:]:
        speculative |= {"adaptive": False, "disable_by_batch_size": None}
    if spec is not None and "noredraft" in spec[2:]:
        speculative["redraft"] = False
    if spec is not None and "noguard" in spec[2:]:
        speculative["throughput_guard"] = False
    # An adapter is checked against the served checkpoint's files, so with one the engine loads the demo
    # model from its directory (the same weights) instead of taking the model object.
    from_dir = spec is not None and args.draft_adapter is not None
    if from_dir:
        speculative["draft_adapter"] = args.draft_adapter
    engine = LLMEngine(EngineArgs(model=str(default_checkpoint()) if from_dir else None, device=args.device,
                                  dtype=args.dtype, skip_tokenizer_init=True, max_num_seqs=c,
                                  max_model_len=args.input_len + args.output_len + 64,
                                  kv_cache_memory_gb=args.kv_gb, speculative_config=speculative,
                                  enforce_eager=args.eager), model=None if from_dir else model)
    adapter = engine.draft_adapter  # (None: the plain coda drafts)
    if spec is not None and args.replay_acceptance:  # labelled: the verdicts are draws, the outputs meaningless
        engine.runner.spec.replay = AcceptanceReplay(args.replay_acceptance, loop_changes=args.replay_changes)
    vocab = model.config.vocab_size

    def params(i: int) -> SamplingParams:  # sampled runs: each request seeded (reproducible, the same in every run)
        return SamplingParams(max_tokens=args.output_len, temperature=args.temperature, ignore_eos=True,
                              exit_threshold=1.0, seed=i if args.temperature > 0 else None)

    def prompt(i: int) -> list[int]:  # distinct prompts: no prefix sharing
        if args.prompts == "heldout":  # held-out text, a window per request
            stream = heldout()
            at = (i * 7919 * args.input_len) % (len(stream) - args.input_len)
            return stream[at:at + args.input_len]
        return [3 + (i * 7919 + j * 31) % (vocab - 3) for j in range(args.input_len)]

    # Warm-up: the measured loop in small, on the same engine, so that every step shape it makes (Triton's
    # compiles of their launches, the graphs) comes before the clock starts: C requests at once, then each one
    # that finishes replaced while the others decode or pipeline (steps no graph holds run eagerly, in launches
    # of their own). With C warm requests of 8 tokens at once and no replacements, the first run of a
    # fresh H100 compiled inside the clock: the pipeline at C = 2 / 4 ran 1.07x / 1.28x plain, the same run
    # again 1.92x / 1.55x.
    warm = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    closed_loop(engine, c, [(f"warm{i}", prompt(10_000 + i), warm) for i in range(2 * c)])
    steps0, stats0 = engine.stats.steps, dict(engine.stats.spec_decode_metrics())
    graphs = engine.runner.graphs  # (None: eager, the CPU)
    replays0 = dict(graphs.replays) if graphs is not None else {}
    if args.device == "cuda":
        torch.cuda.synchronize()
    if COMPILES is not None:
        COMPILES.phase = "measured"
    t0 = time.perf_counter()
    tokens, max_running = closed_loop(engine, c, [(f"r{i}", prompt(i), params(i)) for i in range(2 * c)])
    if args.device == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    compiled = [] if COMPILES is None else [m[0] for m in COMPILES.misses.pop("measured", [])]
    if COMPILES is not None:
        COMPILES.phase = "outside the clock"
    spec_now, steps = engine.stats.spec_decode_metrics(), engine.stats.steps
    # steps of the measured part that replayed a graph, per family; the rest ran eagerly
    replays = {f: n - replays0.get(f, 0) for f, n in (graphs.replays.items() if graphs is not None else ())}
    replays = {f: n for f, n in replays.items() if n}
    del engine, graphs  # its KV pool and graphs: the next run's engine sizes its pool from the free memory
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    drafts = {k: spec_now[k] - stats0[k] for k in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                                                   "vllm:spec_decode_num_accepted_tokens")}
    rounds = drafts["vllm:spec_decode_num_drafts"]
    return {"spec": None if spec is None else {"K": spec[0], "d": spec[1], "pinned": "pinned" in spec[2:],
                                               "redraft": "noredraft" not in spec[2:],
                                               "throughput_guard": "noguard" not in spec[2:],
                                               "scheme": scheme, "replayed": args.replay_acceptance,
                                               "replayed_changes": args.replay_changes,
                                               "draft_adapter": None if adapter is None else args.draft_adapter},
            "concurrency": c, "temperature": args.temperature, "max_running": max_running, "output_tokens": tokens,
            "seconds": round(elapsed, 4), "output_tok_s": round(tokens / elapsed, 2),
            "steps_per_token": round((steps - steps0) / tokens, 3),
            "steps": steps - steps0, "graph_replays": replays, "eager_steps": steps - steps0 - sum(replays.values()),
            "compiles_in_clock": compiled,
            "draft_tokens": drafts["vllm:spec_decode_num_draft_tokens"],
            "accepted_tokens": drafts["vllm:spec_decode_num_accepted_tokens"],
            # vLLM's mean acceptance length: tokens a round commits, its accepted drafts and the one it adds
            "mean_acceptance_length": (round(1 + drafts["vllm:spec_decode_num_accepted_tokens"] / rounds, 3)
                                       if rounds else None),
            "acceptance_rate": (round(drafts["vllm:spec_decode_num_accepted_tokens"]
                                      / drafts["vllm:spec_decode_num_draft_tokens"], 3)
                                if drafts["vllm:spec_decode_num_draft_tokens"] else None)}


def closed_loop(engine: LLMEngine, c: int, requests: list[tuple[str, list[int], SamplingParams]]) -> tuple[int, int]:
    """Runs ``requests`` with ``c`` in flight (the first ``c`` at once, the next whenever one finishes); returns the
    output tokens and the most requests that ran at once."""
    pending = list(reversed(requests))
    for _ in range(min(c, len(pending))):
        engine.add_request(*pending.pop())
    tokens = max_running = 0
    while engine.has_unfinished_requests():
        max_running = max(max_running, engine.scheduler.num_running)
        for out in engine.step():
            if out.finished:
                tokens += len(out.outputs[0].token_ids)
                if pending:
                    engine.add_request(*pending.pop())
    return tokens, max_running


def parse_spec(text: str) -> tuple:
    parts = text.split(",")
    if len(parts) < 2 or not set(parts[2:]) <= {"pinned", "noredraft", "noguard"}:
        raise SystemExit(f"--spec {text!r}: takes K,d then any of pinned, noredraft, noguard (e.g. --spec 2,1 or "
                         "2,1,noredraft)")
    return (int(parts[0]), int(parts[1]), *parts[2:])


def run_set(model: OuroForCausalLM, args: argparse.Namespace, scale: float, c: int, specs: list, schemes: list,
            rep: int) -> list[dict]:
    """Plain decoding, then every (scheme, spec) once; each row's speedup is over this set's plain run."""
    rows, base = [], None
    for scheme, spec in [(None, None), *((x, spec) for x in schemes for spec in specs)]:
        try:
            r = run(model, args, spec, c, scheme) | {"branch_scale": scale, "repeat": rep}
        except InvalidRequestError as e:  # a scheme the engine does not run: say so, measure the rest
            what = "plain" if spec is None else f"{scheme} K={spec[0]} d={spec[1]}"
            print(f"scale {scale:<5} C={c:<4} {what}: refused: {e}", flush=True)
            continue
        base = base or r["output_tok_s"]
        r["speedup"] = round(r["output_tok_s"] / base, 3)
        rows.append(r)
        print(f"scale {scale:<5} C={c:<4} {_name(r):<22} {r['output_tok_s']:9.1f} tok/s  {r['speedup']:5.2f}x  "
              f"{r['steps_per_token']:5.2f} steps/token  acceptance {r['acceptance_rate']}  "
              f"length {r['mean_acceptance_length']}  "
              f"max running {r['max_running']}  eager steps {r['eager_steps']}/{r['steps']}"
              + ("  (KV-bound: below C)" if r["max_running"] < c else "")
              + (f"  compiled in the clock: {', '.join(r['compiles_in_clock'])}" if r["compiles_in_clock"] else ""),
              flush=True)
    return rows


def _name(r: dict) -> str:
    spec = r["spec"]
    if spec is None:
        return "plain"
    prefix = {"pipeline": "pipe ", "auto": "auto "}.get(spec["scheme"], "")
    return (f"{prefix}K={spec['K']} d={spec['d']}"
            + (" pinned" if spec["pinned"] else "")
            + ("" if spec.get("redraft", True) else " no-redraft")
            + (" no-guard" if not spec.get("throughput_guard", True) and not spec["pinned"] else "")
            + (f" replayed {','.join(map(str, spec['replayed']))}" if spec.get("replayed") else "")
            + (f" changes {','.join(map(str, spec['replayed_changes']))}"
               if spec.get("replayed_changes") and spec["scheme"] != "draft_verify" and spec.get("redraft", True)
               else ""))


def print_medians(rows: list[dict]) -> None:
    """The median speedup of each configuration over its repeats."""
    by: dict[str, list[float]] = {}
    for r in rows:
        by.setdefault(_name(r), []).append(r["speedup"])
    for name, ups in by.items():
        if name != "plain":
            print(f"  median over {len(ups)} repeats: {name} {statistics.median(ups):.3f}x "
                  f"(each: {', '.join(f'{u:.3f}' for u in ups)})", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="ouro-1.4b",
                    help="ouro-1.4b, ouro-2.6b, tiny (a small CPU config) or demo (the bundled model's weights)")
    ap.add_argument("--branch-scale", default="1.0", help="comma-separated residual-branch scales")
    ap.add_argument("--spec", action="append", default=[],
                    help="K,d (speculation's defaults: it adapts), then any of pinned (every round speculates), noredraft "
                         "(the pipeline's lanes keep their first draft) and noguard (throughput_guard off: the cost model "
                         "alone decides); "
                         "repeatable; plain decoding always runs")
    ap.add_argument("--scheme", default="draft_verify",
                    help="comma-separated speculative_config.scheme values (draft_verify, pipeline, auto), each run with "
                         "every --spec (pipeline: K is unused; docs/speculation.md)")
    ap.add_argument("--concurrency", default="1", help="comma-separated concurrencies")
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kv-gb", type=float, default=None,
                    help="KV pool in GiB (default: the engine's; on CUDA what gpu_memory_utilization leaves)")
    ap.add_argument("--repeat", type=int, default=1, help="runs of the whole set, plain and speculative alternating")
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--prompts", choices=["synthetic", "heldout"], default="synthetic",
                    help="prompt token ids: synthetic (distinct, no shared prefix) or, with --config demo, windows "
                         "of the demo model's held-out text (never trained on: its drafts' real acceptance)")
    ap.add_argument("--draft-adapter", default=None,
                    help="speculative_config.draft_adapter: a trained draft adapter's directory (loopline train draft)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sampling temperature of every request (0: greedy; above 0 each request has its own seed)")
    ap.add_argument("--replay-acceptance", default=None,
                    type=lambda v: [float(x) for x in v.split(",")],
                    help="P0,P1,...: speculative runs accept the draft at round position j with probability Pj "
                         "instead of comparing it with the target (the pipeline: P0 for every lane); the cost of an "
                         "acceptance pattern on random weights (loopline/spec/replay.py), labelled 'replayed'")
    ap.add_argument("--replay-changes", default=None,
                    type=lambda v: [float(x) for x in v.split(",")],
                    help="q2,q3,...: with --replay-acceptance, the pipeline's re-drafting replayed too: loop l's token "
                         "differs from loop l-1's with probability ql (loops past the draft loop; the last entry for "
                         "deeper loops); without it a replayed run does not re-draft")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.replay_changes is not None and args.replay_acceptance is None:
        raise SystemExit("--replay-changes: replays re-drafting within a replayed run (--replay-acceptance)")
    if args.device == "cuda":  # (the CPU runs no Triton kernels)
        from jit_misses import MissLog  # (tools/, beside this script)

        global COMPILES
        COMPILES = MissLog().install()
    if args.draft_adapter is not None and args.config != "demo":
        raise SystemExit("--draft-adapter: an adapter is trained for the demo model (--config demo)")
    if args.prompts == "heldout" and args.config != "demo":
        raise SystemExit("--prompts heldout: held-out text is the demo model's (--config demo)")
    specs = [parse_spec(s) for s in args.spec]
    schemes = args.scheme.split(",")
    rows = []
    for scale in (float(s) for s in args.branch_scale.split(",")):
        model = build_model(args.config, scale, getattr(torch, args.dtype), args.device)
        for c in (int(v) for v in args.concurrency.split(",")):
            for rep in range(args.repeat):
                rows += run_set(model, args, scale, c, specs, schemes, rep)
            if args.repeat > 1:
                print_medians([r for r in rows if r["branch_scale"] == scale and r["concurrency"] == c])
        del model
        if args.device == "cuda":
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": rows}, f, indent=2)


if __name__ == "__main__":
    main()
