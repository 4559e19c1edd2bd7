"""`zoo bench` runs end to end and reports every figure (speed itself is never asserted)."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import LLAMA31, chat_llama_folder

from core.errors import ZooError

REPO = Path(__file__).resolve().parents[2]


def bench(*args: str, cwd, env: dict | None = None) -> subprocess.CompletedProcess:
    """`zoo bench` in `cwd`, running this checkout's code (in another folder `-m core.cli` would
    import the installed one: the main checkout's, for a git worktree's tests)."""
    env = {**(env or os.environ), "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "core.cli", "bench", *args],
        capture_output=True, text=True, timeout=600, cwd=cwd, env=env,
    )  # fmt: skip


def test_bench_reports_every_figure_and_compares(checkpoint, tmp_path):
    """Every figure as its definition and the run's own wall time say: no timed span can be
    longer than the whole command, so each rate is at least its work over that wall time."""
    root, ref = checkpoint(LLAMA31)
    small = ["--prompt-lens", "8,16", "--batches", "1,2", "--decode-tokens", "4", "--repeat", "1"]
    start = time.monotonic()
    out = bench(str(root), *small, "--compare", "transformers", "--json", "r.json", cwd=tmp_path)
    wall = time.monotonic() - start
    assert out.returncode == 0, out.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert set(report["prefill"]) == {"8", "16"} and set(report["decode"]) == {"1", "2"}
    for n, row in report["prefill"].items():  # n prompt tokens before the first new one
        assert 0 < row["time_to_first_token_s"] < wall
        assert row["tokens_per_s"] == pytest.approx(int(n) / row["time_to_first_token_s"])
    weights = 4 * sum(p.numel() for p in ref.parameters())  # fp32, counted by transformers
    assert report["weight_bytes"] == weights
    for b, row in report["decode"].items():  # b rows x 3 tokens after each row's first
        b = int(b)
        assert row["tokens_per_s"] >= b * 3 / wall
        assert row["step_ms"] == pytest.approx(1e3 * b / row["tokens_per_s"])
        # a step reads every weight but the (untied) embedding table, a row per token, and each
        # row's cache: prompt 32 + on average 4 / 2 tokens
        assert not ref.config.tie_word_embeddings
        table = 4 * ref.model.embed_tokens.weight.numel()
        moved = weights - table + b * (32 + 2) * report["kv_bytes_per_token"]
        assert row["achieved_gbps"] == pytest.approx(moved / (row["step_ms"] / 1e3) / 1e9)
        assert row["fraction_of_peak"] == row["achieved_gbps"] / report["peak_bandwidth_gbps"]
    assert report["peak_source"].startswith("measured")
    assert report["peak_bandwidth_gbps"] >= 2**30 / wall / 1e9  # 1 GiB read in under `wall`
    assert "GB/s (measured" in out.stdout and "n/a" not in out.stdout
    assert (
        report["kv_bytes_per_token"] == 2 * 2 * 1 * 16 * 4
    )  # K,V x layers x kv heads x dim x fp32
    compare = report["compare"]
    assert compare["peer"] == "transformers"
    for side in ("zoo", "transformers"):  # 4 tokens per timed run, each inside the wall time
        assert compare[f"{side}_tokens_per_s"] == statistics.median(compare["runs"][side])
        assert all(rate >= 4 / wall for rate in compare["runs"][side])
    assert compare["speedup"] == compare["zoo_tokens_per_s"] / compare["transformers_tokens_per_s"]
    assert report["compare"]["same_tokens"] == 4  # both ran the same weights, greedy, fp32
    assert "tokens/s" in out.stdout and "vs transformers" in out.stdout
    assert report["compiled"] is False and "compiled" not in out.stdout


def test_bench_compile_flags_compile_both_sides(checkpoint, tmp_path):
    root, _ = checkpoint(LLAMA31)
    small = ["--prompt-lens", "8", "--batches", "1", "--decode-tokens", "4", "--repeat", "1"]
    out = bench(
        str(root), *small, "--compile", "--compare", "transformers", "--hf-compile",
        "--json", "r.json", cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["compiled"] is True and "decode step compiled" in out.stdout
    # transformers compiled its decode steps (read back from the model, not from the flag)
    assert report["compare"]["peer"] == "transformers (static cache + torch.compile)"
    assert report["compare"]["same_tokens"] == 4


def test_bench_random_weights_of_a_registry_shape(tmp_path):
    small = ["--prompt-lens", "8", "--batches", "1", "--decode-tokens", "2", "--repeat", "1"]
    out = bench(
        "--shape", "smollm2", "--random-weights", *small, "--peak-gbps", "100", "--json", "-",
        cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout[out.stdout.index("{") :])
    assert report["peak_bandwidth_gbps"] == 100.0 and report["peak_source"] == "given"
    row = report["decode"]["1"]
    assert row["fraction_of_peak"] == row["achieved_gbps"] / 100.0
    assert report["params"] == 134_515_008  # SmolLM2-135M's parameter count, tied head
    assert report["model"] == "<random llama>"


def test_bench_compares_random_weights_of_a_registry_shape(tmp_path):
    """No download: the random weights are written once, and both sides load that checkpoint."""
    small = ["--prompt-lens", "8", "--batches", "1", "--decode-tokens", "6", "--repeat", "1"]
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    out = bench(
        "--shape", "smollm2", "--random-weights", "--compare", "transformers", *small,
        "--peak-gbps", "100", "--json", "r.json",
        cwd=tmp_path, env={**os.environ, "TMPDIR": str(scratch)},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    compare = report["compare"]
    assert compare["prompt_tokens"] == 42 and compare["new_tokens"] == 6
    assert compare["same_tokens"] == 6  # identical weights: fp32 greedy tokens agree throughout
    assert report["model"] == "<random llama>" and report["params"] == 134_515_008
    assert "the first 6 of 6" in out.stdout
    # the temporary checkpoint is gone (transformers' from_pretrained leaves torch inductor's
    # cache folder, torchinductor_USER, in TMPDIR: not Zoo's)
    assert [p.name for p in scratch.iterdir() if not p.name.startswith("torchinductor_")] == []


def test_bench_unknown_shape_is_one_line(tmp_path):
    out = bench("--shape", "nope", "--random-weights", cwd=tmp_path)
    assert out.returncode == 1 and "known shapes: smollm2" in out.stderr


def test_bench_refuses_a_shape_larger_than_free_memory(monkeypatch, capsys):
    """A 284B shape on a machine with 8 GiB free: one line naming the shape, its size and the
    shapes that fit, before a byte of weights is drawn (which would fill the RAM page by page)."""
    from core import api
    from core.cli import bench
    from core.cli import commands as cli

    def drawn(*args, **kw):
        raise AssertionError("random weights drawn")

    monkeypatch.setattr(api, "available_memory", lambda device: 8 << 30)
    monkeypatch.setattr(bench, "random_model", drawn)
    monkeypatch.setattr(bench, "random_checkpoint", drawn)
    for more in ([], ["--compare", "transformers"]):
        argv = ["bench", "--shape", "deepseek-v4", "--random-weights", "--device", "cpu", *more]
        assert cli.main(argv) == 1
        err = capsys.readouterr().err
        assert err.startswith("zoo: error: --random-weights 'deepseek-v4': 284.3B parameters need ")
        assert "in float32" in err and "only 8.0 GiB is free on cpu" in err
        assert "bench a smaller shape (smollm2, llama3, " in err and "gemma4" not in err


def test_bench_notes_a_long_cpu_run_before_it_starts():
    """Gemma 4 E2B's 17 GiB of fp32 weights at the default figures: 768 decode steps, at least
    4 min even at 50 GB/s, said with the flags of a short run; a short run says nothing."""
    from core.cli.bench import slow_run_note

    e2b = 4_630_000_000 * 4
    note = slow_run_note(e2b, batches=[1, 4, 16], decode_tokens=64, repeat=3)
    assert note.startswith("zoo bench: note: 17.2 GiB of weights on the CPU, read by each of 768 ")
    assert "at least 5 min at 50 GB/s; --prompt-lens 128 --batches 1 " in note
    assert slow_run_note(e2b, batches=[1], decode_tokens=8, repeat=1) == ""


def test_compare_prompt_past_the_cache_is_one_line_before_the_figures(tmp_path):
    """Llama 3's chat template makes --prompt some 100 tokens, past the 64 + 2 that
    --prompt-lens 8 sizes: said before any figure, with the --prompt-lens that holds it (it
    was load_model's error, after the figures, naming load_model's max_seq_len)."""
    root = chat_llama_folder(tmp_path / "m")
    small = ["--prompt-lens", "8", "--batches", "1", "--decode-tokens", "2", "--repeat", "1"]
    out = bench(str(root), *small, "--compare", "transformers", cwd=tmp_path)
    assert out.returncode == 1 and out.stdout == ""
    line = out.stderr.strip().splitlines()[-1]
    assert line.startswith("zoo: error: --compare: the chat-templated --prompt is "), out.stderr
    n = int(line.split(" is ")[1].split()[0])
    assert f"that is {n + 2}, past the cache of 66 that --prompt-lens sizes" in line
    assert line.endswith(f"pass --prompt-lens {n} or more, or a shorter --prompt")


def test_bench_compiles_nothing_inside_a_timed_run(checkpoint):
    """Compiled, each batch size is a graph of its own: it is built in a warm-up, not timed."""
    import torch._dynamo.utils

    from core import load_model
    from core.cli import bench

    root, _ = checkpoint(LLAMA31)
    model = load_model(root, max_seq_len=64, max_batch_size=2, compile=True)
    graphs = torch._dynamo.utils.counters["stats"]
    generate, built = model.generate, []

    def watched(prompt, max_new_tokens, **kw):
        before = graphs["unique_graphs"]
        out = generate(prompt, max_new_tokens=max_new_tokens, **kw)
        if max_new_tokens == 5:  # the decode runs: per batch size, a warm-up, then 2 timed
            built.append(graphs["unique_graphs"] - before)
        return out

    model.generate = watched
    bench.measure(model, prompt_lens=[8], batches=[1, 2], decode_tokens=5, repeat=2, peak_gbps=1)
    assert len(built) == 6 and built[1:3] == built[4:6] == [0, 0]
    assert built[0] >= 1 and built[3] >= 1  # so the warm-ups did compile, one graph each


def test_compare_runs_on_past_eos_on_both_sides(checkpoint):
    """Both sides may choose eos and go on; forbidding it (min_new_tokens) would part them."""
    from core import load_model
    from core.cli import bench

    root, _ = checkpoint(LLAMA31)
    prompt = bench.random_prompt(LLAMA31["vocab_size"], 1, 12)[0]
    first = load_model(root).generate(prompt, max_new_tokens=1, temperature=0.0).token_ids[0]
    for name in ("config.json", "generation_config.json"):  # that first token is now eos
        if (path := root / name).exists():
            path.write_text(json.dumps({**json.loads(path.read_text()), "eos_token_id": first}))
    model = load_model(root)
    compare = bench.compare_transformers(
        model, model.path, prompt=prompt, decode_tokens=6, repeat=1, compile_hf=False
    )
    assert compare["same_tokens"] == 6


def test_compare_without_transformers_is_one_line(monkeypatch, capsys):
    import importlib.util

    from core.cli import commands as cli

    real = importlib.util.find_spec

    def find_spec(name, *args):
        return None if name == "transformers" else real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    argv = ["bench", "--shape", "smollm2", "--random-weights", "--compare", "transformers"]
    assert cli.main(argv) == 1
    assert capsys.readouterr().err == (
        "zoo: error: --compare transformers: not installed; pip install transformers\n"
    )


def test_random_weights_with_tp_is_one_line_before_any_rank_starts(monkeypatch, capsys):
    """Said once by the launcher, not by each rank after it checked the shape's memory."""
    from core.cli import commands as cli
    from core.parallel import distributed

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setattr(distributed, "launch", lambda *a: pytest.fail("started the ranks"))
    assert cli.main(["bench", "lfm2-350m", "--random-weights", "--tp", "2"]) == 1
    assert capsys.readouterr().err == (
        "zoo: error: --random-weights runs in one process; drop --tp or --random-weights\n"
    )


