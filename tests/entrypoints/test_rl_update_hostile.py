"""/update_weights_from_disk with a malformed checkpoint (issue #43): a 400 on model_path, never a 500;
the server log names the file and field; the old weights keep serving."""
from __future__ import annotations

import logging
import re

import httpx
import pytest

from loopline.models.tiny import make_tiny_checkpoint
from rl.test_disk_update_hostile import CASES

KEY = "rl-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def srv(async_llm, serve_app):
    # the shared default engine: every update here is refused, and async_llm checks the next module still
    # gets weight version 0, committed
    from loopline.entrypoints.openai.api_server import build_app

    return serve_app(build_app(async_llm, "tiny-rl", api_key=KEY, shutdown_engine=False, enable_rl_api=True))


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_malformed_update_checkpoint_is_a_400_and_the_log_names_it(srv, tmp_path, case, caplog):
    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", seed=3, shards=2)
    spoil, message = CASES[case]
    spoil(ckpt)
    with caplog.at_level(logging.WARNING):
        r = httpx.post(srv.base_url + "/update_weights_from_disk", json={"model_path": str(ckpt), "version": 1},
                       headers=AUTH, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "model_path" and "not a loadable checkpoint" in err["message"]
    assert str(tmp_path) not in err["message"]  # the client learns nothing of the server's files
    assert any(re.search(message, rec.getMessage()) for rec in caplog.records), message
    r = httpx.get(srv.base_url + "/get_weight_version", headers=AUTH, timeout=60)
    assert r.json() == {"weight_version": 0, "weights": "committed"}
