"""`zoo bench --compare llama.cpp`: Zoo and llama.cpp (llama-cpp-python, an optional extra) on
the same GGUF file, each engine in a process of its own, their runs alternating.

Two engines in one process disturb each other (llama.cpp's worker threads can spin after a
call, and torch's run beside them), so neither engine shares a process with the other, and only
one of them runs at a time: this process starts a worker per engine (`python -m
core.cli.bench_worker zoo|llama.cpp CONFIG`), each loads the model and runs once untimed, then they
are asked in turn for one timed greedy run each, over a pipe of JSON lines. Where the two
processes would not fit in memory together (a 12 GB file on a 24 GB machine), only one is
alive at a time: a Zoo process, then a llama.cpp one, each timing one run after its warm-up,
`repeat` times.

llama.cpp 0.3.36's AMX matmul (Sapphire Rapids and later) crashes on batches of more than one
token (its tile configuration lives on the stack, where the compiler leaves it invalid:
llama.cpp issue #20824, PR #26954); where the worker dies of that in its warm-up, it is started
again with `n_ubatch=1` (the prompt fed one token per step, on the same AMX-packed weights),
and the report says so."""

from __future__ import annotations

import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from core.errors import ZooError

PEER = "llama.cpp"
FIGURES = ("prefill_tokens_per_s", "decode_tokens_per_s", "tokens_per_s", "time_to_first_token_s")
PAUSE_S = 0.2  # between one engine's run and the other's: the last one's threads wind down


class _Died(ZooError):
    def __init__(self, engine: str, returncode: int | None, stderr: str):
        self.returncode = returncode
        how = f"signal {-returncode}" if returncode and returncode < 0 else f"exit {returncode}"
        tail = stderr.strip().splitlines()[-1:] or ["(nothing on stderr)"]
        super().__init__(f"--compare {PEER}: the {engine} worker ended ({how}): {tail[0]}")


class _Worker:
    """One engine in a subprocess, loaded and warmed up on start; `ask("run")`: one timed run."""

    def __init__(self, engine: str, config: dict[str, Any]):
        self.engine = engine
        self._err = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed in close())
        paths = [str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH")]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "core.cli.bench_worker", engine, json.dumps(config)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err, text=True, env=env,
        )  # fmt: skip
        try:
            self.ready = self._read()  # {"info": ..., "warmup": run figures}
        except BaseException:
            self.close()
            raise

    def _read(self) -> dict[str, Any]:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            self._err.seek(0)
            raise _Died(self.engine, self.proc.returncode, self._err.read())
        return json.loads(line)

    def ask(self, command: str) -> dict[str, Any]:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self._read()

    def cpu_s(self) -> float | None:
        """CPU seconds the worker has used (Linux), to show that it idles while the other runs."""
        try:
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return None
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._err.close()


def _llama_worker(config: dict[str, Any]) -> tuple[_Worker, str]:
    try:
        return _Worker(PEER, config), ""
    except _Died as died:
        if died.returncode != -signal.SIGSEGV or config["n_ubatch"] == 1:
            raise
    note = "multi-token batches crashed it (SIGSEGV; AMX, llama.cpp #20824): n_ubatch=1"
    return _Worker(PEER, {**config, "n_ubatch": 1}), note


