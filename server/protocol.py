"""The OpenAI API's wire format: a completions or chat request read into token ids and
SamplingParams, and responses and stream chunks written in the schema the official client parses.

Every field is checked here, by hand rather than by a schema library, so that each bad value
gets OpenAI's error body (APIError, HTTP 400) with a message that names the field and the fix.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass

from sampling import SamplingParams

NUMBER = (int, float)
# Accepted fields this engine cannot honour: a request that sets one to anything but its default
# is refused, rather than silently answered without it.
UNSUPPORTED = {"n": (None, 1), "best_of": (None, 1), "echo": (None, False), "logprobs": (None, False),
               "top_logprobs": (None, 0), "suffix": (None, ""), "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
               "logit_bias": (None, {}), "tools": (None, []), "functions": (None, []),
               "response_format": (None, {"type": "text"})}
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "stop"}


class APIError(Exception):
    """An error answered with OpenAI's error body; 4xx for the client's mistakes."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}}


@dataclass
class ParsedRequest:
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool


def read_body(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise APIError(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object", code="invalid_json")
    return body


def parse_request(body: dict, *, chat: bool, model_name: str, tokenizer, vocab_size: int, context: int,
                  default_max_tokens: int) -> ParsedRequest:
    """Token ids and sampling of a /v1/completions (chat False) or /v1/chat/completions body."""
    model = _field(body, "model", str, required=True)
    if model != model_name:
        raise APIError(f"the model {model!r} does not exist; this server serves {model_name!r} (see GET /v1/models)",
                       param="model", code="model_not_found")
    for name, defaults in UNSUPPORTED.items():
        if body.get(name) not in defaults:
            raise APIError(f"'{name}' is not supported by this server; leave it out", param=name, code="unsupported_parameter")
    ids = _chat_prompt(body, tokenizer) if chat else _completion_prompt(body, tokenizer, vocab_size)
    if not ids:
        raise APIError("the prompt is empty: give at least one token of text", param="messages" if chat else "prompt")
    if len(ids) >= context:
        raise APIError(f"the prompt has {len(ids)} tokens but the model's context is {context}: shorten it to at most "
                       f"{context - 1} tokens", param="messages" if chat else "prompt", code="context_length_exceeded")
    max_name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _field(body, max_name, int)
    if max_tokens is not None and max_tokens < 1:
        raise APIError(f"'{max_name}' must be at least 1, got {max_tokens}", param=max_name)
    if max_tokens is not None and len(ids) + max_tokens > context:
        raise APIError(f"the prompt has {len(ids)} tokens and '{max_name}' asks for {max_tokens} more, beyond the "
                       f"model's context of {context}: ask for at most {context - len(ids)}", param=max_name,
                       code="context_length_exceeded")
    stop = _field(body, "stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    top_k = _field(body, "top_k", int, 0)
    options = _field(body, "stream_options", dict, {})
    try:
        params = SamplingParams(
            max_new_tokens=max_tokens or min(default_max_tokens, context - len(ids)),
            temperature=float(_field(body, "temperature", NUMBER, 1.0)),  # OpenAI's default: sample
            top_p=float(_field(body, "top_p", NUMBER, 1.0)), top_k=0 if top_k == -1 else top_k,  # -1: vLLM's "off"
            seed=_field(body, "seed", int), stop=stop, ignore_eos=_field(body, "ignore_eos", bool, False))
    except ValueError as e:  # a range SamplingParams checks; its message starts with the field's name
        name = str(e).split()[0]
        raise APIError(str(e), param=name if name in body else None) from None
    return ParsedRequest(ids, params, stream=_field(body, "stream", bool, False),
                         include_usage=_field(options, "include_usage", bool, False))


def _field(body: dict, name: str, types, default=None, *, required: bool = False):
    """body[name] checked against types (a JSON true is not an int), or the default when absent or null."""
    value = body.get(name)
    if value is None:
        if required:
            raise APIError(f"'{name}' is required", param=name, code="missing_required_parameter")
        return default
    types = types if isinstance(types, tuple) else (types,)
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        names = " or ".join({int: "an integer", float: "a number", str: "a string", bool: "a boolean",
                             list: "a list", dict: "an object"}[t] for t in types)
        raise APIError(f"'{name}' must be {names}, got {json.dumps(value)[:40]}", param=name, code="invalid_type")
    return value


def _completion_prompt(body: dict, tokenizer, vocab_size: int) -> list[int]:
    """A prompt is text or token ids, or a list holding one of those (one prompt per request)."""
    prompt = _field(body, "prompt", (str, list), required=True)
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise APIError(f"one prompt per request, got {len(prompt)}: send them as separate requests", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in prompt):
        raise APIError(f"a prompt of token ids must hold integers in [0, {vocab_size})", param="prompt")
    return prompt


def _chat_prompt(body: dict, tokenizer) -> list[int]:
    """The conversation rendered with the model's chat template (in its sandbox), as token ids."""
    messages = _field(body, "messages", list, required=True)
    if not messages:
        raise APIError("'messages' is empty: give at least one message", param="messages")
    conversation = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(f"messages[{i}] must be an object with a string 'role'", param="messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
                raise APIError(f"messages[{i}].content: only text parts are supported", param="messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise APIError(f"messages[{i}].content must be a string or a list of text parts", param="messages")
        conversation.append({"role": m["role"], "content": content})
    try:
        text = tokenizer.apply_chat_template(conversation, add_generation_prompt=True)
    except Exception as e:  # the template refused the conversation (raise_exception), or there is none
        raise APIError(f"the chat template could not render these messages: {e}", param="messages") from None
    return tokenizer.encode(text, add_bos=False)  # the template holds any BOS it wants


# ---- responses -------------------------------------------------------------------------------


class Reply:
    """The ids and names that every body of one response shares."""

    def __init__(self, chat: bool, model: str):
        self.chat, self.model = chat, model
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def full(self, text: str, finish_reason: str, prompt_tokens: int, completion_tokens: int) -> dict:
        """The whole answer of a request that did not stream."""
        finish = FINISH_REASONS[finish_reason]
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        body = self._envelope("chat.completion" if self.chat else "text_completion", [choice])
        return {**body, "usage": usage(prompt_tokens, completion_tokens)}

    def chunk(self, text: str | None, finish_reason: str | None = None, role: bool = False) -> dict:
        """One streamed piece: new text, or (finish_reason set) the end."""
        finish = FINISH_REASONS[finish_reason] if finish_reason else None
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [choice])

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict:
        """The stream's last piece when stream_options.include_usage asks for it: no choices, the usage."""
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        return {**body, "usage": usage(prompt_tokens, completion_tokens)}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
