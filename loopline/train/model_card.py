"""``MODEL_CARD.md`` of an exported run, rendered from its ``training_info.json``.

It states what the trainer measured (dense model, held-out split) and, when an
``exit_curve.json`` (``loopline train curve --out``) lies beside it, the depth-vs-loss curve
and exit-depth histograms measured through the engine.
"""
from __future__ import annotations

import json
from pathlib import Path


def render_model_card(info: dict, engine_curve: dict | None = None) -> str:
    """Markdown of the card: corpus, license, architecture, held-out loss per loop, the threshold curves."""
    corpus, metrics, cfg = info["corpus"], info.get("metrics") or {}, info["train_config"]
    model = cfg["model"]
    lines = [
        "# loopline demo Ouro model",
        "",
        "A small looped language model of the Ouro architecture trained in-tree by `loopline train pretrain` "
        "(docs/training.md). A demo of adaptive depth, not a useful assistant; real Ouro weights load from a "
        "local directory with `loopline generate --model DIR`.",
        "",
        "## Corpus",
        "",
        f"- {corpus['name']}",
        f"- license: {corpus['license']} ({corpus['license_url']})",
        f"- {corpus['implementation']} {corpus['python_version']}; corpus SHA-256 `{corpus['sha256']}`",
        f"- train: {corpus['train_files']} files, {corpus['train_bytes']:,} bytes, {corpus.get('train_tokens', 0):,} tokens",
        f"- held-out (never trained on): {corpus['heldout_files']} files, {corpus['heldout_bytes']:,} bytes, "
        f"{corpus.get('heldout_tokens', 0):,} tokens",
        *_sources_section(corpus.get("sources")),
        "",
        "## Model",
        "",
        f"- {info['parameters']:,} parameters; vocab {model['vocab_size']}, hidden {model['hidden_size']}, "
        f"intermediate {model['intermediate_size']}, {model['num_hidden_layers']} layers, "
        f"{model['num_attention_heads']} heads x {model['head_dim']}, total_ut_steps {model['total_ut_steps']}",
        f"- trained {info['step']} steps ({cfg['stage1_steps']} stage 1, {cfg['stage2_steps']} stage 2), "
        f"batch {cfg['batch_size']} x {cfg['seq_len']} tokens, seed {cfg['seed']}",
        *_objective_lines(cfg),
    ]
    if metrics.get("loop_losses"):
        lines += ["", "## Held-out loss per loop (dense model, nats/token)", "",
                  "| loops | " + " | ".join(str(i + 1) for i in range(len(metrics["loop_losses"]))) + " | uniform |",
                  "|---" * (len(metrics["loop_losses"]) + 2) + "|",
                  "| loss | " + " | ".join(f"{x:.4f}" for x in metrics["loop_losses"]) + f" | {metrics['uniform_loss']:.4f} |"]
    if metrics.get("curve"):
        lines += ["", "## Exit threshold vs held-out loss (dense model, the engine's exit rule)", "",
                  "| threshold | mean loops | loss |", "|---|---|---|"]
        lines += [f"| {p['threshold']} | {p['mean_depth']:.3f} | {p['loss']:.4f} |" for p in metrics["curve"]]
    if engine_curve:
        lines += _engine_section(engine_curve, with_packages=bool(corpus["spec"].get("packages")))
    lines += ["", f"`early_exit_threshold` in config.json: {info['early_exit_threshold']}"]
    return "\n".join(lines) + "\n"


def _objective_lines(cfg: dict) -> list[str]:
    """How the two stages trained (fields recorded after a release keep their defaults' meaning when absent)."""
    import math

    import torch

    from loopline.train.objective import exit_log_probs

    freeze = cfg.get("gate_freeze_steps", 0)
    init = cfg["gate_init_exit"]
    # the untrained gate's constant logit (trainer.init_weights), through the trainer's own exit distribution
    logits = torch.full((cfg["model"]["total_ut_steps"],), math.log(init / (1 - init)))
    p = exit_log_probs(logits).exp().tolist()
    gate = (f"the gate held at its initial exit distribution p = ({', '.join(f'{x:.2f}' for x in p)}) for the first "
            f"{freeze} steps" if freeze else f"the gate trained from p = ({', '.join(f'{x:.2f}' for x in p)})")
    return [f"- stage 1: expected loss over the exit distribution plus entropy (beta {cfg['entropy_beta']}), "
            f"peak lr {cfg['lr']}, {gate}; stage 2: the gate alone, peak lr {cfg['stage2_lr']}"]


def _sources_section(sources: list[dict] | None) -> list[str]:
    """One row per source of the corpus (absent from runs recorded before sources were: their card is unchanged)."""
    if not sources:
        return []
    lines = ["", "Sources (a file's split is decided by its corpus path alone; a package's paths are prefixed "
                 "`NAME:`):", "",
             "| source | version | license metadata | files | bytes | held-out files | held-out bytes |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {s['name']} | {s['version']} | {s['license'].replace('|', '/')} | {s['files']:,} | {s['bytes']:,} | "
              f"{s['heldout_files']:,} | {s['heldout_bytes']:,} |" for s in sources]
    return lines


def _engine_section(curve: dict, with_packages: bool = False) -> list[str]:
    points = curve["engine"]
    full = next(p["loss"] for p in points if p["threshold"] >= 1.0)
    depths = sorted({d for p in points for d in p["depth_histogram"]}, key=int)
    held = (f"the held-out files of CPython {curve['python_version']} and the packages" if with_packages
            else f"CPython {curve['python_version']}'s held-out files")
    lines = ["", "## Exit threshold vs held-out loss, measured through the engine", "",
             f"`loopline train curve` on {curve['device']} ({held}, "
             f"{points[0]['tokens']:,} scored tokens, KV layout `{curve['kv_layout']}`): every prompt position's depth "
             "is the engine's exit rule (`prompt_exit_depths`), its loss the engine's `prompt_logprobs`. "
             f"Largest loss difference to the dense model: {curve['max_abs_loss_diff']:.1e}; identical depth "
             f"histograms: {'yes' if curve['depths_equal'] else 'no'}.", "",
             "| threshold | mean loops | loss | vs full depth | " + " | ".join(f"depth {d}" for d in depths) + " |",
             "|---" * (4 + len(depths)) + "|"]
    for p in points:
        hist = " | ".join(f"{p['depth_histogram'].get(d, 0) / p['tokens']:.1%}" for d in depths)
        lines.append(f"| {p['threshold']} | {p['mean_depth']:.3f} | {p['loss']:.4f} | {p['loss'] - full:+.4f} | {hist} |")
    return lines


def write_model_card(export_dir: str | Path) -> Path:
    """Writes ``MODEL_CARD.md`` beside the weights from the directory's ``training_info.json``."""
    export_dir = Path(export_dir)
    info = json.loads((export_dir / "training_info.json").read_text(encoding="utf-8"))
    curve_file = export_dir / "exit_curve.json"
    curve = json.loads(curve_file.read_text(encoding="utf-8")) if curve_file.is_file() else None
    path = export_dir / "MODEL_CARD.md"
    path.write_text(render_model_card(info, curve), encoding="utf-8")
    return path
