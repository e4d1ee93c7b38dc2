"""Tool calling: rendering `tools` into the prompt and reading calls back out of the output.

A model's own chat template renders them when it takes `tools` (it mentions them); a ChatML template without
tool support (the bundled SmolLM2's) gets a system block in the Hermes style these models were tuned on, and
answers with <tool_call>{"name": ..., "arguments": {...}}</tool_call>. Any other template: a 400, the model has
no way to see the tools.

tool_choice "auto" parses such blocks out of free text; "required" and a named function constrain the output with
structured outputs to a JSON list of calls (or one call), so the result is always a valid call.
"""
from __future__ import annotations

import json
import re
import uuid
from typing import Any

from paceline.entrypoints.protocol import ChatCompletionRequest, bad_request
from paceline.sampling import StructuredOutputs

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.S)

_SYSTEM = ("You can call functions to help answer. The functions you may call are described, as JSON signatures, "
           "between <tools> and </tools>:\n<tools>\n{tools}\n</tools>\n\nTo call one, answer with a JSON object "
           "naming the function and its arguments between <tool_call> and </tool_call>, like this:\n"
           "<tool_call>\n{{\"name\": \"function_name\", \"arguments\": {{\"arg\": \"value\"}}}}\n</tool_call>")


def template_kind(chat_template: str | None) -> str | None:
    """"native" if the template renders `tools` itself, "chatml" if paceline can add them, else None."""
    if not chat_template:
        return None
    if re.search(r"\btools\b", chat_template):
        return "native"
    if "<|im_start|>" in chat_template:
        return "chatml"
    return None


def uses_tools(body: ChatCompletionRequest) -> bool:
    return bool(body.tools) and body.tool_choice != "none"


def check(body: ChatCompletionRequest, chat_template: str | None, model: str) -> None:
    has_tool_turns = any(m.role == "tool" or m.tool_calls for m in body.messages)
    if body.tool_choice is not None and body.tool_choice != "none" and not body.tools:
        raise bad_request("tool_choice needs tools", param="tool_choice")
    if (uses_tools(body) or has_tool_turns) and template_kind(chat_template) is None:
        raise bad_request(f"the model {model} does not support tool calls (its chat template renders no tools)",
                          param="tools")
    if body.tools:
        names = [t.function.name for t in body.tools]
        if len(set(names)) != len(names):
            raise bad_request("tool function names must be unique", param="tools")
        choice = body.tool_choice
        if choice is not None and not isinstance(choice, str) and choice.function.name not in names:
            raise bad_request(f"tool_choice names {choice.function.name!r}, which is not among the tools",
                              param="tool_choice")


def messages_for_template(body: ChatCompletionRequest, kind: str | None) -> tuple[list[dict], dict[str, Any]]:
    """The messages (and extra template variables) to render, with tools and earlier calls spelled for `kind`."""
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools and body.tool_choice != "none" else None
    out: list[dict] = []
    for m in body.messages:
        d: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.tool_calls:
            if kind == "native":
                d["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                    "name": c.function.name, "arguments": _loads_or_text(c.function.arguments)}} for c in m.tool_calls]
            else:
                calls = "\n".join(f"{OPEN}\n" + json.dumps({"name": c.function.name,
                                                            "arguments": _loads_or_text(c.function.arguments)})
                                  + f"\n{CLOSE}" for c in m.tool_calls)
                d["content"] = (d["content"] + "\n" if d["content"] else "") + calls
        if m.role == "tool":
            if kind == "native":
                d["tool_call_id"] = m.tool_call_id
            else:  # ChatML without tool turns: a user turn carrying the result, as Hermes-style models expect
                d = {"role": "user", "content": f"<tool_response>\n{m.text()}\n</tool_response>"}
        out.append(d)
    if tools is None:
        return out, {}
    if kind == "native":
        return out, {"tools": tools}
    block = _SYSTEM.format(tools="\n".join(json.dumps(t["function"]) for t in tools))
    if out and out[0]["role"] in ("system", "developer"):
        out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + block}
    else:
        out.insert(0, {"role": "system", "content": block})
    return out, {}


def _loads_or_text(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


def forced_structure(body: ChatCompletionRequest) -> StructuredOutputs | None:
    """required: a JSON list of at least one call (one, without parallel_tool_calls); named: that one call."""
    if not uses_tools(body) or body.tool_choice in (None, "auto"):
        return None

    def call_schema(tool: Any) -> dict:
        params = tool.function.parameters or {"type": "object", "properties": {}}
        return {"type": "object", "properties": {"name": {"const": tool.function.name}, "arguments": params},
                "required": ["name", "arguments"], "additionalProperties": False}

    if body.tool_choice == "required":
        schema: dict = {"type": "array", "minItems": 1,
                        "items": {"anyOf": [call_schema(t) for t in body.tools]}}
        if not body.parallel_tool_calls:
            schema["maxItems"] = 1
    else:
        tool = next(t for t in body.tools if t.function.name == body.tool_choice.function.name)
        schema = call_schema(tool)
    return StructuredOutputs(json=json.dumps(schema, sort_keys=True))


def new_call(name: str, arguments: Any) -> dict:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": args}}


def parse(body: ChatCompletionRequest, text: str) -> tuple[str | None, list[dict]]:
    """(content, tool calls) of one finished output."""
    if not uses_tools(body):
        return text, []
    if body.tool_choice not in (None, "auto"):  # forced: the whole output is the JSON the grammar allowed
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return text, []  # cut by max_tokens: hand back what there is
        calls = value if isinstance(value, list) else [value]
        return None, [new_call(c["name"], c["arguments"]) for c in calls if isinstance(c, dict) and "name" in c]
    calls = []
    names = {t.function.name for t in body.tools}
    for raw in _CALL.findall(text):
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            continue
        if isinstance(value, dict) and value.get("name") in names:
            calls.append(new_call(value["name"], value.get("arguments", {})))
    if not calls:
        return text, []
    if not body.parallel_tool_calls:
        calls = calls[:1]
    content = _CALL.sub("", text).strip()
    return content or None, calls


class StreamSplitter:
    """Streaming with tool_choice auto: content flows until the text may be starting a <tool_call>; from there it
    is held, and the calls come out at the end (parse())."""

    def __init__(self) -> None:
        self.text = ""
        self.emitted = 0
        self.in_call = False

    def feed(self, delta: str) -> str:
        self.text += delta
        if self.in_call:
            return ""
        start = self.text.find(OPEN, self.emitted)
        if start >= 0:
            self.in_call = True
            out, self.emitted = self.text[self.emitted:start], start
            return out
        # hold back a tail that could still grow into "<tool_call>"
        keep = next((k for k in range(min(len(OPEN) - 1, len(self.text) - self.emitted), 0, -1)
                     if self.text.endswith(OPEN[:k])), 0)
        end = len(self.text) - keep
        out, self.emitted = self.text[self.emitted:end], max(self.emitted, end)
        return out
