"""docs/openai-api.md says, for each field of OpenAI's chat and completions references, supported or rejected:
send every row and hold the server to it (fake engine; the fields' effects are tested elsewhere)."""
from __future__ import annotations

import json
import re
import typing
from pathlib import Path

import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params
from test_server_fake import make_client

DOC = Path(__file__).resolve().parents[2] / "docs" / "openai-api.md"


def rows(section: str) -> list[tuple[str, str, object]]:
    text = DOC.read_text().split(f"## {section}", 1)[1].split("\n## ", 1)[0]
    out = []
    for line in text.splitlines():
        m = re.match(r"\| (\w+) \| (supported|rejected) \| `(.*)` \|", line)
        if m:
            out.append((m[1], m[2], json.loads(m[3])))
    return out


CHAT, COMPLETIONS = rows("/v1/chat/completions"), rows("/v1/completions")
BASE = {"/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        "/v1/completions": {"prompt": "hi", "max_tokens": 2}}


def reference_fields(module) -> set[str]:
    """The request fields of the installed openai client's create() params (`stream` is on the subclasses)."""
    return set(typing.get_type_hints(module.CompletionCreateParamsBase)) | {"stream"}


@pytest.mark.parametrize("path,module,table", [("/v1/chat/completions", chat_create_params, CHAT),
                                               ("/v1/completions", completion_create_params, COMPLETIONS)])
def test_the_table_covers_openai_reference(path, module, table):
    """Every field the openai client can send has a row: a new field in a new client fails here until the docs
    (and the server) say what happens to it."""
    missing = reference_fields(module) - {f for f, _, _ in table}
    assert not missing, f"{path}: fields of the openai client's reference with no row in docs/openai-api.md: {missing}"


@pytest.fixture(scope="module")
def client():
    with make_client() as c:
        yield c


@pytest.mark.parametrize("path,field,status,value", [("/v1/chat/completions", *r) for r in CHAT] +
                         [("/v1/completions", *r) for r in COMPLETIONS])
def test_each_field_does_what_the_table_says(client, path, field, status, value):
    body = {**BASE[path], field: value}
    if field == "top_logprobs":
        body["logprobs"] = True
    if field == "tools":  # the fake model's template renders no tools: that 400 is tested apart
        body["tool_choice"] = "none"
    r = client.post(path, json=body)
    if status == "supported":
        assert r.status_code == 200, r.text
    else:
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_tools_on_a_model_without_tool_support_is_a_clean_400(client):
    r = client.post("/v1/chat/completions", json={**BASE["/v1/chat/completions"], "tools": [
        {"type": "function", "function": {"name": "f"}}]})
    assert r.status_code == 400 and "does not support tool calls" in r.json()["error"]["message"]


def test_values_a_supported_field_cannot_honour_are_400s(client):
    """A supported field with a value this server cannot honour is refused by name, not ignored."""
    for field, value in (("prompt_cache_retention", "24h"), ("store", True), ("modalities", ["text", "audio"])):
        r = client.post("/v1/chat/completions", json={**BASE["/v1/chat/completions"], field: value})
        assert r.status_code == 400 and r.json()["error"]["param"].split(".")[0] == field, r.text
