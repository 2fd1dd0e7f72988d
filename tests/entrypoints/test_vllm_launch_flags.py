"""vLLM launch lines run unchanged (#45): the one table of loopline/vllm_flags.py, read by ``loopline serve``,
``LLM(...)`` and docs/configuration.md; ``loopline.inputs``; TLS and unix-socket servers."""
from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import re
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from loopline.config import EngineArgs
from loopline.errors import InvalidRequestError
from loopline.vllm_flags import OPTIONS, markdown_table, read_chat_template

ROOT = Path(__file__).resolve().parents[2]

# A launch line as vLLM users write it (every flag of issue #45 that takes this model).
VLLM_LINE = ["--trust-remote-code", "--tensor-parallel-size", "1", "--pipeline-parallel-size", "1",
             "--disable-log-requests", "--enable-chunked-prefill", "--quantization", "None", "--enable-sleep-mode",
             "--override-generation-config", '{"temperature": 0.0, "max_new_tokens": 3}', "--revision", "main",
             "--download-dir", "/tmp", "--max-log-len", "20", "--response-role", "bot",
             "--disable-uvicorn-access-log", "--load-format", "dummy", "--dtype", "half", "--kv-cache-dtype", "auto",
             "--chat-template", "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"]


def _serve_parser():
    from loopline.entrypoints.cli import build_parser

    return build_parser()._subparsers._group_actions[0].choices["serve"]


# --- the table ------------------------------------------------------------------------------------
def test_every_row_is_a_serve_flag_and_every_engine_row_an_engine_field():
    flags = {s for a in _serve_parser()._actions for s in a.option_strings}
    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    assert [o.flag for o in OPTIONS if o.flag not in flags] == []
    assert [o.name for o in OPTIONS if o.scope == "engine" and o.name not in fields] == []


def test_docs_show_the_table():
    text = (ROOT / "docs" / "configuration.md").read_text()
    shown = re.search(r"<!-- vllm-flags:start -->\n(.*?)\n<!-- vllm-flags:end -->", text, re.S)
    assert shown is not None and shown.group(1) == markdown_table()


def test_a_vllm_launch_line_parses_and_passes_the_checks():
    from loopline.config import resolve_dtype
    from loopline.vllm_flags import check_engine_options

    ns = _serve_parser().parse_args(VLLM_LINE)
    args = EngineArgs.from_cli_args(ns)
    check_engine_options(args)
    assert (args.tensor_parallel_size, args.trust_remote_code, args.load_format) == (1, True, "dummy")
    assert args.override_generation_config == {"temperature": 0.0, "max_new_tokens": 3}
    assert (ns.root_path, ns.max_log_len, ns.response_role, ns.disable_log_requests) == (None, 20, "bot", True)
    import torch

    for alias, dtype in (("half", torch.float16), ("float", torch.float32), ("bfloat16", torch.bfloat16),
                         ("float16", torch.float16), ("float32", torch.float32)):
        assert resolve_dtype(alias, "bfloat16", torch.device("cpu")) == dtype


@pytest.mark.parametrize("kwargs, expected", [
    ({"tensor_parallel_size": 2}, "tensor_parallel_size must be 1, got 2"),
    ({"pipeline_parallel_size": 4}, "pipeline_parallel_size must be 1, got 4"),
    ({"quantization": "awq"}, "quantization 'awq' is not supported"),
    ({"load_format": "pt"}, "load_format must be one of ['auto', 'safetensors', 'dummy'], got 'pt'"),
    ({"enable_chunked_prefill": False}, "enable_chunked_prefill must be true (or unset), got False"),
    ({"chat_template": "no/such/template.jinja"}, "chat_template 'no/such/template.jinja': cannot read it"),
])
def test_unsupported_values_are_refused_the_same_way_by_llm_and_serve(kwargs, expected, capsys):
    from loopline.entrypoints.cli import main

    (name, value), = kwargs.items()
    with pytest.raises(InvalidRequestError) as e:
        EngineArgs(**kwargs).validate()
    assert expected in str(e.value) and e.value.param == name
    flag = "--" + name.replace("_", "-")
    argv = ["serve", f"--no-{flag[2:]}"] if value is False else ["serve", flag, str(value)]
    assert main(argv) == 2
    assert expected in capsys.readouterr().err


def test_an_unknown_flag_points_at_serve_help(capsys):
    from loopline.entrypoints.cli import main
    from loopline.entrypoints.openai.api_server import main as module_main

    for run in (lambda: main(["serve", "--no-such-flag"]), lambda: module_main(["--no-such-flag"])):
        with pytest.raises(SystemExit) as e:
            run()
        assert e.value.code == 2
        assert "unrecognized arguments: --no-such-flag (see loopline serve --help)" in capsys.readouterr().err


def test_chat_template_is_a_file_or_the_template_itself(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0]['content'] }}")
    assert read_chat_template(str(path)) == "{{ messages[0]['content'] }}"
    assert read_chat_template("{{ 1 }}") == "{{ 1 }}"
    with pytest.raises(InvalidRequestError, match="chat_template 'plain-word'"):
        read_chat_template("plain-word")


