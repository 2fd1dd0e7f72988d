"""``MODEL_CARD.md`` of an exported run, rendered from its ``training_info.json``.

It states what the trainer measured (dense model, held-out split). The engine-measured
depth-vs-loss curve and exit-depth histograms are added by the session that ships the
weights (docs/training.md, "What remains").
"""
from __future__ import annotations

import json
from pathlib import Path


def render_model_card(info: dict) -> str:
    """Markdown of the card: corpus, license, architecture, held-out loss per loop, the threshold curve."""
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
        "",
        "## Model",
        "",
        f"- {info['parameters']:,} parameters; vocab {model['vocab_size']}, hidden {model['hidden_size']}, "
        f"intermediate {model['intermediate_size']}, {model['num_hidden_layers']} layers, "
        f"{model['num_attention_heads']} heads x {model['head_dim']}, total_ut_steps {model['total_ut_steps']}",
        f"- trained {info['step']} steps ({cfg['stage1_steps']} stage 1, {cfg['stage2_steps']} stage 2), "
        f"batch {cfg['batch_size']} x {cfg['seq_len']} tokens, seed {cfg['seed']}",
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
    lines += ["", f"`early_exit_threshold` in config.json: {info['early_exit_threshold']}"]
    return "\n".join(lines) + "\n"


def write_model_card(export_dir: str | Path) -> Path:
    """Writes ``MODEL_CARD.md`` beside the weights from the directory's ``training_info.json``."""
    export_dir = Path(export_dir)
    info = json.loads((export_dir / "training_info.json").read_text(encoding="utf-8"))
    path = export_dir / "MODEL_CARD.md"
    path.write_text(render_model_card(info), encoding="utf-8")
    return path
