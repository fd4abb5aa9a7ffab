"""The OpenAI-compatible endpoint's requests and responses, as vLLM's server types them
(``vllm serve``'s ``ChatCompletionRequest``, ``CompletionRequest`` and their responses): a
request validated into a :class:`ChatCall` or :class:`TextCall`, the answers written back.
The tool calls in an answer are read by :mod:`pipeline_rl.tasks.tool_calls`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pipeline_rl.tasks.tool_calls import ParsedCall


@dataclass(frozen=True, slots=True)
class ChatCall:
    """A ``/v1/chat/completions`` request, validated by vLLM's own ``ChatCompletionRequest``:
    ``messages`` as the chat template takes them (content parts joined into text, a tool
    call's arguments as the JSON text the client sent), ``tools`` (JSON schemas, rendered by the
    template as ``vllm serve`` does), ``parse_tools`` (False for ``tool_choice: none``: answers
    are not read for calls; a named or ``required`` choice is read as ``auto``, unconstrained);
    sampling as asked (None: the worker's)."""

    model: str
    messages: tuple[dict[str, Any], ...]
    tools: tuple[dict[str, Any], ...] | None
    parse_tools: bool
    n: int
    temperature: float | None
    top_p: float | None
    max_tokens: int | None
    logprobs: bool
    seed: int | None


@dataclass(frozen=True, slots=True)
class TextCall:
    """A ``/v1/completions`` request (vLLM's ``CompletionRequest``): one prompt, as text or token ids."""

    model: str
    prompt: str | tuple[int, ...]
    n: int
    temperature: float | None
    top_p: float | None
    max_tokens: int | None
    logprobs: bool
    seed: int | None


@dataclass(frozen=True, slots=True)
class Choice:
    """One sampled answer as the endpoint returns it: the text (special tokens dropped), the
    sampled ids and their log-probs, the ids' token names (empty unless the request asked for
    log-probs), how it ended (``stop``/``length``), the tool calls found."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    tokens: tuple[str, ...]
    finish: str
    calls: tuple[ParsedCall, ...] = ()
    content: str | None = None


class RequestError(ValueError):
    """A request vLLM's types refuse (the endpoint answers 400 with its first line)."""


def _first(err: Exception) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def _content_text(content: Any) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(part.get("text", "") for part in content if isinstance(part, dict))


def _validate(model: Any, body: Any) -> Any:
    """``body`` validated as ``model``: JSON text or bytes (parsed and validated in one pass, as
    the endpoint receives it), or JSON data."""
    from pydantic import ValidationError

    try:
        return model.model_validate_json(body) if isinstance(body, (str, bytes)) else model.model_validate(body)
    except ValidationError as e:   # one line to the client: the first error, where it is
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        raise RequestError(f"{where}: {first['msg']}" if where else first["msg"]) from None
    except Exception as e:  # noqa: BLE001 -- a validator's own failure: its first line
        raise RequestError(_first(e)) from None


def chat_call(body: Any) -> ChatCall:
    """``body`` (the request's JSON: text, bytes or data) validated as vLLM's ``ChatCompletionRequest``."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    req = _validate(ChatCompletionRequest, body)
    if req.stream:
        raise RequestError("stream: the endpoint answers whole responses only")
    messages = []
    for m in req.messages:
        d = dict(m)
        d["content"] = _content_text(d.get("content"))
        if d.get("tool_calls"):
            d["tool_calls"] = [dict(c) for c in d["tool_calls"]]
        messages.append(d)
    tools = tuple(t.model_dump(exclude_none=True) for t in req.tools) if req.tools else None
    return ChatCall(req.model or "", tuple(messages), tools, req.tool_choice != "none", req.n or 1,
                    req.temperature, req.top_p,
                    req.max_completion_tokens or req.max_tokens, bool(req.logprobs), req.seed)


def text_call(body: Any) -> TextCall:
    """``body`` (as :func:`chat_call`'s) validated as vLLM's ``CompletionRequest`` (one prompt)."""
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    req = _validate(CompletionRequest, body)
    prompt = req.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
        prompt = prompt[0]
    if req.stream or not (isinstance(prompt, str) or (isinstance(prompt, list) and prompt
                                                      and all(isinstance(t, int) for t in prompt))):
        raise RequestError("prompt: one prompt (text or token ids), not streamed")
    return TextCall(req.model or "", prompt if isinstance(prompt, str) else tuple(t for t in prompt if isinstance(t, int)), req.n or 1,
                    req.temperature, req.top_p, req.max_tokens, req.logprobs is not None, req.seed)


def _usage(prompt_tokens: int, choices: Sequence[Choice]) -> Any:
    from vllm.entrypoints.serve.engine.protocol import UsageInfo

    out = sum(len(c.token_ids) for c in choices)
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=out, total_tokens=prompt_tokens + out)


def chat_response(model: str, prompt_ids: Sequence[int], choices: Sequence[Choice], logprobs: bool) -> str:
    """vLLM's ``ChatCompletionResponse`` for ``choices``, as JSON text (with the prompt's and
    each choice's token ids, as vLLM returns them to agents that trace tokens)."""
    from vllm.entrypoints.generate.base.protocol import FunctionCall, ToolCall
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionLogProbs, ChatCompletionLogProbsContent, ChatCompletionResponse,
        ChatCompletionResponseChoice, ChatMessage)

    out = []
    for i, c in enumerate(choices):
        calls = [ToolCall(id=k.call_id, function=FunctionCall(name=k.name, arguments=k.arguments)) for k in c.calls]
        message = ChatMessage(role="assistant", content=c.content if c.calls else c.text, tool_calls=calls)
        lp = ChatCompletionLogProbs(content=[ChatCompletionLogProbsContent(token=t, logprob=p)
                                             for t, p in zip(c.tokens, c.logprobs)]) if logprobs else None
        out.append(ChatCompletionResponseChoice(index=i, message=message, logprobs=lp, token_ids=list(c.token_ids),
                                                finish_reason="tool_calls" if c.calls else c.finish))
    resp = ChatCompletionResponse(model=model, choices=out, usage=_usage(len(prompt_ids), choices),
                                  prompt_token_ids=list(prompt_ids))
    return str(resp.model_dump_json(exclude_none=True))


def text_response(model: str, prompt_ids: Sequence[int], choices: Sequence[Choice], logprobs: bool) -> str:
    """vLLM's ``CompletionResponse`` for ``choices``, as JSON text."""
    from vllm.entrypoints.openai.completion.protocol import (CompletionLogProbs, CompletionResponse,
                                                             CompletionResponseChoice)

    out = [CompletionResponseChoice(index=i, text=c.text, finish_reason=c.finish, token_ids=list(c.token_ids),
                                    prompt_token_ids=list(prompt_ids),
                                    logprobs=CompletionLogProbs(tokens=list(c.tokens), token_logprobs=list(c.logprobs))
                                    if logprobs else None)
           for i, c in enumerate(choices)]
    resp = CompletionResponse(model=model, choices=out, usage=_usage(len(prompt_ids), choices))
    return str(resp.model_dump_json(exclude_none=True))


def model_list(name: str, max_model_len: int) -> dict[str, Any]:
    """vLLM's ``ModelList`` naming the one served model."""
    from vllm.entrypoints.serve.engine.protocol import ModelCard, ModelList

    return ModelList(data=[ModelCard(id=name, root=name, max_model_len=max_model_len)]).model_dump(mode="json")


def error_body(message: str, status: int) -> dict[str, Any]:
    """vLLM's ``ErrorResponse`` as JSON data."""
    from vllm.entrypoints.serve.engine.protocol import ErrorInfo, ErrorResponse

    kind = {401: "AuthenticationError", 404: "NotFoundError"}.get(status, "BadRequestError")
    return ErrorResponse(error=ErrorInfo(message=message, type=kind, code=status)).model_dump(mode="json")