# --- --compare llama.cpp (llama-cpp-python: an optional extra, zoo[llama-cpp]) -----------------

NO_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is None


def _without(monkeypatch, module: str | None) -> None:
    """find_spec answers None for `module`, and a stand-in spec for llama_cpp otherwise."""
    real = importlib.util.find_spec

    def find_spec(name, *args):
        if name == module:
            return None
        return real("json") if name == "llama_cpp" else real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def test_compare_without_llama_cpp_is_one_line_before_any_work(monkeypatch, capsys):
    from core import hub
    from core.cli import commands as cli

    _without(monkeypatch, "llama_cpp")
    monkeypatch.setattr(hub, "resolve", lambda *a, **k: pytest.fail("resolved a model"))
    assert cli.main(["bench", "--compare", "llama.cpp"]) == 1
    assert capsys.readouterr().err == (
        "zoo: error: --compare llama.cpp: not installed; pip install llama-cpp-python "
        "(the extra zoo[llama-cpp]; builds from source)\n"
    )


def test_compare_llama_cpp_needs_a_gguf_file(monkeypatch, capsys, checkpoint):
    from core.cli import commands as cli

    _without(monkeypatch, None)
    root, _ = checkpoint(LLAMA31)  # config.json + safetensors
    capsys.readouterr()  # (what writing the checkpoint printed)
    assert cli.main(["bench", str(root), "--compare", "llama.cpp"]) == 1
    assert capsys.readouterr().err == (
        f"zoo: error: --compare llama.cpp needs a .gguf file; {root} is not one\n"
    )
    argv = ["bench", "--shape", "smollm2", "--random-weights", "--compare", "llama.cpp"]
    assert cli.main(argv) == 1
    assert "--random-weights makes none" in capsys.readouterr().err


