"""`zoo run --json-schema FILE` / `--json` with the embedded smollm2, through a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys

import jsonschema

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
    "required": ["city", "country"],
    "additionalProperties": False,
}


def zoo(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "core.cli", *args], capture_output=True, text=True, timeout=300
    )


def test_run_answers_json_that_validates(tmp_path):
    path = tmp_path / "city.json"
    path.write_text(json.dumps(SCHEMA))
    out = zoo("run", "-p", "What is the capital of France?", "--json-schema", str(path))
    assert out.returncode == 0, out.stderr
    answer = json.loads(out.stdout)
    jsonschema.validate(answer, SCHEMA)
    assert answer["city"] == "Paris"


def test_run_json_answers_an_object():
    out = zoo("run", "-p", "Name a colour.", "--json", "--max-new-tokens", "40")
    assert out.returncode == 0, out.stderr
    assert isinstance(json.loads(out.stdout), dict)


def test_a_bad_schema_file_is_one_line_naming_it(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"type": "objekt"}')
    out = zoo("run", "-p", "hi", "--json-schema", str(bad))
    assert out.returncode == 1
    assert out.stderr.startswith(f"zoo: error: --json-schema {bad}: invalid schema at $.type")
    out = zoo("run", "-p", "hi", "--json-schema", str(tmp_path / "missing.json"))
    assert out.returncode == 1 and "cannot read" in out.stderr and "missing.json" in out.stderr
