"""Trained draft adapters in the engine (#41): loaded beside the weights when present (``draft_adapter``
"auto"), applied to drafts only, so speculative outputs stay exactly plain decoding's (greedy tokens, depths
and logprobs; seeded sampling); validated with errors naming file and field; dropped by a weight update
unless the update brings its own."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from spec.test_engine import DEMO_PROMPTS, assert_same, drain, engine, spec

from loopline import SamplingParams
from loopline.errors import InvalidRequestError
from loopline.models.loader import CheckpointError, load_model, load_tokenizer
from loopline.models.plain import plain_generate
from loopline.models.tiny import default_checkpoint
from loopline.spec import SpeculativeConfig
from loopline.spec.adapter import (
    ADAPTER_CONFIG,
    ADAPTER_FILE,
    AdapterConfig,
    DraftAdapter,
    base_weights_sha256,
    load_adapter,
    save_adapter,
)
from loopline.spec.reference import speculative_generate

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2, exit_threshold=1.0)


def demo_copy(path) -> str:
    """The demo model's files in ``path`` (its own directory is part of the install)."""
    src = default_checkpoint()
    path.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.startswith("draft_adapter"):
            shutil.copy(f, path / f.name)
    return str(path)


def blind_adapter(model_dir: str, depths=(1, 2, 3), *, sha: str | None = None) -> DraftAdapter:
    """An adapter that maps every draft state to zero (drafts become token 0): it must lower acceptance
    and change no output. Saved beside ``model_dir``'s weights."""
    a = DraftAdapter(256, 4, list(depths))
    with torch.no_grad():
        for d in depths:
            a.scale[str(d)].zero_()
    save_adapter(a, AdapterConfig(hidden_size=256, rank=4, depths=list(depths), total_ut_steps=4,
                                  base_weights_sha256=sha or base_weights_sha256(model_dir)), model_dir)
    return a


@pytest.fixture(scope="module")
def prompts():
    tok = load_tokenizer(default_checkpoint())
    return [tok.encode(p) for p in DEMO_PROMPTS[:3]]


@pytest.fixture(scope="module")
def blind_dir(tmp_path_factory):
    d = demo_copy(tmp_path_factory.mktemp("blind"))
    blind_adapter(d)
    return d


def rate(eng) -> float:
    s = eng.stats
    return s.spec_num_accepted_tokens / max(s.spec_num_draft_tokens, 1)


# default run: greedy; sampled (~5 s) is slow (test_adaptive_exits_stay_exact_with_the_adapter runs the adapter too)
@pytest.mark.parametrize("params", [
    GREEDY, pytest.param(SamplingParams(max_tokens=16, temperature=0.8, seed=3, logprobs=1, ignore_eos=True, top_k=50),
                         marks=pytest.mark.slow)])
def test_outputs_equal_plain_decoding_with_the_adapter_and_it_changes_drafts(prompts, blind_dir, params):
    reqs = {f"r{i}": (p, params) for i, p in enumerate(prompts)}
    plain = drain(engine(blind_dir), reqs)
    with_adapter = engine(blind_dir, spec(3, 1))
    info = with_adapter.draft_adapter
    assert info is not None and info.depth == 1 and info.source == blind_dir
    assert_same(drain(with_adapter, reqs), plain)
    without = engine(blind_dir, {**spec(3, 1), "draft_adapter": "none"})
    assert without.draft_adapter is None
    assert_same(drain(without, reqs), plain)
    # the blind adapter's drafts are token 0: almost none is accepted, where the plain coda's mostly are
    assert rate(with_adapter) < 0.2 and rate(without) > 0.5


def test_adaptive_exits_stay_exact_with_the_adapter(prompts, blind_dir):
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=1, exit_threshold=0.5)
    reqs = {f"r{i}": (p, params) for i, p in enumerate(prompts)}
    assert_same(drain(engine(blind_dir, spec(2, 2)), reqs), drain(engine(blind_dir), reqs))