def test_llama_cpp_crashing_on_batches_is_run_one_token_per_step(monkeypatch):
    """llama.cpp 0.3.36's AMX matmul segfaults on multi-token batches; the worker is started
    again with n_ubatch=1, and the report says why. Any other death is an error."""
    from core.cli import bench_llamacpp as lc

    started = []

    class Worker:
        def __init__(self, engine, config):
            started.append(config["n_ubatch"])
            if config["n_ubatch"] > 1:
                raise lc._Died(engine, -signal.SIGSEGV, "")

    monkeypatch.setattr(lc, "_Worker", Worker)
    _, note = lc._llama_worker({"n_ubatch": 512})
    assert started == [512, 1] and "SIGSEGV" in note and "n_ubatch=1" in note

    def exits(engine, config):
        raise lc._Died(engine, 1, "RuntimeError: llama.cpp could not load x.gguf\n")

    monkeypatch.setattr(lc, "_Worker", exits)
    with pytest.raises(ZooError, match=r"worker ended \(exit 1\): RuntimeError: llama.cpp could"):
        lc._llama_worker({"n_ubatch": 512})


@pytest.mark.parametrize("apart", [False, True])
def test_engines_that_do_not_fit_together_run_one_process_at_a_time(monkeypatch, tmp_path, apart):
    """Where both processes would not fit in memory (`_apart`), a Zoo process and then a
    llama.cpp one are alive in turn, each timing one run, `repeat` times; loads are medians of
    each engine's processes. Else both stay alive and their runs alternate."""
    from core.cli import bench_llamacpp as lc

    started, alive = [], []

    class Worker:
        def __init__(self, engine, config):
            n = len(started)
            started.append(engine)
            alive.append(engine)
            info = {"threads": 2, "load_s": 1.0 + n, "weight_bytes": 1, "settings": {},
                    "version": "0"}  # fmt: skip
            self.ready = {"info": info, "warmup": {"tokens": [1, 2]}}
            self.engine = engine

        def ask(self, command):
            assert alive.count(self.engine) == 1 and (len(alive) == 1 or not apart)
            if command == "run":
                return {k: float(len(started)) for k in lc.FIGURES}
            return {"peak_rss_bytes": 10 * len(started)}

        def cpu_s(self):
            return 0.0

        def close(self):
            if self.engine in alive:
                alive.remove(self.engine)

    monkeypatch.setattr(lc, "_Worker", Worker)
    monkeypatch.setattr(lc, "_apart", lambda path: apart)
    monkeypatch.setattr(lc, "gguf_tensor_bytes", lambda path: 1)
    (tmp_path / "m.gguf").write_bytes(b"0")
    c = lc.compare_llama_cpp(tmp_path / "m.gguf", prompt=[1, 2], decode_tokens=2, repeat=3, load={})
    assert c["one_at_a_time"] is apart and not alive
    zoo, peer = c["engines"]["zoo"], c["engines"][lc.PEER]
    if apart:
        assert started == ["zoo", lc.PEER] * 3
        assert zoo["load_s"] == 3.0 and peer["load_s"] == 4.0  # of loads 1, 3, 5 and 2, 4, 6
        assert zoo["decode_tokens_per_s"] == 3.0 and peer["peak_rss_bytes"] == 60
        assert "one process at a time" in lc.render_lines(c)[0]
    else:
        assert started == ["zoo", lc.PEER] and zoo["load_s"] == 1.0
        assert "own processes, alternating" in lc.render_lines(c)[0]
    assert len(zoo["runs"]) == len(peer["runs"]) == 3


