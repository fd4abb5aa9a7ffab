"""Token in, token out for agents: what the endpoint renders for a request, and the samples
an agent's episode becomes.

**Rendering** (:func:`render_ids`). A chat request's messages become the chat template's
rendering of them, as token ids, with one exception: an assistant message that is one of
the model's own answers in this episode (its content and tool calls as the endpoint returned
them) is not encoded from its text: the ids the engine sampled for it are spliced in. The
messages before the first such answer are rendered and encoded once; after each answer, the
template's own continuation (``ChatTurns.continuation_ids``: the end of the assistant
message, the next messages and the generation prompt) follows its sampled ids. For the usual
chat loop the ids therefore equal the template's rendering of the whole conversation
whenever each answer is the encoding of its text, exactly as for environments
(``rollout/chat_turns.py``), and otherwise they are what the model actually saw.

A completion request's text prompt (:func:`text_prompt_ids`) that starts with an earlier
request's prompt followed by one of its answers' text is likewise that request's prompt ids,
the answer's sampled ids (its end-of-sequence token included, which the text omits) and only
the rest encoded: the agent's loop of ``prompt += answer + reply`` is the environment form's
episode, token for token.

**Samples** (:func:`episode_samples`). Each request made for an episode is recorded
(:class:`Call`: its prompt ids, and per answer the sampled ids, log-probs and versions). In
request order, an answer whose prompt extends a sample so far (its prompt and answers, token
for token) is appended to it: the prompt's new tokens with mask 0, the answer's with mask 1.
Otherwise (the agent rewrote its history: summarised, dropped turns; or a second answer of
``n``) it starts a sample of its own, its whole prompt masked. Every sample of an episode
gets the episode's reward; the sample builder (``rollout_shape.group_samples``) cuts the
group's common prompt off them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pipeline_rl.rollout.chat_turns import ChatTurns
from pipeline_rl.tasks.tool_calls import ParsedCall
from pipeline_rl.samples import FinishReason


@dataclass(frozen=True, slots=True)
class Answer:
    """One sampled answer: the engine's ids, log-probs and versions (one each per token),
    how it ended, and what the endpoint returned for it (``text``; ``calls`` and the text
    before them, ``content``, when tool calls were found)."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    versions: tuple[int, ...]
    finish: FinishReason
    text: str
    calls: tuple[ParsedCall, ...] = ()
    content: str | None = None


@dataclass(frozen=True, slots=True)
class Call:
    """One request of an episode: the prompt ids the endpoint rendered, and its answers;
    ``prompt_text``: a completion request's prompt as the agent wrote it (None: a chat one)."""

    prompt_ids: tuple[int, ...]
    answers: tuple[Answer, ...]
    prompt_text: str | None = None


@dataclass(slots=True)
class Sample:
    """A sample being built. Invariant: the four lists share one length; ``mask`` is 1 on
    the answers' tokens, whose log-probs and versions are the engine's."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    finish: FinishReason = "stop"

    def extend(self, ids: Sequence[int], answer: Answer | None) -> None:
        last = self.versions[-1] if self.versions else (answer.versions[0] if answer and answer.versions else 0)
        self.tokens += ids
        self.logprobs += [0.0] * len(ids)
        self.versions += [last] * len(ids)
        self.mask += [0] * len(ids)
        if answer is not None:
            self.tokens += answer.token_ids
            self.logprobs += answer.logprobs
            self.versions += answer.versions
            self.mask += [1] * len(answer.token_ids)
            self.finish = answer.finish

    @property
    def first_model(self) -> int:
        return self.mask.index(1) if 1 in self.mask else len(self.mask)


def episode_samples(calls: Sequence[Call]) -> list[Sample]:
    """An episode's samples (module docstring): one for a chat loop, one more per divergence."""
    samples: list[Sample] = []
    for call in calls:
        for answer in call.answers:
            extended = [s for s in samples if len(s.tokens) <= len(call.prompt_ids)
                        and tuple(s.tokens) == call.prompt_ids[:len(s.tokens)]]
            sample = max(extended, key=lambda s: len(s.tokens)) if extended else None
            if sample is None:
                sample = Sample()
                samples.append(sample)
            sample.extend(call.prompt_ids[len(sample.tokens):], answer)
    return samples


def _same_arguments(a: Any, b: str) -> bool:
    if a == b:
        return True
    try:
        return bool((json.loads(a) if isinstance(a, str) else a) == json.loads(b))
    except (TypeError, ValueError):
        return False


def is_answer(message: dict[str, Any], answer: Answer) -> bool:
    """Whether an assistant ``message`` is ``answer`` as the endpoint returned it (its
    content, stripped, and its tool calls' names and arguments)."""
    calls = message.get("tool_calls") or []
    said = (message.get("content") or "").strip()
    if not calls and said == answer.text.strip():   # the answer's whole text, calls and all
        return True
    if len(calls) != len(answer.calls):
        return False
    for got, want in zip(calls, answer.calls):
        fn = got.get("function") or {}
        if fn.get("name") != want.name or not _same_arguments(fn.get("arguments"), want.arguments):
            return False
    return said == ((answer.content or "") if answer.calls else answer.text).strip()


def for_template(message: dict[str, Any]) -> dict[str, Any]:
    """A message as chat templates take it: tool calls' arguments as objects (as vLLM hands them)."""
    if not message.get("tool_calls"):
        return message
    calls = []
    for call in message["tool_calls"]:
        fn = dict(call.get("function") or {})
        try:
            fn["arguments"] = json.loads(fn.get("arguments") or "{}")
        except (TypeError, ValueError):
            pass
        calls.append({**call, "function": fn})
    return {**message, "tool_calls": calls}


def render_ids(chat: ChatTurns, encode: Any, messages: Sequence[dict[str, Any]],
               answers: Sequence[Answer]) -> tuple[int, ...]:
    """The prompt ids of a chat request (module docstring): ``answers`` are the episode's
    earlier answers (each spliced in at most once, the latest match first); ``encode(text)``
    encodes without adding special tokens."""
    free = list(answers)
    spliced: list[tuple[int, Answer]] = []
    for i, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        hit = next((a for a in reversed(free) if is_answer(m, a)), None)
        if hit is not None:
            free.remove(hit)
            spliced.append((i, hit))
    shown = [for_template(m) for m in messages]
    if not spliced:
        return tuple(encode(chat.conversation_text(shown)))
    first = spliced[0][0]
    ids = list(encode(chat.conversation_text(shown[:first])))
    ends = [i for i, _ in spliced[1:]] + [len(shown)]
    for (i, answer), end in zip(spliced, ends):
        ids += answer.token_ids
        ids += chat.continuation_ids(shown[i + 1:end], answer.token_ids[-1] if answer.token_ids else None)
    return tuple(ids)


def text_prompt_ids(prompt: str, calls: Sequence[Call], encode: Any) -> tuple[int, ...]:
    """The prompt ids of a completion request (module docstring): the longest earlier prompt
    and answer it starts with, spliced, the rest encoded once; else ``encode(prompt, True)``
    (the tokenizer's special tokens added, as vLLM's completions do)."""
    best: tuple[int, tuple[int, ...]] | None = None
    for call in calls:
        if call.prompt_text is None or not prompt.startswith(call.prompt_text):
            continue
        for answer in call.answers:
            head = call.prompt_text + answer.text
            if prompt.startswith(head) and (best is None or len(head) > best[0]):
                best = (len(head), call.prompt_ids + answer.token_ids)
    if best is None:
        return tuple(encode(prompt, True))
    rest = prompt[best[0]:]
    return best[1] + tuple(encode(rest, False) if rest else ())
