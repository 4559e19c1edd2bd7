"""The chat page at `/` in a real browser: headless Chromium (Debian's chromium and
chromium-driver, driven by selenium) against a running smollm2 server: the model from
/v1/models, a question answered by streaming, the stop button cancelling a long answer. Skips
where Chromium is absent (.ci/run installs it)."""

from __future__ import annotations

import json
import os
import re
import shutil
import time

import pytest
import torch
from test_server import Server, folder  # noqa: F401  (folder: a fixture)

from core import load_model
from core.serve.app import create_app

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")


def test_the_page_is_one_file_that_fetches_nothing_else():
    server = Server(create_app(load_model("smollm2", max_seq_len=64), "smollm2"))
    try:
        import http.client

        conn = http.client.HTTPConnection(server.url.removeprefix("http://"), timeout=30)
        conn.request("GET", "/")
        resp = conn.getresponse()
        page = resp.read().decode()
    finally:
        server.close()
    assert resp.status == 200 and resp.getheader("content-type").startswith("text/html")
    assert "/v1/chat/completions" in page and "/v1/models" in page
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page)  # no outside resource
    assert "import " not in page and 'fetch("http' not in page


@pytest.fixture(scope="module")
def browser():
    if not (CHROMIUM and DRIVER):
        pytest.skip("headless Chromium absent: apt-get install chromium chromium-driver")
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium not installed")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(arg)
    options.add_argument("--window-size=1000,700")
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def page(browser):
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    model = load_model("smollm2", max_seq_len=512)
    server = Server(create_app(model, "smollm2"))
    server.model = model
    browser.get(server.url + "/")
    yield browser, server
    server.close()
    torch.set_num_threads(n)