def test_override_generation_config_is_checked_like_generation_config():
    from loopline.models.loader import override_sampling_defaults

    assert override_sampling_defaults({"top_k": 5, "temperature": 0.7}, {"temperature": 0.0, "max_new_tokens": 9}) == \
        {"top_k": 5, "temperature": 0.0, "max_tokens": 9}
    for bad, words in (({"max_tokens": 3}, "unknown key 'max_tokens'"), ({"temperature": -1}, "temperature=-1")):
        with pytest.raises(InvalidRequestError, match=re.escape(words)) as e:
            override_sampling_defaults({}, bad)
        assert e.value.param == "override_generation_config"


# --- LLM(...) -----------------------------------------------------------------------------------
def test_llm_takes_vllm_keywords_and_prompt_types(tiny_gqa, tmp_path, caplog):
    import shutil

    import torch

    from loopline import LLM
    from loopline import TextPrompt, TokensPrompt  # vLLM's top-level names (also loopline.inputs)
    from loopline.models.loader import load_weights

    # load_format="dummy" never reads the weights: a checkpoint without them loads
    weightless = tmp_path / "weightless"
    shutil.copytree(tiny_gqa.path, weightless, ignore=shutil.ignore_patterns("*.safetensors*"))
    with caplog.at_level(logging.INFO, logger="loopline"):
        llm = LLM(str(weightless), seed=1, trust_remote_code=True, tensor_parallel_size=1, pipeline_parallel_size=1,
                  dtype="float", device="cpu", max_model_len=128, max_num_seqs=2, load_format="dummy",
                  enable_chunked_prefill=True, quantization=None, revision="main",
                  override_generation_config={"temperature": 0.0, "max_new_tokens": 3},
                  chat_template="{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}")
    notes = [r.getMessage() for r in caplog.records if "trust_remote_code" in r.getMessage()]
    assert len(notes) == 1 and "never runs code" in notes[0]
    assert any("revision 'main' has no effect" in r.getMessage() for r in caplog.records)
    assert llm.llm_engine.config.dtype == torch.float32
    # dummy: the checkpoint's shapes, random values seeded by the engine seed (the tiny checkpoint used seed 0)
    stored = load_weights(tiny_gqa.path)["model.embed_tokens.weight"]
    dummy = llm.llm_engine.model.model.embed_tokens.weight
    assert dummy.shape == stored.shape and not torch.allclose(dummy.float(), stored.float())
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.max_tokens) == (0.0, 3)
    outs = llm.generate([TextPrompt(prompt="Hello"), TokensPrompt(prompt_token_ids=[5, 6, 7])], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 3]
    assert outs[1].prompt_token_ids == [5, 6, 7]
    assert llm.encode_chat([{"role": "user", "content": "hi"}]) == llm.tokenizer.encode("<<hi>>", add_special_tokens=False)
    with pytest.raises(InvalidRequestError, match="multi_modal_data is not supported") as e:
        llm.generate(TextPrompt(prompt="x", multi_modal_data={"image": b""}), use_tqdm=False)
    assert e.value.param == "multi_modal_data"


