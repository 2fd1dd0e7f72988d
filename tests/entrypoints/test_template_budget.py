"""Chat templates render under budgets they cannot escape (time, output, one operation's size); a render
past one fails its own request with a 400 naming ``chat_template`` and frees its tokenizer thread;
shutdown never waits on a render."""
from __future__ import annotations

import copy
import subprocess
import sys
import textwrap
import threading
import time

import httpx
import pytest

from loopline.entrypoints import template_budget
from loopline.entrypoints.chat_utils import ChatEncoder
from loopline.entrypoints.template_budget import (RENDER_OUTPUT_BUDGET_CHARS, RENDER_TIME_BUDGET_S, TemplateBudgetError,
                                                  bounded_render, check_template_source)
from loopline.errors import InvalidRequestError

MODEL = "tiny-budget"
MESSAGES = [{"role": "user", "content": "Hi!"}]
SPIN = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
SPIN_OUTPUT = "{% for i in range(100000) %}{% for j in range(100000) %}{{ 'abcd' * 25 }}{% endfor %}{% endfor %}"
DOUBLING = ("{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"
            "{{ ns.s|length }}")
ONE_HUGE_STEP = {
    "string-times-literal": "{{ 'x' * 10000000000 }}",
    "power": "{{ 'x' * 10 ** 10 }}",
    "times-a-variable": "{% set n = messages|length * 100 %}{{ 'x' * n }}",
    "chain-of-small-factors": "{{ 'x' * 256 * 256 * 256 }}",
    "percent-width": "{{ '%09999999999d' % 1 }}",
    "format-width": "{{ '{:>9999999999}'.format(1) }}",
    "format-filter-width": "{{ '%09999999999d'|format(1) }}",
    "center-method": "{{ 'x'.center(9999999999) }}",
    "indent-filter": "{{ 'a\nb'|indent(9999999999) }}",
}


@pytest.fixture(scope="module")
def tok(tiny_gqa):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_gqa.path))


@pytest.fixture
def short_budget(monkeypatch):
    monkeypatch.setattr(template_budget, "RENDER_TIME_BUDGET_S", 0.3)


def _refused(enc: ChatEncoder, template: str | None, budget_word: str) -> float:
    start = time.monotonic()
    with pytest.raises(TemplateBudgetError) as e:
        enc.render(MESSAGES, chat_template=template)
    assert e.value.param == "chat_template" and budget_word in str(e.value), str(e.value)
    assert isinstance(e.value, InvalidRequestError)  # a 400 over HTTP
    return time.monotonic() - start


def test_a_spinning_template_stops_at_the_time_budget(tok):
    """The checkpoint's own template (no request template): the real default budget, measured."""
    spinning = copy.deepcopy(tok)
    spinning.chat_template = SPIN
    took = _refused(ChatEncoder(spinning, None), None, f"time budget of {RENDER_TIME_BUDGET_S:g} s")
    assert RENDER_TIME_BUDGET_S <= took < RENDER_TIME_BUDGET_S + 1.5
    assert sys.gettrace() is None  # the trace is gone after the render


def test_a_spinning_template_with_output_stops_at_the_output_budget(tok):
    took = _refused(ChatEncoder(tok, None), SPIN_OUTPUT, f"output budget of {RENDER_OUTPUT_BUDGET_CHARS} characters")
    assert took < RENDER_TIME_BUDGET_S


def test_a_value_doubled_in_a_loop_is_stopped_before_it_fills_memory(tok):
    took = _refused(ChatEncoder(tok, None), DOUBLING, "above its budget")
    assert took < 1.0


@pytest.mark.parametrize("case", list(ONE_HUGE_STEP))
def test_an_operation_of_unbounded_size_is_refused_before_rendering(case):
    # NOTE: checked without rendering: were the check to fail, rendering would allocate tens of GB
    with pytest.raises(TemplateBudgetError) as e:
        check_template_source(ONE_HUGE_STEP[case])
    assert e.value.param == "chat_template"


def test_the_check_runs_before_any_render_or_variable_lookup(tok):
    """Wired in front of rendering and of the template-variable scan (which compiles, folding constants);
    the case is harmless if it did run."""
    enc = ChatEncoder(tok, None)
    _refused(enc, "{{ 'x' * 300 }}", "integer literal of at most 256")
    with pytest.raises(TemplateBudgetError):
        enc.template_variables("{{ 'x' * 300 }}")