def wait_for(check, timeout=120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError("timed out")


def finished(answer) -> str:
    """The answer's state once it is no longer streaming: done, stopped or error."""
    state = lambda: answer.get_attribute("data-state")  # noqa: E731
    wait_for(lambda: state() != "streaming")
    return state()


def ask(driver, text: str):
    from selenium.webdriver.common.by import By

    box = driver.find_element(By.ID, "input")
    box.send_keys(text)
    driver.find_element(By.ID, "send").click()
    return wait_for(lambda: driver.find_elements(By.CSS_SELECTOR, ".msg.assistant, .msg.error"))[-1]


def test_a_question_is_answered_by_streaming(page):
    from selenium.webdriver.common.by import By

    driver, _ = page
    shown = lambda: driver.find_element(By.ID, "model").text  # noqa: E731
    assert wait_for(lambda: shown() != "…" and shown()) == "smollm2"  # from /v1/models
    temperature = driver.find_element(By.ID, "temperature")
    temperature.clear()
    temperature.send_keys("0")
    answer = ask(driver, "What is the capital of France?")
    assert finished(answer) == "done"
    assert "Paris" in answer.text
    if os.environ.get("ZOO_SCREENSHOT"):  # docs/chat_page.png is made this way
        driver.save_screenshot(os.environ["ZOO_SCREENSHOT"])


def prompt_tokens(server) -> float:
    """The server's vllm:prompt_tokens_total."""
    import http.client

    from prometheus_client.parser import text_string_to_metric_families

    conn = http.client.HTTPConnection(server.url.removeprefix("http://"), timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    families = text_string_to_metric_families(text)
    samples = [s for f in families for s in f.samples if s.name == "vllm:prompt_tokens_total"]
    return samples[0].value


def test_the_system_prompt_is_sent(page):
    """The server counts the prompt the page sent: the system prompt's turn and the question,
    through the model's template (vllm:prompt_tokens_total)."""
    from selenium.webdriver.common.by import By

    driver, server = page
    system = driver.find_element(By.ID, "system")
    system.send_keys("Answer in one word.")
    before = prompt_tokens(server)
    answer = ask(driver, "Capital of Italy?")
    assert finished(answer) == "done"
    sent = prompt_tokens(server) - before
    history = [{"role": "system", "content": "Answer in one word."}]
    for div in driver.find_elements(By.CSS_SELECTOR, ".msg")[:-1]:  # all but this answer
        if "user" in div.get_attribute("class"):
            history.append({"role": "user", "content": div.text})
        else:
            text = div.find_element(By.CLASS_NAME, "answer").text
            history.append({"role": "assistant", "content": text})
    tok = server.model.tokenizer
    assert sent == len(tok.apply_chat_template(history))
    system.clear()


def test_stop_cancels_the_answer_and_frees_its_row(page):
    from selenium.webdriver.common.by import By

    driver, server = page
    answer = ask(driver, "Write a very long story about a dragon.")
    wait_for(lambda: len(answer.find_element(By.CLASS_NAME, "answer").text) > 10)
    driver.find_element(By.ID, "stop").click()
    assert finished(answer) == "stopped"
    assert answer.text.endswith("[stopped]")
    assert driver.find_element(By.ID, "send").is_enabled()
    health = lambda: server.raw("GET", "/health", key=None)[1]  # noqa: E731
    assert wait_for(lambda: health().get("running") == 0 and health(), timeout=30)
    assert json.dumps(health())  # (the server still answers)


def test_reasoning_is_shown_folded(browser, folder, tmp_path_factory):  # noqa: F811
    """A thinking model (the tiny one of test_reasoning_api.py, scripted): the page folds its
    reasoning_content away from the answer."""
    from selenium.webdriver.common.by import By
    from test_reasoning_api import thinking_server

    server = thinking_server(folder, tmp_path_factory.mktemp("page"), opens=True)
    try:
        browser.get(server.url + "/")
        answer = ask(browser, "What is the capital of France?")
        assert finished(answer) == "done"
        details = answer.find_element(By.CSS_SELECTOR, "details.reasoning")
        assert details.get_attribute("open") is None  # folded
        assert "reasoning (" in details.text
        assert answer.find_element(By.CLASS_NAME, "answer").text == "Paris."
        browser.execute_script("arguments[0].open = true", details)
        assert "Paris is the capital." in details.text
    finally:
        server.close()


def get(server, path: str):
    """(status, content type, body) of GET path."""
    import http.client

    conn = http.client.HTTPConnection(server.url.removeprefix("http://"), timeout=30)
    conn.request("GET", path)
    resp = conn.getresponse()
    out = resp.status, resp.getheader("content-type"), resp.read()
    conn.close()
    return out


def opened(driver, server) -> None:
    """The page of `server`, fresh, once it shows the model from /v1/models."""
    from selenium.webdriver.common.by import By

    driver.get(server.url + "/")
    shown = lambda: driver.find_element(By.ID, "model").text  # noqa: E731
    assert wait_for(lambda: shown() != "…" and shown()) == "smollm2"
    driver.find_element(By.ID, "temperature").clear()
    driver.find_element(By.ID, "temperature").send_keys("0")


def test_the_favicon_is_an_image(page):
    """GET /favicon.ico answers (no 404 in the console) with an image the browser draws."""
    driver, server = page
    status, kind, body = get(server, "/favicon.ico")
    assert status == 200 and kind == "image/svg+xml" and body.startswith(b"<svg")
    opened(driver, server)
    width = driver.execute_async_script(
        """const done = arguments[arguments.length - 1], img = new Image();
        img.onload = () => done(img.naturalWidth); img.onerror = () => done(-1);
        img.src = "/favicon.ico";"""
    )
    assert width > 0


def test_the_api_key_placeholder_fits(page):
    driver, server = page
    opened(driver, server)
    room, text = driver.execute_script(
        """const box = document.getElementById("key"), style = getComputedStyle(box);
        const ctx = document.createElement("canvas").getContext("2d");
        ctx.font = style.font;
        const pad = parseFloat(style.paddingLeft) + parseFloat(style.paddingRight);
        return [box.clientWidth - pad, ctx.measureText(box.placeholder).width];"""
    )
    assert text <= room, (text, room)


def template_tokens(server, *questions: str) -> int:
    messages = [{"role": "user", "content": q} for q in questions]
    return len(server.model.tokenizer.apply_chat_template(messages))


def test_new_chat_forgets_the_conversation(page):
    from selenium.webdriver.common.by import By

    driver, server = page
    opened(driver, server)
    assert finished(ask(driver, "Capital of Spain?")) == "done"
    driver.find_element(By.ID, "new").click()
    assert driver.find_elements(By.CSS_SELECTOR, ".msg") == []
    before = prompt_tokens(server)
    assert finished(ask(driver, "Capital of Italy?")) == "done"
    assert prompt_tokens(server) - before == template_tokens(server, "Capital of Italy?")


@pytest.fixture(scope="module")
def small(browser):
    """A server of 160 tokens of context: the page asks for answers of 80 at most."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    model = load_model("smollm2", max_seq_len=160)
    server = Server(create_app(model, "smollm2"))
    server.model = model
    yield browser, server
    server.close()
    torch.set_num_threads(n)


def test_the_oldest_turns_are_dropped_when_the_context_is_full(small):
    """A long first answer leaves no room for a second question with its answer: the page
    drops the first turn, says so, and the second question is answered alone."""
    from selenium.webdriver.common.by import By

    driver, server = small
    opened(driver, server)
    assert finished(ask(driver, "Write a very long story about a dragon.")) == "done"
    before = prompt_tokens(server)
    assert finished(ask(driver, "What is the capital of France?")) == "done"
    note = driver.find_element(By.CSS_SELECTOR, "#log .note").text
    assert note == "(dropped the 2 oldest messages to fit the context of 160 tokens)"
    kinds = [d.get_attribute("class") for d in driver.find_elements(By.CSS_SELECTOR, ".msg")]
    assert kinds == ["msg user dropped", "msg assistant dropped", "msg user", "msg assistant"]
    sent = prompt_tokens(server) - before  # (the refused request ran nothing)
    assert sent == template_tokens(server, "What is the capital of France?")


def test_a_failed_turn_is_not_sent_again(small):
    from selenium.webdriver.common.by import By

    driver, server = small
    opened(driver, server)
    box = driver.find_element(By.ID, "input")
    driver.execute_script("arguments[0].value = arguments[1]", box, "dragon " * 300)
    driver.find_element(By.ID, "send").click()
    failed = wait_for(lambda: driver.find_elements(By.CSS_SELECTOR, ".msg.error"))[-1]
    assert finished(failed) == "error" and "exceeds the context length" in failed.text
    assert "failed" in driver.find_element(By.CSS_SELECTOR, ".msg.user").get_attribute("class")
    before = prompt_tokens(server)
    assert finished(ask(driver, "Capital of Italy?")) == "done"
    assert prompt_tokens(server) - before == template_tokens(server, "Capital of Italy?")
    assert driver.find_elements(By.CSS_SELECTOR, ".note") == []  # sent alone: nothing dropped
