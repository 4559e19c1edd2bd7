"""The speculative-decoding flags of `zoo run|chat|serve|bench` (--spec, --draft, --spec-k): what
they hand load_model, their one-line errors, the acceptance on `zoo run`'s stats line, and the
acceptance columns of `zoo bench`'s report."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
from conftest import chat_llama_folder

from core import load_model
from core.cli import bench, commands
from core.cli.speculation import K_DEFAULT, speculative
from core.speculative import SpecConfig

pytestmark = pytest.mark.usefixtures("drafts_k_max")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(chat_llama_folder(tmp_path_factory.mktemp("spec-cli")))


@pytest.mark.parametrize("command", ["run", "chat", "serve", "bench"])
def test_the_flags_become_load_models_speculative(command):
    def spec(*flags):
        value = speculative(commands.parse([command, "m", *flags]))
        if value is not None:  # what load_model takes, as it reads it
            assert SpecConfig.of(value).method == value["method"]
        return value

    assert spec() is None
    assert spec("--spec", "ngram") == {"method": "ngram"}
    assert spec("--spec", "mtp", "--spec-k", "3") == {"method": "mtp", "k": 3}
    assert spec("--draft", "smollm2", "--spec-k", "15") == {
        "method": "draft", "draft": "smollm2", "k": 15,
    }  # fmt: skip
    assert SpecConfig.model_fields["k"].default == K_DEFAULT  # what --help says


@pytest.mark.parametrize(
    ("argv", "want"),
    [
        (["run", "m", "hi", "--spec-k", "4"], "--spec-k 4 sets how many tokens"),
        (["serve", "m", "--spec", "ngram", "--draft", "d"], "--spec ngram and --draft d: "),
        (["bench", "m", "--spec", "ngram", "--spec-k", "16"], "--spec-k 16: pass a number of "),
        (["chat", "m", "--draft", "d", "--spec-k", "0"], "--spec-k 0: pass a number of tokens "),
    ],
)
def test_a_combination_that_means_nothing_is_one_line(argv, want, capsys):
    """Said before anything starts: no model is loaded, no port taken (m names none)."""
    assert commands.main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"zoo: error: {want}") and err.count("\n") == 1, err


def test_run_shows_what_was_accepted_beside_the_same_answer(folder, capsys):
    """A prompt that repeats itself: the stats line says how much of the drafts was taken;
    the answer is the one without --spec (whose stats line says nothing of drafts)."""
    text = "one two three four five, one two three four five, one two three four five"
    argv = ["run", folder, text, "--max-tokens", "30", "--temperature", "0"]
    assert commands.main(argv) == 0
    plain = capsys.readouterr()
    assert commands.main([*argv, "--spec", "ngram", "--spec-k", "4"]) == 0
    spec = capsys.readouterr()
    assert spec.out == plain.out and "spec" not in plain.err
    line = re.search(r"; spec ngram: (\d+)% accepted, (\d+\.\d) tokens/step\]$", spec.err, re.M)
    assert line, spec.err
    rate, length = int(line[1]), float(line[2])
    assert 0 < rate <= 100 and 1 < length <= 5  # (k = 4: at most 5 tokens a verify)


def test_bench_reports_acceptance_per_batch(folder):
    """Per decode batch, the drafts of its runs: they add up to what the speculator counted
    (the prefill runs, one token each, draft nothing); shown in the table and the JSON."""
    model = load_model(folder, max_seq_len=64, max_batch_size=2, speculative="ngram")
    report = bench.measure(
        model, prompt_lens=[8], batches=[1, 2], decode_tokens=24, repeat=1, peak_gbps=1.0
    )
    rows = report.decode.values()
    assert sum(r["drafts"] for r in rows) == model.speculator.stats.drafts > 0
    assert sum(r["draft_tokens"] for r in rows) == model.speculator.stats.draft_tokens
    assert report.speculative == "ngram (k <= 7, adaptive)"
    text = bench.render(report)
    assert "speculative ngram (k <= 7, adaptive)" in text and "accepted  tok/step" in text
    for b, r in report.decode.items():
        figures = f"{r['acceptance_rate']:>9.0%} {r['mean_accepted_length']:>9.2f}"
        assert re.search(rf"^ +{b} .*{re.escape(figures)}$", text, re.M), text
    data = json.loads(json.dumps(dataclasses.asdict(report)))
    assert data["decode"]["1"]["mean_accepted_length"] == report.decode[1]["mean_accepted_length"]