def test_the_servers_own_template_is_warned_about_not_refused(tok, caplog):
    """The checkpoint's template (every named one) is the operator's: an operation the check cannot bound
    is logged once and the template renders, under the time and output budgets; a request's is refused."""
    named = copy.deepcopy(tok)
    named.chat_template = {"default": "{{ messages | length }}", "tool_use": "{{ 'x' * 300 }}"}
    enc = ChatEncoder(named, None)
    with caplog.at_level("WARNING", logger="loopline.api"):
        assert enc.render(MESSAGES) == str(len(MESSAGES))
    assert "integer literal" in caplog.text and "server's own template" in caplog.text
    own = copy.deepcopy(tok)
    own.chat_template = "{% for m in messages %}{{ ' ' * (loop.index * 2) }}{{ m.content }}{% endfor %}"
    assert ChatEncoder(own, None).render(MESSAGES) == "".join(" " * (2 * i + 2) + m["content"]
                                                              for i, m in enumerate(MESSAGES))
    _refused(ChatEncoder(tok, None), own.chat_template, "integer literal")  # the same, sent by a request


def test_normal_templates_render_as_before(tok):
    enc = ChatEncoder(tok, None)
    messages = [{"role": "system", "content": "Be brief."}, *MESSAGES, {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": "And?"}]
    assert enc.render(messages) == tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    small = ("{{ '-' * 3 }}{% for m in messages %}{{ m.role * 2 }}{{ '%03d' % loop.index }}{% endfor %}"
             "{{ ' id 12345678: %s' % 'x' }}{{ '{}: 12345678'.format('y') }}")
    assert enc.render(MESSAGES, chat_template=small) == "---useruser001 id 12345678: xy: 12345678"
    assert sys.gettrace() is None


def test_the_trace_is_restored_after_an_error_and_a_previous_tracer_kept():
    def previous(frame, event, arg):
        return None

    sys.settrace(previous)
    try:
        with pytest.raises(ZeroDivisionError):
            bounded_render(lambda: 1 / 0)
        assert sys.gettrace() is previous
    finally:
        sys.settrace(None)


# --- over HTTP: the pool's threads are freed; /tokenize answers like chat ----------------------------
@pytest.fixture(scope="module")
def trusted(async_llm, serve_app):
    from loopline.entrypoints.openai.api_server import build_app

    return serve_app(build_app(async_llm, MODEL, shutdown_engine=False, trust_request_chat_template=True))


def _post(srv, path: str, body: dict) -> httpx.Response:
    return httpx.post(srv.base_url + path, json={"model": MODEL, **body}, timeout=60)


def test_spinning_templates_fail_alone_and_free_both_tokenizer_threads(trusted, short_budget):
    """Two spinning renders (one per tokenizer thread, as in the report) and an output bomb: each a 400
    naming chat_template; meanwhile and afterwards chat, completions and /tokenize answer."""
    results: dict[str, httpx.Response] = {}

    def send(name: str, template: str, path: str = "/v1/chat/completions") -> None:
        results[name] = _post(trusted, path, {"messages": MESSAGES, "chat_template": template, "max_tokens": 1}
                              if path != "/tokenize" else {"messages": MESSAGES, "chat_template": template})

    threads = [threading.Thread(target=send, args=a) for a in
               (("spin-chat", SPIN), ("spin-tokenize", SPIN, "/tokenize"), ("output", SPIN_OUTPUT))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for name, r in results.items():
        assert r.status_code == 400, (name, r.text)
        err = r.json()["error"]
        assert err["param"] == "chat_template" and "budget" in err["message"], (name, err)
    assert len(results) == 3
    assert _post(trusted, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1}).status_code == 200
    assert _post(trusted, "/v1/completions", {"prompt": "hi", "max_tokens": 1}).status_code == 200
    assert _post(trusted, "/tokenize", {"messages": MESSAGES}).status_code == 200


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
def test_a_template_that_raises_is_a_400_on_chat_and_tokenize(trusted, path):
    for template, words in (("{{ raise_exception('roles must alternate') }}", "roles must alternate"),
                            ("{{ messages[0].content.nope() }}", "could not render")):
        r = _post(trusted, path, {"messages": MESSAGES, "chat_template": template})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "messages" and words in err["message"], err


def test_shutdown_never_waits_on_a_render(tmp_path):
    """A job stuck past any budget (here: in C, time.sleep) does not hold the process at exit."""
    script = textwrap.dedent("""
        import asyncio, time
        from loopline.entrypoints.tokenizer_pool import TokenizerPool

        class Tok:
            chat_template = None

        async def main():
            pool = TokenizerPool(Tok(), None, None, workers=2)
            for _ in range(2):
                asyncio.get_running_loop().create_task(pool.run(lambda tok, chat: time.sleep(120)))
            await asyncio.sleep(0.2)
            pool.shutdown()
            print("shut down", flush=True)

        asyncio.run(main())
    """)
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "shut down" in out.stdout, out.stderr[-2000:]
    assert time.monotonic() - start < 30
