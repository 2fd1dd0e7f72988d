"""``loopline train pretrain``, ``curve``, ``grpo``, ``lookahead`` and ``draft``: one command per run.

Imports only the standard library at module level (``loopline --help`` loads it); torch and the
trainer are imported when the command runs.

Builds the corpus, tokenizer and token streams from the :class:`TrainConfig`,
trains both stages (saving resumable checkpoints every ``--save-every`` steps),
evaluates on the held-out split, picks the exit threshold from the
depth-vs-loss curve and exports a checkpoint directory ``loopline.LLM`` loads.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import platform
import time
from pathlib import Path
from typing import Any

from loopline.entrypoints.cli_args import HelpFormatter, positive_int
from loopline.errors import InvalidRequestError
from loopline.train.presets import PRESETS, SHIPPED_PRESET, build_config  # stdlib only at import

HELP = "train the demo looped model (Ouro objective) on the offline corpus, or fine-tune a checkpoint with GRPO"

def add_parser(sub: Any) -> None:
    """Adds ``train`` (with its ``pretrain`` subcommand) to the ``loopline`` parser."""
    train = sub.add_parser("train", help=HELP, formatter_class=HelpFormatter)
    tsub = train.add_subparsers(dest="train_command", metavar="{pretrain,curve,grpo,lookahead,draft}")
    tsub.required = True
    p = tsub.add_parser("pretrain", help="stage 1 (expected loss + entropy) then stage 2 (gate only), then export",
                        formatter_class=HelpFormatter)
    p.add_argument("--out", required=True, help="checkpoint directory to export (config.json, safetensors, tokenizer)")
    p.add_argument("--preset", choices=sorted(PRESETS), default=SHIPPED_PRESET,
                   help="named TrainConfig (the default reproduces the bundled model)")
    p.add_argument("--config-file", help="JSON file of TrainConfig fields (applied over the preset)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override one TrainConfig field, dotted for nested ones (model.hidden_size=128); repeatable")
    p.add_argument("--checkpoint-dir", help="where resumable training state is saved (default: OUT.train_state beside OUT, so "
                        "the exported directory holds only what ships)")
    p.add_argument("--save-every", type=int, default=500, help="save the training state every N steps (0: only at the end)")
    p.add_argument("--resume", action="store_true", help="continue the run saved in --checkpoint-dir (its config wins)")
    p.add_argument("--device", default="auto", help="'auto' (cuda when available), 'cpu', 'cuda' or 'cuda:N'")
    p.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--log-every", type=int, default=50, help="print a JSON line of metrics every N steps")
    p.add_argument("--eval-every", type=int, default=0,
                   help="print the held-out loss of every loop every N steps (0: only at the end); for watching "
                        "over-fitting, it never changes the run")
    p.add_argument("--exit-threshold", type=float, default=None,
                   help="early_exit_threshold to export (default: chosen from the held-out depth-vs-loss curve)")
    p.add_argument("--threshold-tolerance", type=float, default=0.05,
                   help="the chosen threshold is the one of least mean depth whose held-out loss is within this "
                        "many nats of full depth")
    p.set_defaults(func=run_pretrain)

    c = tsub.add_parser("curve", help="the exit threshold vs held-out loss curve, measured through the engine "
                                      "(and the dense model for comparison)", formatter_class=HelpFormatter)
    c.add_argument("--model", default=None, help="checkpoint directory (default: the bundled demo model)")
    c.add_argument("--out", help="write the JSON here (default: print it)")
    c.add_argument("--seq-len", type=positive_int, default=512, help="tokens per held-out window (the training eval's 512)")
    c.add_argument("--max-windows", type=int, default=160,
                   help="use the first N windows of the held-out stream (the bundled model's card: 160, 82k "
                        "tokens; its whole split is 1.6M tokens, hours on a CPU); 0: the whole split")
    c.add_argument("--thresholds", default=",".join(str(q) for q in (0.3, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)),
                   help="comma-separated exit thresholds in (0, 1]")
    c.add_argument("--device", default="auto", help="'auto' (cuda when available), 'cpu' or 'cuda:N'")
    c.add_argument("--kv-layout", default="last_exited", choices=["last_exited", "shared"])
    c.set_defaults(func=run_curve)
    _add_grpo_parser(tsub, HelpFormatter)
    _add_lookahead_parser(tsub, HelpFormatter)
    _add_draft_parser(tsub, HelpFormatter)


def _add_draft_parser(tsub: Any, formatter: Any) -> None:
    dr = tsub.add_parser("draft", help="distil a draft adapter for loop self-speculation from the full-depth "
                         "distribution, on the frozen model (docs/training.md)", formatter_class=formatter)
    dr.add_argument("--model", default=None, help="checkpoint directory (default: the bundled demo model)")
    dr.add_argument("--out", default=None, help="where draft_adapter.safetensors and draft_adapter.json go (default: "
                    "--model, where the engine finds it; required with the bundled model, whose directory is part "
                    "of the install)")
    dr.add_argument("--report", default=None, help="also write the held-out evaluation JSON here")
    dr.add_argument("--depths", default=None, help="comma-separated draft depths (default: 1..loops-1)")
    dr.add_argument("--rank", type=positive_int, default=16, help="rank of each depth's low-rank residual")
    _add_window_args(dr, calib="each depth's stopping epoch", heldout=32, epochs=4)
    dr.add_argument("--lr", type=float, default=1e-3)
    dr.set_defaults(func=run_draft)


def _add_window_args(parser: argparse.ArgumentParser, *, calib: str, heldout: int, epochs: int) -> None:
    """The corpus windows, epochs, seed and threads of a small trainer on the frozen model (draft, lookahead)."""
    parser.add_argument("--seq-len", type=positive_int, default=256, help="tokens per window")
    parser.add_argument("--train-windows", type=positive_int, default=96, help="training-split windows to fit on")
    parser.add_argument("--calib-windows", type=positive_int, default=32,
                        help=f"further training-split windows that pick {calib}")
    parser.add_argument("--heldout-windows", type=positive_int, default=heldout, help="held-out windows, only evaluated")
    parser.add_argument("--epochs", type=positive_int, default=epochs)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (default: torch's)")


def _model_and_out(ns: argparse.Namespace) -> tuple[Path, Path]:
    """A side-file trainer's checkpoint (default: the bundled model) and where its files go (default: beside the
    weights, which the bundled model's install directory must not be); sets torch's threads."""
    import torch

    from loopline.models.tiny import default_checkpoint

    if ns.out is None and ns.model is None:
        raise InvalidRequestError("--out is required with the bundled model (its directory is part of the install)")
    if ns.model is not None and not Path(ns.model, "config.json").is_file():
        raise FileNotFoundError(f"--model {ns.model}: no config.json there (a checkpoint directory)")
    if ns.threads:
        torch.set_num_threads(ns.threads)
    model = Path(ns.model) if ns.model else default_checkpoint()
    return model, Path(ns.out or model)


def run_draft(ns: argparse.Namespace) -> int:
    from loopline.train.draft import run

    try:
        depths = None if ns.depths is None else [int(x) for x in ns.depths.split(",")]
    except ValueError:
        raise InvalidRequestError(f"--depths {ns.depths!r}; allowed: comma-separated integers") from None
    model, out = _model_and_out(ns)
    result = run(model, out, depths=depths, rank=ns.rank, seq_len=ns.seq_len,
                 train_windows=ns.train_windows, calib_windows=ns.calib_windows, heldout_windows=ns.heldout_windows,
                 epochs=ns.epochs, lr=ns.lr,
                 seed=ns.seed)
    if ns.report:
        Path(ns.report).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return 0


def _add_lookahead_parser(tsub: Any, formatter: Any) -> None:
    la = tsub.add_parser("lookahead", help="train a small head that predicts after loop n whether a token may exit at "
                         "loop n + 2, on the frozen model (docs/lookahead.md)", formatter_class=formatter)
    la.add_argument("--model", default=None, help="checkpoint directory (default: the bundled demo model)")
    la.add_argument("--out", default=None, help="where lookahead.safetensors and lookahead.json go (default: --model; "
                    "required with the bundled model, whose directory is part of the install)")
    la.add_argument("--traces-dir", required=True, help="where the trace shards go (train/, calib/, heldout/)")
    la.add_argument("--report", default=None, help="also write the held-out evaluation JSON here")
    _add_window_args(la, calib="the threshold", heldout=64, epochs=30)
    la.set_defaults(func=run_lookahead)


def run_lookahead(ns: argparse.Namespace) -> int:
    from loopline.train.lookahead import run

    model, out = _model_and_out(ns)
    result = run(model, out, Path(ns.traces_dir), seq_len=ns.seq_len, train_windows=ns.train_windows,
                 calib_windows=ns.calib_windows, heldout_windows=ns.heldout_windows, epochs=ns.epochs, seed=ns.seed)
    if ns.report:
        Path(ns.report).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return 0


def _add_grpo_parser(tsub: Any, formatter: Any) -> None:
    g = tsub.add_parser("grpo", help="GRPO on a checkpoint: rollouts on loopline.LLM, updates on the dense model, "
                        "publication through the engine's weight-update transaction (docs/rl.md)", formatter_class=formatter)
    g.add_argument("--model", default=None, help="checkpoint directory to start from (default: the bundled default model)")
    g.add_argument("--out", required=True, help="run directory: log.jsonl, the resumable state, and the exported model/")
    g.add_argument("--iterations", type=int, default=None, help="total iterations of the run (default: GRPOConfig's, 30)")
    g.add_argument("--stop-after", type=int, default=None, help="stop (saving the state) after this iteration; "
                   "continue with --resume")
    g.add_argument("--resume", action="store_true", help="continue the run saved in --out (its config wins)")
    g.add_argument("--seed", type=int, default=None, help="run seed: prompt order and sampling seeds (default 0)")
    g.add_argument("--reward", default=None, help="'python_closes' (default), 'python_parses' or 'contains:WORD'")
    g.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override one GRPOConfig field (group_size=8, lr=3e-4, max_tokens=8, exit_threshold=0.6, ...); repeatable")
    g.add_argument("--eval", action="store_true", help="print the greedy reward over every prompt before and after "
                   "the iterations (it never changes the run)")
    g.add_argument("--save-every", type=int, default=5, help="save the state every N iterations (and at the end)")
    g.add_argument("--device", default="cpu", help="'cpu', 'cuda' or 'cuda:N' (trainer and engine share it)")
    g.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (default: torch's)")
    g.set_defaults(func=run_grpo)


def grpo_config(ns: argparse.Namespace):
    """The :class:`GRPOConfig` of ``--set`` overrides and the explicit flags."""
    from loopline.train.grpo import GRPOConfig

    raw: dict[str, Any] = {}
    for item in ns.set:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise InvalidRequestError(f"--set {item!r}; allowed: FIELD=VALUE, e.g. --set group_size=8")
        try:
            raw[key] = json.loads(value)
        except json.JSONDecodeError:
            raw[key] = value
    for name in ("model", "iterations", "seed", "reward"):
        if getattr(ns, name) is not None:
            raw[name] = getattr(ns, name)
    return GRPOConfig.from_dict(raw)


def run_grpo(ns: argparse.Namespace) -> int:
    import torch

    from loopline.train.grpo import GRPO, STATE_FILE

    if ns.threads:
        torch.set_num_threads(ns.threads)
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    state_dir = out / "state"
    t0 = time.perf_counter()
    with open(out / "log.jsonl", "a", encoding="utf-8") as fh:
        def log(record: dict) -> None:
            line = json.dumps({**record, "elapsed_s": round(time.perf_counter() - t0, 1)})
            print(line, flush=True)
            fh.write(line + "\n")
            fh.flush()

        if ns.resume:
            if not (state_dir / STATE_FILE).is_file():
                raise FileNotFoundError(f"--resume: {state_dir / STATE_FILE} does not exist (--out)")
            run = GRPO.resume(state_dir, device=ns.device, log=log, iterations=ns.iterations)
            print(json.dumps({"resumed_at_iteration": run.iteration, "weight_version": run.weight_version}), flush=True)
        else:
            run = GRPO(grpo_config(ns), device=ns.device, log=log)
            print(json.dumps({"model": run.model_path, "config": run.config.to_dict()}), flush=True)
        until = run.config.iterations if ns.stop_after is None else ns.stop_after
        if ns.eval:
            print(json.dumps(run.evaluate()), flush=True)
        run.train(until=until, save_every=ns.save_every, state_dir=state_dir)
        run.save(state_dir)
        if ns.eval:
            print(json.dumps(run.evaluate()), flush=True)
        if run.iteration >= run.config.iterations:
            print(json.dumps({"exported": str(run.export(out / "model")), "iterations": run.iteration,
                              "weight_version": run.weight_version}), flush=True)
    return 0


def run_pretrain(ns: argparse.Namespace) -> int:
    import torch

    from loopline.train.trainer import CHECKPOINT_FILE, Trainer, choose_threshold

    if ns.threads:
        torch.set_num_threads(ns.threads)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if ns.device == "auto" else ns.device
    out = Path(ns.out)
    ckpt = Path(ns.checkpoint_dir) if ns.checkpoint_dir else out.parent / (out.name + ".train_state")
    t0 = time.perf_counter()

    def log(step: int, metrics) -> None:  # StepMetrics: read (a device sync) only on the steps printed
        if ns.log_every and (step % ns.log_every == 0):
            values = metrics.as_dict()
            print(json.dumps({"step": step, **{k: round(v, 5) if isinstance(v, float) else v for k, v in values.items()},
                              "elapsed_s": round(time.perf_counter() - t0, 1)}), flush=True)

    if ns.resume:
        if not (ckpt / CHECKPOINT_FILE).is_file():
            raise FileNotFoundError(f"--resume: {ckpt / CHECKPOINT_FILE} does not exist (--checkpoint-dir)")
        trainer = Trainer.resume(ckpt, device=device, log=log)
        print(json.dumps({"resumed_at_step": trainer.step}), flush=True)
    else:
        trainer = Trainer(build_config(ns.preset, ns.config_file, ns.set), device=device, log=log)
    config = trainer.config
    params = sum(p.numel() for p in trainer.model.parameters())
    # how many times stage 1 reads each training token: over ~2 the held-out loss stops following the training loss
    epochs = config.stage1_steps * config.batch_size * config.seq_len / trainer.data.train.numel()
    print(json.dumps({"parameters": params, "train_tokens": trainer.data.train.numel(),
                      "heldout_tokens": trainer.data.heldout.numel(), "stage1_epochs": round(epochs, 2), "device": device,
                      "data_s": round(time.perf_counter() - t0, 1)}), flush=True)
    t_train = time.perf_counter()
    start_step = trainer.step
    eval_s = 0.0  # the periodic held-out evaluations, left out of the training throughput
    while trainer.step < config.total_steps:
        until = config.total_steps if not ns.eval_every else (trainer.step // ns.eval_every + 1) * ns.eval_every
        trainer.train(until=until, save_every=ns.save_every, checkpoint_dir=ckpt)
        if ns.eval_every and trainer.step < config.total_steps:
            t_eval = time.perf_counter()
            held = trainer.evaluate(thresholds=(1.0,))
            eval_s += time.perf_counter() - t_eval
            print(json.dumps({"step": trainer.step, "heldout_loop_losses": [round(x, 4) for x in held["loop_losses"]],
                              "heldout_expected_loss": round(held["expected_loss"], 4),
                              "elapsed_s": round(time.perf_counter() - t0, 1)}), flush=True)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    train_s = time.perf_counter() - t_train - eval_s
    trainer.save(ckpt)
    metrics = trainer.evaluate(batches=max(config.eval_batches, 1))
    threshold = ns.exit_threshold if ns.exit_threshold is not None else choose_threshold(metrics["curve"], ns.threshold_tolerance)
    tokens = (trainer.step - start_step) * config.batch_size * config.seq_len
    metrics.update(train_s=round(train_s, 1), train_tokens_per_s=round(tokens / max(train_s, 1e-9)),
                   chosen_threshold=threshold)
    trainer.export(out, early_exit_threshold=threshold, metrics=metrics)
    print(json.dumps({"exported": str(out), **metrics}), flush=True)
    return 0


def run_curve(ns: argparse.Namespace) -> int:
    import torch

    from loopline.models.tiny import default_checkpoint
    from loopline.train.engine_eval import dense_curve, engine_curve, heldout_stream

    try:
        thresholds = tuple(float(x) for x in ns.thresholds.split(","))
    except ValueError:
        raise InvalidRequestError(f"--thresholds {ns.thresholds!r}; allowed: comma-separated numbers in "
                                  "(0, 1]") from None
    if not all(0 < q <= 1 for q in thresholds):
        raise InvalidRequestError(f"--thresholds {ns.thresholds!r}; allowed: numbers in (0, 1]")
    if ns.max_windows < 0:
        raise InvalidRequestError(f"--max-windows {ns.max_windows}; allowed: >= 0 (0: the whole split)")
    device = ("cuda" if torch.cuda.is_available() else "cpu") if ns.device == "auto" else ns.device
    model = Path(ns.model) if ns.model else default_checkpoint()
    stream = heldout_stream(model)
    kw = dict(seq_len=ns.seq_len, max_windows=ns.max_windows or None, thresholds=thresholds)
    t0 = time.perf_counter()
    engine = engine_curve(model, stream, kv_layout=ns.kv_layout, device=device, **kw)
    t1 = time.perf_counter()
    dense = dense_curve(model, stream, device=device, **kw)
    # The model by name and content, not by a local path (the file ships beside the weights).
    name = json.loads((model / "config.json").read_text(encoding="utf-8")).get("_name_or_path") or model.name
    weights = hashlib.sha256()
    for file in sorted(model.glob("*.safetensors")):  # streamed: a real checkpoint is gigabytes
        with open(file, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 24), b""):
                weights.update(chunk)
    result = {"model": name, "weights_sha256": weights.hexdigest(), "python_version": platform.python_version(),
              "heldout_stream_tokens": len(stream), "device": device, "kv_layout": ns.kv_layout,
              "engine_s": round(t1 - t0, 1), "engine": engine, "dense": dense,
              "max_abs_loss_diff": max(abs(a["loss"] - b["loss"]) for a, b in zip(engine, dense)),
              "depths_equal": all(a["depth_histogram"] == b["depth_histogram"] for a, b in zip(engine, dense))}
    text = json.dumps(result, indent=1)
    if ns.out:
        Path(ns.out).write_text(text + "\n", encoding="utf-8")
    print(text)
    return 0