def compare_llama_cpp(
    path: Path,
    *,
    prompt: list[int],
    decode_tokens: int,
    repeat: int,
    load: dict[str, Any],
    llama: dict[str, Any] | None = None,
    ctx: int | None = None,
) -> dict[str, Any]:
    """Greedy runs of `prompt` (token ids) for `decode_tokens` new tokens, eos ignored, on the
    GGUF file `path`: Zoo (`load_model(path, **load)`) and llama.cpp, in two processes, run
    alternately `repeat` times after a warm-up each. `llama` overrides llama.cpp's settings
    (`n_ubatch`, `use_extra_bufts`, `flash_attn`, `n_threads`). Returns medians per engine,
    the ratios zoo/llama.cpp, how many greedy tokens agree from the first, resident weight
    bytes beside the file's tensor bytes, each engine's load time and each process's peak RSS.
    ctx: the context (KV cache length) both engines are given; default prompt + new tokens."""
    n_ctx = ctx or len(prompt) + decode_tokens
    job = {"path": str(path), "prompt": prompt, "new_tokens": decode_tokens, "n_ctx": n_ctx}
    gpu = str(load.get("device") or "").startswith("cuda")
    note = ""

    def start(name: str, threads: int) -> _Worker:
        nonlocal note
        if name == "zoo":
            return _Worker("zoo", {**job, "load": load})
        # llama.cpp's own defaults (flash attention: what its "auto" picks on CPUs), our threads
        settings = {"n_threads": threads, "n_ubatch": 512, "use_extra_bufts": True,
                    "flash_attn": True, "n_gpu_layers": -1 if gpu else 0}  # fmt: skip
        peer, note = _llama_worker({**job, **settings, **(llama or {})})
        return peer

    apart = not gpu and _apart(path)
    runs, readies, ends, idle = (_one_at_a_time if apart else _side_by_side)(start, repeat)
    engines = {}
    for name in ("zoo", PEER):
        e = {k: statistics.median(r[k] for r in runs[name]) for k in FIGURES}
        e.update(readies[name][-1]["info"], tokens=readies[name][-1]["warmup"]["tokens"])
        e.update(runs=runs[name], peak_rss_bytes=max(end["peak_rss_bytes"] for end in ends[name]))
        e["load_s"] = statistics.median(r["info"]["load_s"] for r in readies[name])
        engines[name] = e
    same = agreeing(engines["zoo"]["tokens"], engines[PEER]["tokens"])
    ratios = {k: engines["zoo"][k] / engines[PEER][k] for k in FIGURES[:3]}
    ratios["load_s"] = engines["zoo"]["load_s"] / engines[PEER]["load_s"]
    ratios["peak_rss_bytes"] = engines["zoo"]["peak_rss_bytes"] / engines[PEER]["peak_rss_bytes"]
    return {
        "peer": PEER,
        "peer_note": note,
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
        "prompt_tokens": len(prompt),
        "new_tokens": decode_tokens,
        "context": n_ctx,
        "repeat": repeat,
        "same_tokens": same,
        "speedup": ratios["decode_tokens_per_s"],
        "ratios": ratios,
        "file_bytes": path.stat().st_size,
        "file_tensor_bytes": gguf_tensor_bytes(path),
        "idle_peer_cpu_s": idle,
        "one_at_a_time": apart,
        "engines": engines,
    }


def _apart(path: Path) -> bool:
    """Whether the two engines' processes would not fit in memory together (each holds about
    the file: a gpt-oss-20b's 12 GB twice on a 24 GB machine), so that they must run one at a
    time: else the one that runs evicts the other's mapped pages, which it reads back from disk."""
    try:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return False
    return 2.2 * path.stat().st_size > memory


def _side_by_side(start, repeat: int):
    """Both workers alive, their runs alternating (`_alternate`)."""
    zoo = start("zoo", 0)
    try:
        peer = start(PEER, zoo.ready["info"]["threads"])
        try:
            runs, idle = _alternate({"zoo": zoo, PEER: peer}, repeat)
            ends = {"zoo": [zoo.ask("exit")], PEER: [peer.ask("exit")]}
        finally:
            peer.close()
    finally:
        zoo.close()
    return runs, {"zoo": [zoo.ready], PEER: [peer.ready]}, ends, idle


def _one_at_a_time(start, repeat: int):
    """One worker alive at a time: zoo's process (load, warm-up, one timed run), then
    llama.cpp's, `repeat` times: each engine's figures of its own processes (loads too)."""
    runs: dict[str, list] = {"zoo": [], PEER: []}
    readies: dict[str, list] = {"zoo": [], PEER: []}
    ends: dict[str, list] = {"zoo": [], PEER: []}
    threads = 0
    for _ in range(repeat):
        for name in ("zoo", PEER):
            w = start(name, threads)
            try:
                time.sleep(PAUSE_S)
                runs[name].append(w.ask("run"))
                ends[name].append(w.ask("exit"))
            finally:
                w.close()
            readies[name].append(w.ready)
            threads = threads or w.ready["info"]["threads"]
    return runs, readies, ends, 0.0  # (no engine ran during the other's runs)


