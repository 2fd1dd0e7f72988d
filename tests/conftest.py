"""Shared fixtures: tiny checkpoints built once per session with the project's own helper."""
from __future__ import annotations

import ctypes
import gc
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

torch.set_num_threads(1)  # tiny models: threads only add contention on small CI machines
# Without a GPU, Triton kernels run in its CPU interpreter, which Triton reads when a kernel is decorated:
# set here, before any test module imports a kernel, so that any subset of the tests sees one mode.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _share_httpx_ssl_contexts() -> None:
    """httpx builds a new SSL context for every client it makes (loading the CA bundle: ~50 ms, ~100 ms on a
    busy 2-core machine), and the tests make one for nearly every request to their loopback servers
    (``httpx.post(...)``, an OpenAI client per test): a context is built once for each set of arguments and
    shared. Only the plain cases (``verify`` True or False, no client certificate) are shared; a context a
    caller passes, or one with a certificate chain, is built as before."""
    try:
        from httpx._transports import default as transports
    except ImportError:  # another httpx layout: every client builds its own, as without this
        return
    build = getattr(transports, "create_ssl_context", None)
    if build is None:
        return
    built: dict[tuple, object] = {}

    def shared(verify=True, cert=None, trust_env=True):
        if cert is not None or not isinstance(verify, bool):
            return build(verify=verify, cert=cert, trust_env=trust_env)
        key = (verify, trust_env, os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR"))
        if key not in built:
            built[key] = build(verify=verify, cert=cert, trust_env=trust_env)
        return built[key]

    transports.create_ssl_context = shared


_share_httpx_ssl_contexts()


def _glibc():
    try:
        return ctypes.CDLL("libc.so.6") if sys.platform == "linux" else None
    except OSError:  # another libc (musl)
        return None


_LIBC = _glibc()


def pytest_collection_finish(session):
    """What is imported and collected by now (torch, transformers, the test modules: ~half a million objects)
    lives for the whole run: frozen out of the collector's sight, so that each full collection (the one after
    every module, below, and those the interpreter runs itself) stops walking it: ~0.25 s each otherwise."""
    gc.collect()
    gc.freeze()


@pytest.fixture(scope="module", autouse=True)
def _release_memory_after_each_module():
    """Engines, servers and models of a finished module are garbage; glibc keeps the freed heap, so without a
    trim every worker's RSS only grows (two workers' together past 5 GB on CI, where the budget is 4 GB)."""
    yield
    gc.collect()
    if _LIBC is not None and hasattr(_LIBC, "malloc_trim"):
        _LIBC.malloc_trim(0)


class Tiny:
    """A tiny checkpoint on disk plus what the independent reference needs."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.cfg = json.loads((path / "config.json").read_text())
        self.state_dict = load_file(str(path / "model.safetensors"))

    def llm(self, **kwargs):
        from loopline import LLM

        kwargs.setdefault("dtype", "float32")
        kwargs.setdefault("device", "cpu")
        return LLM(str(self.path), **kwargs)


@pytest.fixture(scope="session")
def tiny_factory(tmp_path_factory):
    cache: dict[tuple, Tiny] = {}

    def make(seed: int = 0, **overrides) -> Tiny:
        key = (seed, tuple(sorted(overrides.items())))
        if key not in cache:
            from loopline.models.tiny import make_tiny_checkpoint

            path = tmp_path_factory.mktemp("tiny")
            make_tiny_checkpoint(path, seed=seed, **overrides)
            cache[key] = Tiny(path)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_gqa(tiny_factory) -> Tiny:
    return tiny_factory(0)


@pytest.fixture(scope="session")
def tiny_mha(tiny_factory) -> Tiny:
    return tiny_factory(1, num_key_value_heads=4, total_ut_steps=3, num_hidden_layers=1)
