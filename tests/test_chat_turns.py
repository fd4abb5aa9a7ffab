"""Chat episodes through the chat template (``pipeline_rl.rollout.chat_turns``): for a
ChatML/Qwen2.5 and a Llama-3 style template on tiny random models built here, the ids of
an episode -- the templated prompt, the model's turns as token ids, each reply's
continuation -- equal the template's rendering of the whole conversation, tool messages
with their call ids included, whether a turn ended with the model's end-of-turn token or
was cut."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from chat_models import build_chat_model
from pipeline_rl.rollout.chat_turns import ChatTurns
from pipeline_rl.tasks.messages import Message, tool_result

TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two integers.",
                                           "parameters": {"type": "object", "properties": {
                                               "a": {"type": "integer"}, "b": {"type": "integer"}},
                                               "required": ["a", "b"]}}}]


@pytest.fixture(scope="module", params=["qwen2", "llama3"])
def tokenizer(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(build_chat_model(request.param, tmp_path_factory.mktemp(request.param))))


@pytest.mark.parametrize("tools", [None, TOOLS])
@pytest.mark.parametrize("ended", [True, False])
def test_episode_ids_are_the_templates_rendering_of_the_conversation(tokenizer: Any, tools: Any,
                                                                     ended: bool) -> None:
    turns = ChatTurns(tokenizer, tools)
    start = [Message("system", "Use the tools."), Message("user", "What is 3+4, then that plus 5?")]
    model_texts = ['<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call>',
                   '<tool_call>\n{"name": "add", "arguments": {"a": 7, "b": 5}}\n</tool_call>', "It is 12."]
    replies = [[tool_result("call_1", "add", "7")],
               [tool_result("call_2", "add", "12"), Message("user", "Now say it.")]]
    end_id = tokenizer.eos_token_id
    ids = tokenizer.encode(turns.prompt_text(start), add_special_tokens=False)
    conversation = [m.as_dict() for m in start]
    for k, text in enumerate(model_texts):
        model_ids = tokenizer.encode(text, add_special_tokens=False) + ([end_id] if ended or k == 2 else [])
        ids += model_ids                                     # the model's tokens, as sampled: never re-encoded
        conversation.append({"role": "assistant", "content": text})
        if k < len(replies):
            ids += turns.reply_ids(replies[k], model_ids[-1])
            conversation += [m.as_dict() for m in replies[k]]
    want = tokenizer.apply_chat_template(conversation, tools=tools, tokenize=False)
    want = want[:want.rindex(tokenizer.eos_token) + len(tokenizer.eos_token)]   # the episode ends at the model's end
    assert tokenizer.decode(ids, skip_special_tokens=False) == want
    assert ids == tokenizer.encode(want, add_special_tokens=False)


def test_a_function_tool_env_reads_calls_with_vllms_parser_and_answers_errors(tmp_path: Path) -> None:
    """``FunctionToolEnv``: the schema from the signature and docstring; a Hermes call is run
    and answered by a tool message with its call id; a malformed call, an unknown tool and
    bad arguments are answered by error messages the model sees (tool errors), never raised;
    a turn without a call ends the episode, scored."""
    from transformers import AutoTokenizer

    from pipeline_rl.tasks.base import Prompt
    from tool_envs import AddTools

    schema = AddTools.tool_schemas()[0]["function"]
    assert schema["name"] == "add" and schema["description"] == "Add two integers."
    assert schema["parameters"] == {"type": "object", "required": ["a", "b"], "properties": {
        "a": {"type": "integer", "description": "the first addend"},
        "b": {"type": "integer", "description": "the second addend"}}}
    env = AddTools()
    env.attach(AutoTokenizer.from_pretrained(str(build_chat_model("qwen2", tmp_path / "q"))))
    env.reset(Prompt(0, "What is 3+4?", "7"))
    ok = env.step('Let me add.<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call><|im_end|>')
    assert ok.messages is not None and [(m.role, m.content, m.name) for m in ok.messages] == [("tool", "7", "add")]
    assert ok.messages[0].tool_call_id and (ok.tool_calls, ok.tool_errors, ok.done) == (1, 0, False)
    for bad, said in [('<tool_call>\n{"name": "add", "arguments": {"a": 3\n</tool_call>', "could not be parsed"),
                      ('<tool_call>\n{"name": "mul", "arguments": {"a": 3, "b": 4}}\n</tool_call>', "no tool named 'mul'"),
                      ('<tool_call>\n{"name": "add", "arguments": {"a": 3}}\n</tool_call>', "TypeError")]:
        reply = env.step(bad)
        assert reply.messages is not None and said in reply.messages[0].content, (bad, reply)
        assert (reply.tool_calls, reply.tool_errors, reply.done) == (1, 1, False)
    assert env.step("It is 7.<|im_end|>") == type(ok)(reward=1.0, done=True)