# --- real servers ---------------------------------------------------------------------------------
def _serve(tiny_gqa, *flags: str) -> subprocess.Popen:
    """``python -m loopline.entrypoints.openai.api_server`` (vLLM's entry point) on the tiny checkpoint."""
    return subprocess.Popen([sys.executable, "-m", "loopline.entrypoints.openai.api_server", "--model",
                             str(tiny_gqa.path), "--device", "cpu", "--max-model-len", "128", "--max-num-seqs", "2",
                             "--kv-cache-memory-gb", "0.01", "--served-model-name", "t", *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait(proc: subprocess.Popen, client: httpx.Client, url: str) -> None:
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "server did not come up"
        try:
            if client.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)


def _stop(proc: subprocess.Popen) -> str:
    proc.terminate()
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    return out


@pytest.mark.slow  # a server process (~15 s on 2 cores). Default run:
# test_a_vllm_launch_line_parses_and_passes_the_checks parses this line,
# test_https_server_with_root_path_and_a_short_request_log runs run_server's uvicorn settings,
# tests/entrypoints/test_rl_routes.py the sleep routes and test_serve_cli.py a real server process
def test_unix_socket_server_with_a_vllm_launch_line(tiny_gqa, tmp_path):
    sock = str(tmp_path / "s.sock")
    proc = _serve(tiny_gqa, "--uds", sock, *VLLM_LINE)
    try:
        with httpx.Client(transport=httpx.HTTPTransport(uds=sock), base_url="http://loopline") as client:
            _wait(proc, client, "/health")
            body = {"model": "t", "messages": [{"role": "user", "content": "hi"}]}
            reply = client.post("/v1/chat/completions", json=body, timeout=60).json()
            assert reply["choices"][0]["message"]["role"] == "bot"  # --response-role
            assert len(reply["choices"][0]["exit_depths"]) == 3  # max_new_tokens of --override-generation-config
            assert client.post("/sleep", json={"level": 1}).json() == {"success": True, "is_sleeping": True}
            assert client.post("/wake_up", json={}).json()["is_sleeping"] is False
            assert client.post("/pause", json={}).status_code == 404  # sleep mode mounts the sleep routes only
    finally:
        out = _stop(proc)
    assert f"listening on unix:{sock}" in out
    assert "never runs code" in out  # --trust-remote-code, said once
    assert out.count("never runs code") == 1
    assert "POST /v1/chat/completions" not in out  # --disable-log-requests


def _self_signed(tmp_path: Path) -> tuple[str, str]:
    """A key and a certificate for 127.0.0.1 (cryptography, else openssl)."""
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    try:
        import ipaddress

        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError:
        if not _which("openssl"):
            pytest.skip("neither the cryptography package nor openssl is available to make a certificate")
        subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                        "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
                        "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
        return str(key), str(cert)
    private = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    certificate = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(private.public_key())
                   .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                                  critical=False)
                   .sign(private, hashes.SHA256()))
    key.write_bytes(private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    cert.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    return str(key), str(cert)


def _which(name: str) -> bool:
    return any(os.access(os.path.join(d, name), os.X_OK) for d in os.environ.get("PATH", "").split(os.pathsep))


def test_https_server_with_root_path_and_a_short_request_log(async_llm, tmp_path, free_port, caplog):
    """run_server's uvicorn settings (uvicorn_config) and the request log of build_app, served in a thread."""
    import threading

    import uvicorn

    from loopline.entrypoints.openai.api_server import build_app, listen_url, uvicorn_config

    key, cert = _self_signed(tmp_path)
    ns = _serve_parser().parse_args(["--port", str(free_port()), "--ssl-keyfile", key, "--ssl-certfile", cert,
                                     "--root-path", "/api", "--max-log-len", "8", "--enable-log-requests"])
    app = build_app(async_llm, "t", shutdown_engine=False, log_requests=not ns.disable_log_requests,
                    max_log_len=ns.max_log_len)
    server = uvicorn.Server(uvicorn_config(app, ns))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        assert listen_url(ns) == f"https://127.0.0.1:{ns.port}/api"
        deadline = time.monotonic() + 30
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        tls = ssl.create_default_context(cafile=cert)
        # NOTE: the access line is written once the response is sent, which can be after the client has
        # it: the level holds for the whole test, and the line is waited for
        caplog.set_level(logging.INFO, logger="loopline.api")
        with httpx.Client(base_url=f"https://127.0.0.1:{ns.port}", verify=tls) as client:
            body = {"model": "t", "prompt": "Hello", "max_tokens": 2}
            assert client.post("/v1/completions", json=body, timeout=60).status_code == 200
        with pytest.raises(httpx.HTTPError):  # plain HTTP is not answered
            httpx.get(f"http://127.0.0.1:{ns.port}/health", timeout=5)

        def logged() -> list[str]:
            return [r.getMessage() for r in caplog.records if "POST /api/v1/completions 200" in r.getMessage()]
        deadline = time.monotonic() + 10
        while not logged() and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
    (line,) = logged()
    details = line.split(" 200 ", 1)[1].split("s ", 1)[1]  # after the status and the time: the cut details
    assert details.endswith("...") and len(details) == len("...") + 8


@pytest.mark.parametrize("flags, words", [
    (["--ssl-keyfile", "k.pem"], "--ssl-keyfile and --ssl-certfile go together"),
    (["--ssl-keyfile", "k.pem", "--ssl-certfile", "c.pem"], "--ssl-keyfile k.pem: no such file"),
    (["--ssl-ca-certs", "ca.pem"], "--ssl-ca-certs needs --ssl-keyfile and --ssl-certfile"),
    (["--uds", "/no/such/dir/s.sock"], "--uds /no/such/dir/s.sock: its directory does not exist"),
    (["--disable-log-requests", "--enable-log-requests"], "contradict each other"),
    (["--max-log-len", "-1"], "--max-log-len must be >= 0, got -1"),
    (["--response-role", " "], "--response-role must be a non-empty role name"),
])
def test_server_flag_conflicts_are_named(flags, words):
    from loopline.entrypoints.openai.api_server import check_listen_flags

    with pytest.raises(SystemExit, match=re.escape(words)):
        check_listen_flags(_serve_parser().parse_args(flags))


def test_sleep_routes_on_a_public_bind_need_an_api_key():
    from loopline.entrypoints.openai.api_server import check_exposure

    with pytest.raises(SystemExit, match="--enable-sleep-mode with --host 0.0.0.0 .* needs --api-key"):
        check_exposure("0.0.0.0", False, None, sleep_routes=True)
    check_exposure("0.0.0.0", False, "key", sleep_routes=True)
    check_exposure("127.0.0.1", False, None, sleep_routes=True)
