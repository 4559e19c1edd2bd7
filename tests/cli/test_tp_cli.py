"""`zoo run --tp 2` (two gloo ranks started through torch.distributed.run) prints what one
process prints; `torchrun --nproc-per-node 2 -m core.cli run` does too."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from conftest import chat_llama_folder

ARGS = ["--raw", "-p", "The sky is", "--max-new-tokens", "12", "--device", "cpu"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return chat_llama_folder(tmp_path_factory.mktemp("tiny-tp"))


def run(*argv: str) -> subprocess.CompletedProcess:
    env_cmd = [sys.executable, *argv]
    return subprocess.run(env_cmd, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def alone(folder) -> subprocess.CompletedProcess:
    """`zoo run` in one process: what every split run must print."""
    out = run("-m", "core.cli", "run", str(folder), *ARGS)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip()  # some text, greedy
    return out


def test_run_tp2_prints_the_same_greedy_text(folder, alone):
    split = run("-m", "core.cli", "run", str(folder), "--tp", "2", *ARGS)
    assert split.returncode == 0, split.stderr
    assert split.stdout == alone.stdout  # rank 0 alone prints
    torchrun = [
        "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "core.cli", "run", str(folder), *ARGS,
    ]  # fmt: skip
    launched = run(*torchrun)
    assert launched.returncode == 0, launched.stderr
    assert launched.stdout == alone.stdout


def stop(nodes: list[subprocess.Popen]) -> None:
    """Stop the torchrun agents still running: SIGTERM (an agent stops its worker), then
    SIGKILL for one waiting in the exit barrier, where it runs no signal handler (its worker
    is done by then)."""
    for p in nodes:
        if p.poll() is None:
            p.terminate()
    for p in nodes:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()


def test_two_nodes_rendezvous_over_localhost(folder, alone, tmp_path):
    """Two torchrun "nodes" of one rank each, joined by the c10d rendezvous on 127.0.0.1 (as
    far as one machine can try several): the node holding rank 0 prints the text, the other
    nothing.

    Node 0 alone hosts the rendezvous store (`is_host`): left to guess, both agents try to bind
    the port and the loser falls back to a client. A node whose worker fails skips torchrun's
    exit barrier, where the other node's agent then waits 300 s for it: so the nodes are
    watched together, and the first failure stops the other and is reported at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    node = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "zoo-test",
    ]  # fmt: skip
    logs = [tmp_path / f"node{i}.err" for i in range(2)]  # files: a pipe unread could fill
    nodes = []
    for i, log in enumerate(logs):
        with log.open("w") as err:
            nodes.append(subprocess.Popen(
                [*node, "--rdzv-conf", f"is_host={int(i == 0)}", "-m", "core.cli", "run",
                 str(folder), *ARGS],
                stdout=subprocess.PIPE, stderr=err, text=True,
            ))  # fmt: skip
    deadline = time.monotonic() + 150  # ~10 s here; a hang fails well before any 300 s wait
    while None in (codes := [p.poll() for p in nodes]):  # every node polled, each time
        if any(codes) or time.monotonic() > deadline:
            stop(nodes)
            break
        time.sleep(0.1)
    outs = [p.communicate(timeout=60)[0] for p in nodes]
    errs = [log.read_text()[-3000:] for log in logs]
    assert [p.returncode for p in nodes] == [0, 0], errs
    assert sorted(outs) == sorted(["", alone.stdout])


def test_chat_tp2_answers_every_turn_as_one_process(folder):
    """`zoo chat --tp 2`: rank 0 reads the turns and prints; two turns (the second with the
    first in its history) equal one process's, byte for byte."""
    turns = "Hello there\nAnd then?\n/exit\n"
    cmd = [sys.executable, "-m", "core.cli", "chat", str(folder), "--max-new-tokens", "8"]
    alone = subprocess.run(cmd, input=turns, capture_output=True, text=True, timeout=300)
    split = subprocess.run(
        [*cmd, "--tp", "2"], input=turns, capture_output=True, text=True, timeout=300
    )
    assert alone.returncode == 0 and split.returncode == 0, split.stderr
    assert alone.stdout.count("> ") == 3  # two answers, then /exit
    assert split.stdout == alone.stdout


def test_run_tp_that_does_not_divide_is_said_once(folder):
    out = run("-m", "core.cli", "run", str(folder), "--tp", "3", *ARGS)
    assert out.returncode == 1
    said = "zoo: error (rank 0): "
    assert out.stderr.count("cannot split") == 1, out.stderr  # rank 0 alone says it
    assert said in out.stderr and "tp=3 cannot split num_attention_heads = 4" in out.stderr
    assert "sizes this model allows: 1, 2, 4" in out.stderr
    assert "Traceback" not in out.stderr
    assert "--tp 3: rank" in out.stderr  # the launcher's summary


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def test_serve_tp2_answers_from_rank_0_as_one_process(folder):
    """`zoo serve --tp 2`: only rank 0 listens; its answers (stop strings applied there) are
    the single process's; Ctrl-C stops every rank."""
    from core import load_model

    alone = load_model(folder, device="cpu")
    full = alone.generate("The sky is", max_new_tokens=12).text
    stop = full[len(full) // 2 :][:3]  # a stop string from the answer's second half
    assert stop.strip() and stop in full
    cmd = [sys.executable, "-m", "core.cli", "serve", str(folder), "--tp", "2", "--port", "0"]
    proc = subprocess.Popen(
        [*cmd, "--device", "cpu"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        line = proc.stdout.readline()
        url = re.search(r"at (http://\S+/v1) ", line)
        assert url, line + (proc.stderr.read() if proc.poll() is not None else "")
        deadline = time.monotonic() + 60
        while True:  # uvicorn starts a moment after the line
            try:
                urllib.request.urlopen(url[1].removesuffix("/v1") + "/health", timeout=5)
                break
            except OSError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        body = dict(model=str(folder), prompt="The sky is", max_tokens=12, temperature=0)
        assert post(url[1] + "/completions", body)["choices"][0]["text"] == full
        cut = post(url[1] + "/completions", dict(body, stop=[stop]))["choices"][0]["text"]
        assert cut == full[: full.index(stop)]
    finally:
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        proc.wait(timeout=60)
    assert proc.returncode in (0, 130), proc.stderr.read()


def test_bench_tp2_measures_rank_0s_part(folder):
    """`zoo bench --tp 2` runs its prefill and decode figures with both ranks (rank 0 reports
    them: its weights are half the model's, bar the replicated norms)."""
    from core import load_model
    from core.parallel.tp import resident_bytes

    args = ["--prompt-lens", "8", "--batches", "1", "--decode-tokens", "4", "--repeat", "1"]
    args += ["--peak-gbps", "10"]  # no 1 GiB bandwidth probe
    split = run("-m", "core.cli", "bench", str(folder), "--tp", "2", "--json", "-", *args)
    assert split.returncode == 0, split.stderr
    report = json.loads(split.stdout[split.stdout.index("{") :])
    assert report["decode"]["1"]["tokens_per_s"] > 0
    whole = resident_bytes(load_model(folder, device="cpu").net)
    assert report["weight_bytes"] <= 0.55 * whole
