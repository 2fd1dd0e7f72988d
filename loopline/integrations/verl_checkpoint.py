"""verl's actor checkpoint -> a checkpoint directory loopline loads (``loopline serve DIR``).

verl's FSDP checkpoint (``trainer.default_local_dir/global_step_N/actor``) holds the actor's sharded
state (``model_world_size_W_rank_R.pt``: DTensors under the Hugging Face names, one file per rank),
``fsdp_config.json`` (``world_size``) and ``huggingface/`` (the model's ``config.json`` and
tokenizer). verl can also write full weights there (``checkpoint.save_contents`` with ``hf_model``),
but for Ouro that save fails: transformers refuses to write a ``generation_config.json`` that sets
sampling fields (``temperature``, ``top_k``) without ``do_sample``, and the demo model's does. So
:func:`export_hf` rebuilds the full weights from the shards instead (no process group needed) and
writes ``model.safetensors``, ``config.json`` (``architectures`` Ouro's, ``torch_dtype`` the
weights'), the tokenizer files and ``generation_config.json`` (from ``huggingface/`` or the base
model's directory: it carries the eos ids and sampling defaults loopline reads).

    python -m loopline.integrations.verl_checkpoint CKPT/global_step_20/actor OUT_DIR --base loopline/models/demo_ouro

Needs torch only (no verl). The ``.pt`` files are pickles: load only checkpoints you wrote.
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor

from loopline.models.loader import CheckpointError

__all__ = ["export_hf", "load_actor_state"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
GENERATION_CONFIG = "generation_config.json"


def _actor_dir(path: Path) -> Path:
    """``global_step_N/actor`` given either it or ``global_step_N``."""
    if (path / "fsdp_config.json").is_file():
        return path
    if (path / "actor" / "fsdp_config.json").is_file():
        return path / "actor"
    raise CheckpointError(f"{path}: not a verl actor checkpoint (no fsdp_config.json here or in {path / 'actor'})")


def _full(shards: list[Tensor], name: str) -> Tensor:
    """One weight from its per-rank pieces: DTensor shards concatenated along their shard dim."""
    first = shards[0]
    if not hasattr(first, "to_local"):  # plain tensors (a full state dict): every rank holds all of it
        return first.detach().cpu()
    placements = first.placements
    if len(placements) != 1:
        raise CheckpointError(f"{name}: a {len(placements)}-D device mesh is not supported (FSDP on one mesh axis)")
    local = [s.to_local().detach().cpu() for s in shards]
    if placements[0].is_replicate():
        return local[0]
    if not placements[0].is_shard():
        raise CheckpointError(f"{name}: placement {placements[0]} is not supported (Shard or Replicate)")
    full = torch.cat(local, dim=placements[0].dim)
    if tuple(full.shape) != tuple(first.shape):
        raise CheckpointError(f"{name}: shards make shape {tuple(full.shape)}, the checkpoint says {tuple(first.shape)}")
    return full


def load_actor_state(actor_dir: str | Path) -> dict[str, Tensor]:
    """The actor's full state dict (Hugging Face names, CPU tensors) from verl's per-rank files."""
    actor = _actor_dir(Path(actor_dir))
    world = json.loads((actor / "fsdp_config.json").read_text()).get("world_size")
    if not isinstance(world, int) or world < 1:
        raise CheckpointError(f"{actor / 'fsdp_config.json'}: world_size={world!r}; allowed: a positive integer")
    files = [actor / f"model_world_size_{world}_rank_{rank}.pt" for rank in range(world)]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise CheckpointError(f"{actor}: missing shard file(s) {missing} (world_size {world})")
    # NOTE: weights_only=False: DTensors unpickle their device mesh (verl writes these files itself)
    states = [torch.load(f, map_location="cpu", weights_only=False) for f in files]
    names = list(states[0])
    for f, s in zip(files[1:], states[1:]):
        if list(s) != names:
            raise CheckpointError(f"{f}: holds other weight names than {files[0].name}")
    return {name: _full([s[name] for s in states], name) for name in names}


def export_hf(actor_dir: str | Path, out_dir: str | Path, base_model: str | Path | None = None,
              dtype: torch.dtype | None = None) -> Path:
    """Writes verl's actor checkpoint as a loadable directory at ``out_dir`` (module docstring); returns it.

    ``base_model``: the directory training started from, whose ``generation_config.json`` (and
    tokenizer files) fill what verl's ``huggingface/`` lacks. ``dtype``: cast the weights (default:
    as stored, fp32 master weights under verl's FSDP).
    """
    actor = _actor_dir(Path(actor_dir))
    hf = actor / "huggingface"
    if not (hf / "config.json").is_file():
        raise CheckpointError(f"{hf}: no config.json (verl writes it with every actor checkpoint)")
    base = Path(base_model) if base_model is not None else None
    if base is not None and not base.is_dir():
        raise CheckpointError(f"base_model {base}: not a directory")
    state = load_actor_state(actor)
    if dtype is not None:
        state = {k: v.to(dtype) for k, v in state.items()}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((hf / "config.json").read_text())
    stored = {v.dtype for v in state.values()}
    config["architectures"] = ["OuroForCausalLM"]  # verl wrote its actor class (OuroActorForCausalLM)
    config.pop("dtype", None)  # NOTE: verl writes the autocast dtype here, not the weights'
    if len(stored) == 1:
        config["torch_dtype"] = str(next(iter(stored))).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in (*TOKENIZER_FILES, GENERATION_CONFIG):
        src = hf / name if (hf / name).is_file() else (base / name if base is not None else None)
        if src is not None and src.is_file():
            shutil.copyfile(src, out / name)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Export verl's actor checkpoint as a directory loopline serves.")
    ap.add_argument("actor_dir", help="verl's global_step_N/actor (or global_step_N)")
    ap.add_argument("out_dir", help="directory to write (model.safetensors, config.json, tokenizer files)")
    ap.add_argument("--base", default=None, help="the model training started from (generation_config.json, tokenizer)")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                    help="cast the weights (default: as stored)")
    args = ap.parse_args(argv)
    out = export_hf(args.actor_dir, args.out_dir, args.base, getattr(torch, args.dtype) if args.dtype else None)
    print(f"exported {args.actor_dir} -> {out}")


if __name__ == "__main__":
    main()