LLAMA_RUN = """
import json, sys
import llama_cpp
path, ids, n, settings = json.loads(sys.argv[1])
llm = llama_cpp.Llama(path, n_ctx=len(ids) + n, n_batch=len(ids) + n, verbose=False,
                      n_ubatch=settings["n_ubatch"], n_threads=settings["n_threads"],
                      flash_attn=settings["flash_attn"])
out = []
for t in llm.generate(ids, temp=0.0):  # greedy; generate stops at nothing, eos included
    out.append(t)
    if len(out) == n:
        break
print(json.dumps(out))
"""


@pytest.mark.skipif(
    NO_LLAMA_CPP,
    reason="llama_cpp not importable: llama-cpp-python is an optional extra (zoo[llama-cpp]) "
    "that CI does not install",
)
def test_bench_compares_with_llama_cpp_on_the_same_gguf(tmp_path):
    from gguf import GGUFReader

    from core import load_model
    from core.hub import resolve

    n, prompt = 12, "List three colors."  # here: the first 9 of 12 agree (a near-tie parts them)
    small = ["--prompt-lens", "8", "--batches", "1", "--decode-tokens", str(n), "--repeat", "2"]
    out = bench(
        "smollm2", *small, "--peak-gbps", "100", "--compare", "llama.cpp", "--prompt", prompt,
        "--json", "r.json", cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    c = json.loads((tmp_path / "r.json").read_text())["compare"]
    zoo, peer = c["engines"]["zoo"], c["engines"]["llama.cpp"]
    for e in (zoo, peer):
        assert len(e["runs"]) == 2 and e["threads"] >= 1 and e["peak_rss_bytes"] > 0
        for k in ("prefill_tokens_per_s", "decode_tokens_per_s", "tokens_per_s"):
            assert e[k] == statistics.median(r[k] for r in e["runs"]) > 0
            assert c["ratios"][k] == zoo[k] / peer[k]
    assert c["speedup"] == zoo["decode_tokens_per_s"] / peer["decode_tokens_per_s"]
    assert zoo["threads"] == peer["threads"] == peer["settings"]["n_threads"]
    # the Q4_1 file's blocks are kept as they are on both sides: resident = the file's tensors
    path = resolve("smollm2")
    tensors = sum(int(t.n_bytes) for t in GGUFReader(path).tensors)
    assert c["file_tensor_bytes"] == tensors == zoo["weight_bytes"] == peer["weight_bytes"]
    for line in ("vs llama.cpp", "zoo/llama.cpp", "MiB of tensors", "greedy tokens the same"):
        assert line in out.stdout

    # the agreement, recomputed: Zoo in this process, llama.cpp through its own Llama class
    model = load_model(path)
    ids = model.tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True
    )
    assert len(ids) == c["prompt_tokens"]
    ours = model.generate(ids, max_new_tokens=n, temperature=0.0, ignore_eos=True).token_ids
    job = json.dumps([str(path), ids, n, peer["settings"]])
    run = subprocess.run([sys.executable, "-c", LLAMA_RUN, job], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    theirs = json.loads(run.stdout)
    assert zoo["tokens"] == ours and peer["tokens"] == theirs
    same = 0
    while same < n and ours[same] == theirs[same]:
        same += 1
    assert c["same_tokens"] == same
    assert f"the first {same} of {n}" in out.stdout