def _alternate(workers: dict[str, _Worker], repeat: int) -> tuple[dict[str, list], float | None]:
    """zoo, llama.cpp, zoo, ...: one timed run at a time. Also returns the most CPU seconds an
    engine used while the other one ran (None where /proc cannot tell)."""
    runs: dict[str, list] = {name: [] for name in workers}
    idle: list[float] = []
    for _ in range(repeat):
        for name, w in workers.items():
            others = [o for o in workers.values() if o is not w]
            time.sleep(PAUSE_S)
            before = [o.cpu_s() for o in others]
            runs[name].append(w.ask("run"))
            after = [o.cpu_s() for o in others]
            pairs = zip(before, after, strict=True)
            idle += [b - a for a, b in pairs if a is not None and b is not None]
    return runs, max(idle) if idle else None


def agreeing(a: list[int], b: list[int]) -> int:
    """How many tokens agree from the first: the index where the two part."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def gguf_tensor_bytes(path: Path) -> int:
    """Bytes of the tensors a GGUF file holds (its size less header and metadata)."""
    from gguf import GGUFReader

    return sum(int(t.n_bytes) for t in GGUFReader(path).tensors)


def machine() -> str:
    """The CPU's name and how many this process may use: 'Intel(R) Xeon(R) Processor, 2 CPUs'."""
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{name}, {cpus} CPUs"


def _how(c: dict[str, Any]) -> str:
    if c.get("one_at_a_time"):  # (_apart)
        return "one process at a time: both would not fit in memory together, alternating"
    return "own processes, alternating"


def render_lines(c: dict[str, Any]) -> list[str]:
    """The comparison as lines of `zoo bench`'s report."""
    mib = 2**20
    z, p = c["engines"]["zoo"], c["engines"][PEER]
    lines = [
        f"vs {PEER} {p['version']} (same GGUF file, {_how(c)}; threads: zoo "
        f"{z['threads']}, {PEER} {p['threads']}): {c['prompt_tokens']}-token prompt, "
        f"{c['new_tokens']} new tokens, context {c['context']}, medians of {c['repeat']}; "
        f"{c['machine']}, {c['date']}",
        f"{'':>16} {'load s':>7} {'prefill tok/s':>14} {'decode tok/s':>13} {'end to end':>11} "
        f"{'weights MiB':>12} {'peak RSS MiB':>13}",
    ]
    for name, e in (("zoo", z), (PEER, p)):
        lines.append(
            f"{name:>16} {e['load_s']:>7.2f} {e['prefill_tokens_per_s']:>14,.1f} "
            f"{e['decode_tokens_per_s']:>13,.1f} {e['tokens_per_s']:>11,.1f} "
            f"{e['weight_bytes'] / mib:>12,.1f} {e['peak_rss_bytes'] / mib:>13,.1f}"
        )
    r = c["ratios"]
    lines += [
        f"{'zoo/' + PEER:>16} {r['load_s']:>6.2f}x {r['prefill_tokens_per_s']:>13.2f}x "
        f"{r['decode_tokens_per_s']:>12.2f}x {r['tokens_per_s']:>10.2f}x {'':>12} "
        f"{r['peak_rss_bytes']:>12.2f}x",
        f"   file: {c['file_tensor_bytes'] / mib:,.1f} MiB of tensors "
        f"({c['file_bytes'] / mib:,.1f} MiB on disk); {PEER}: "
        + " ".join(f"{k}={v}" for k, v in p["settings"].items()),
        f"   greedy tokens the same as {PEER}'s: the first {c['same_tokens']} of {c['new_tokens']}",
    ]
    if c["peer_note"]:
        lines.append(f"   {PEER}: {c['peer_note']}")
    if c["idle_peer_cpu_s"] is not None and not c.get("one_at_a_time"):
        lines.append(f"   CPU time of the idle engine during the other's runs: at most "
                     f"{c['idle_peer_cpu_s']:.2f} s")  # fmt: skip
    return lines
