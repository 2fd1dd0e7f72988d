"""lm-eval-harness end to end: ``lm_eval --model local-completions`` against the server, offline.

Two local tasks (tests/entrypoints/lm_eval_tasks/: a multiple-choice ``loglikelihood``
task and a ``generate_until`` task over JSON-lines files, no dataset download)
run through the harness; every loglikelihood it reports must equal the one the
offline engine computes for the same tokens, and every generation the offline
engine's greedy text. Skipped when lm-eval is not installed
(``pip install "lm-eval[api]"``); docs/serving.md gives the same command.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

from loopline import SamplingParams  # noqa: E402
from loopline.models.loader import load_tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TASKS = ROOT / "tests" / "entrypoints" / "lm_eval_tasks"
MODEL = "tiny-test"


def _lm_eval(base_url: str, tokenizer: Path, out: Path) -> None:
    exe = shutil.which("lm_eval") or shutil.which("lm-eval")
    cmd = [exe] if exe else [sys.executable, "-m", "lm_eval"]
    cmd += ["run", "--model", "local-completions",
            "--model_args", f"model={MODEL},base_url={base_url}/v1/completions,tokenizer={tokenizer},"
                            "tokenizer_backend=huggingface,num_concurrent=1,max_retries=1",
            "--tasks", "loopline_choice,loopline_gen", "--include_path", str(TASKS.relative_to(ROOT)),
            "--output_path", str(out), "--log_samples"]
    env = {**os.environ, "HF_HOME": str(out / "hf"), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "OPENAI_API_KEY": "test-key"}
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]


def _samples(out: Path, task: str) -> list[dict]:
    (path,) = out.glob(f"**/samples_{task}_*.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow  # ~20 s on 2 cores: lm-eval's own start-up; run with -m slow
def test_lm_eval_local_completions_matches_the_engine(async_llm, serve_app, tiny_gqa, tmp_path):
    from loopline.entrypoints.openai.api_server import build_app

    srv = serve_app(build_app(async_llm, MODEL, api_key="test-key", shutdown_engine=False))
    _lm_eval(srv.base_url, tiny_gqa.path, tmp_path)
    (results,) = tmp_path.glob("**/results_*.json")
    res = json.loads(results.read_text())["results"]
    assert 0.0 <= res["loopline_choice"]["acc,none"] <= 1.0 and "exact_match,none" in res["loopline_gen"]

    llm = tiny_gqa.llm(max_model_len=256)
    tok = load_tokenizer(tiny_gqa.path)
    choice = _samples(tmp_path, "loopline_choice")
    assert len(choice) == 4
    for sample in choice:
        for args, resp in zip(sample["arguments"].values(), sample["filtered_resps"]):
            context, continuation = args["arg_0"], args["arg_1"]
            whole = tok.encode(context + continuation)
            n_ctx = len(tok.encode(context))
            (out,) = llm.generate([whole], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
            want = sum(entry[t].logprob for t, entry in zip(whole[n_ctx:], out.prompt_logprobs[n_ctx:]))
            assert float(resp[0]) == pytest.approx(want, abs=1e-3), (context, continuation)
    gen = _samples(tmp_path, "loopline_gen")
    assert len(gen) == 3
    for sample in gen:
        prompt = sample["arguments"]["gen_args_0"]["arg_0"]
        (out,) = llm.generate([tok.encode(prompt)], SamplingParams(max_tokens=8, temperature=0.0,
                                                                    stop=["\n", tok.eos_token]), use_tqdm=False)
        assert sample["filtered_resps"][0] == out.outputs[0].text, prompt