def test_reference_with_an_adapter_equals_plain_decoding(prompts, blind_dir):
    model = load_model(blind_dir, dtype=torch.float32)
    adapter, _ = load_adapter(blind_dir, 256, 4)
    cfg = SpeculativeConfig(scheme="draft_verify", num_speculative_tokens=3, draft_loops=1)
    out = speculative_generate(model, prompts[0], 12, cfg, draft_adapter=adapter)
    assert out.tokens == plain_generate(model, prompts[0], 12).tokens
    assert sum(out.accepted) < sum(speculative_generate(model, prompts[0], 12, cfg).accepted)


def test_auto_ignores_an_adapter_of_other_weights_or_depths(tmp_path):
    d = demo_copy(tmp_path / "m")
    blind_adapter(d, sha="0" * 64)
    assert engine(d, spec(2, 1)).draft_adapter is None  # trained on other weights: the plain coda
    blind_adapter(d, depths=(2,))
    assert engine(d, spec(2, 1)).draft_adapter is None  # no adapter for draft_loops=1
    assert engine(d, spec(2, 2)).draft_adapter is not None
    assert engine(d).draft_adapter is None  # no speculation


def test_bad_adapters_are_refused_naming_file_and_field(tmp_path):
    d = demo_copy(tmp_path / "m")
    with pytest.raises(InvalidRequestError, match="speculative_config.draft_adapter=''"):
        SpeculativeConfig.from_dict({"method": "loop", "draft_adapter": ""})
    with pytest.raises(CheckpointError, match=f"{ADAPTER_CONFIG} does not exist"):
        engine(d, {**spec(2, 1), "draft_adapter": str(tmp_path / "nowhere")})
    blind_adapter(d, sha="0" * 64)
    with pytest.raises(CheckpointError, match="base_weights_sha256"):
        engine(d, {**spec(2, 1), "draft_adapter": d})
    blind_adapter(d, depths=(2,))
    with pytest.raises(CheckpointError, match="depths=\\[2\\]"):
        engine(d, {**spec(2, 1), "draft_adapter": d})
    cfg = json.loads((tmp_path / "m" / ADAPTER_CONFIG).read_text())
    for field, value, match in (("hidden_size", 128, "hidden_size=128"), ("rank", 0, "rank=0"),
                                ("depths", [4], "depths=\\[4\\]"), ("format", "x/2", "format='x/2'"),
                                ("file", "../w.safetensors", "file=")):
        (tmp_path / "m" / ADAPTER_CONFIG).write_text(json.dumps({**cfg, field: value}))
        with pytest.raises(CheckpointError, match=match):
            engine(d, spec(2, 2))  # "auto" refuses a malformed adapter too
    (tmp_path / "m" / ADAPTER_CONFIG).write_text(json.dumps(cfg))
    (tmp_path / "m" / ADAPTER_FILE).write_bytes(b"not safetensors")
    with pytest.raises(CheckpointError, match=ADAPTER_FILE):
        engine(d, spec(2, 2))
    (tmp_path / "m" / ADAPTER_FILE).unlink()
    (tmp_path / "outside.safetensors").write_bytes(b"")
    (tmp_path / "m" / ADAPTER_FILE).symlink_to(tmp_path / "outside.safetensors")
    with pytest.raises(CheckpointError, match=f"{ADAPTER_FILE} leads outside the directory"):
        engine(d, spec(2, 2))
    with pytest.raises(CheckpointError, match="no checkpoint directory"):
        engine(d, {**spec(2, 1), "draft_adapter": d}, load_format="dummy")


def test_a_weight_update_drops_the_adapter_unless_it_brings_one(prompts, tmp_path, blind_dir):
    reqs = {f"r{i}": (p, GREEDY) for i, p in enumerate(prompts[:2])}
    plain = drain(engine(blind_dir), reqs)
    eng = engine(blind_dir, spec(3, 1))
    assert eng.draft_adapter is not None
    bare = demo_copy(tmp_path / "bare")  # the same weights, no adapter
    eng.update_weights_from_disk(bare, 1)
    assert eng.draft_adapter is None and eng.weight_version == 1
    assert_same(drain(eng, reqs), plain)
    assert rate(eng) > 0.5  # drafting with the plain coda again
    eng.update_weights_from_disk(blind_dir, 2)  # an update that brings its adapter installs it
    assert eng.draft_adapter is not None and eng.draft_adapter.source == blind_dir
    assert_same(drain(eng, reqs), plain)
    weights = load_model(blind_dir, dtype=torch.float32).state_dict()
    eng.start_weight_update(3)
    eng.update_weights(list(weights.items()))
    eng.finish_weight_update()
    assert eng.draft_adapter is None  # pushed tensors bring no adapter
    assert_same(drain(eng, reqs), plain)
    none = engine(blind_dir, {**spec(3, 1), "draft_adapter": "none"})
    none.update_weights_from_disk(blind_dir, 1)
    assert none.draft_adapter is None  # "none" holds across updates



def _tool(name: str):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "tools" / f"{name}.py"
    spec_ = importlib.util.spec_from_file_location(f"tool_{name}", path)
    module = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(module)
    return module


@pytest.mark.slow  # ~10 s on 2 cores (the corpus scan and three measurements); default run: the adapter in the
# reference (test_reference_with_an_adapter_equals_plain_decoding) and in the engine (the tests above)
def test_spec_acceptance_tool_measures_drafts_through_the_adapter(blind_dir):
    """tools/spec_acceptance.py --draft-adapter's measurement: an identity adapter gives what the plain coda
    gives, the blind one (drafts always token 0) almost no match; the target (last loop) never changes."""
    from loopline.train.engine_eval import heldout_stream

    tool = _tool("spec_acceptance")
    model = load_model(blind_dir, dtype=torch.float32).eval()
    stream = heldout_stream(default_checkpoint())[:400]
    identity = DraftAdapter(256, 2, [1, 3])
    blind, _ = load_adapter(blind_dir, 256, 4)
    plain, _ = tool.heldout_overlap(model, stream, 2, 48)
    same, _ = tool.heldout_overlap(model, stream, 2, 48, identity)
    for d in plain:
        assert same[d] == pytest.approx(plain[d], abs=1e-5)
    zeroed, seqs = tool.heldout_overlap(model, stream, 2, 48, blind)
    assert zeroed[1]["match"] < 0.2 < plain[1]["match"] and zeroed[2]["match"] < 0.2
    gen = tool.generated_matches(model, stream, 1, 16, 6, blind)  # asserts the target is plain decoding's
    assert sum(gen[1][0][1:]) <= 1


@pytest.mark.slow  # two tool processes on the CPU: ~40-70 s on a loaded 2-core host
def test_acceptance_tools_measure_with_and_without_the_adapter(tmp_path, blind_dir):
    """tools/spec_acceptance.py --draft-adapter: an identity adapter measures what the plain coda does, the
    blind one (drafts always token 0) almost nothing; tools/draft_adapter_acceptance.py runs the engine both ways."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    ident = tmp_path / "identity"
    save_adapter(DraftAdapter(256, 2, [1, 3]), AdapterConfig(hidden_size=256, rank=2, depths=[1, 3], total_ut_steps=4,
                                                             base_weights_sha256="x"), ident)
    records = {}
    for name, adapter in (("identity", ident), ("blind", blind_dir)):
        record = tmp_path / f"{name}.json"
        out = subprocess.run([sys.executable, str(root / "tools" / "spec_acceptance.py"), "--prompts", "1", "--new-tokens",
                              "6", "--windows", "1", "--seq-len", "24", "--draft-adapter", str(adapter), "--record",
                              str(record)], capture_output=True, text=True, timeout=300, cwd=root, env=env)
        assert out.returncode == 0, out.stderr[-2000:]
        assert "# drafts: plain coda" in out.stdout and "# drafts: draft adapter" in out.stdout
        records[name] = json.loads(record.read_text())
    ident_rec, blind_rec = records["identity"], records["blind"]
    assert ident_rec["draft_adapter"]["heldout"]["overlap"] == ident_rec["heldout"]["overlap"]
    assert blind_rec["draft_adapter"]["heldout"]["overlap"]["1"]["match"] < blind_rec["heldout"]["overlap"]["1"]["match"]
    out = subprocess.run([sys.executable, str(root / "tools" / "draft_adapter_acceptance.py"), "--model", blind_dir,
                          "--draft-loops", "1", "--temperatures", "0", "--tokens", "6"],
                         capture_output=True, text=True, timeout=300, cwd=root, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| 0 | 1 |")]
    assert len(rows) == 2 and all(r.endswith("| True |") for r in rows), out.stdout
