"""``--task.*``: what the policy is trained on, the task's reward and its episodes (environments
or agents). A section of :class:`pipeline_rl.config.Config` (and importable from there); kept in
a module of its own for its size. Like ``config/tree.py`` it imports no torch, vLLM or Ray."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from pipeline_rl.config_section import Section


class TaskConfig(Section):
    """What the policy is trained on."""

    name: Literal["addition", "sort", "countdown", "calc", "word_problems", "dataset"] = Field(
        "sort", description="Built-in verifiable task (sort: 'sort 5193=' -> '1359'; addition: "
        "'12+34=' -> '46'; countdown: 'countdown 003=' -> '003 002 001 000', heavy-tailed lengths "
        "of 4-492 tokens with --task.digits 3, so give it --rollout.max_new_tokens 492 "
        "--rollout.max_model_len 512; calc: multi-turn with a calculator tool, 'calc 4821*7396=' -> "
        "the call '[4821*7396]', the tool's reply '=35655316;', then '35655316'; --task.digits "
        "1-6); word_problems: arithmetic word problems in English for a pretrained chat model "
        "('Tom has 7 apples. Tom gets 5 more. How many apples does Tom have now? Answer in one short "
        "sentence.' -> 12, checked by math answer matching; --task.max_level 1-5), or 'dataset' for "
        "--task.dataset.")
    dataset: str | None = Field(None, description="Local data file: .jsonl, .json, .parquet, .arrow, "
                                ".csv, or a datasets save_to_disk folder (nothing is downloaded), with "
                                "the --task.prompt_field and --task.answer_field columns; math "
                                "answer-matching reward. Sets task.name=dataset.")
    prompt_field: str = Field("prompt", min_length=1, description="Dataset: the column holding the "
                              "prompt text.")
    answer_field: str = Field("answer", min_length=1, description="Dataset: the column holding the "
                              "reference answer (a string or a number) the reward compares against.")
    chat_template: Literal["auto", "none"] = Field(
        "auto", description="auto: when the model's tokenizer has a chat template, feed each prompt "
        "rendered by it as the user turn (after --task.system_prompt) with the generation prompt; "
        "none: feed prompts verbatim.")
    system_prompt: str | None = Field(None, description="System message put before every prompt by "
                                      "the chat template (needs --task.chat_template auto and a "
                                      "tokenizer with a template).")
    reward: str | None = Field(None, description="Replace the task's reward. MODULE:FUNCTION: a "
                               "callable (def or async def) of our form f(prompt, completion, meta) -> "
                               "float, TRL's f(prompts, completions, **kwargs) -> list[float] (the data's "
                               "columns as keyword arguments; None: no score) or verl's "
                               "compute_score(data_source, solution_str, ground_truth, extra_info=None), "
                               "told by its signature (see --task.reward_form); imported at start-up, so "
                               "the module must be importable (installed "
                               "or on PYTHONPATH) on every node. Several, weighted: "
                               "SPEC@WEIGHT,SPEC@WEIGHT (summed). http(s)://HOST:PORT/PATH: a remote "
                               "reward; each group's completions are one POST of a JSON list "
                               "[{\"prompt\": ..., \"completion\": ..., \"answer\": ... or null}, ...] "
                               "(prompt as written, before any chat template; answer: the reference "
                               "answer) answered by a JSON list of as many numbers, in order; "
                               "keep-alive, retried 3 times with back-off on connection errors and "
                               "5xx; at start-up a POST of [] must be answered with a JSON list.")
    reward_form: Literal["auto", "ours", "trl", "verl"] = Field(
        "auto", description="How --task.reward's functions are called: auto tells by the signature "
        "(a 'completions' parameter: trl; 'solution_str' and 'ground_truth': verl; else ours).")
    reward_concurrency: int = Field(64, ge=1, le=4096, description="Reward calls a rollout worker "
                                    "keeps in flight at most: threads for a def reward or a remote "
                                    "one (one connection each), concurrent calls of an async def one "
                                    "(on the worker's event loop). Rewards never hold up generation.")
    reward_timeout_s: float = Field(60.0, gt=0.0, le=86_400.0, description="A reward call running "
                                    "longer scores 0 and is counted (reward_timeouts); for a remote "
                                    "reward also the socket timeout of each attempt.")
    reward_errors: Literal["zero", "fail"] = Field(
        "zero", description="A reward that raises, returns a non-number (or non-finite) or times "
        "out: zero scores that completion 0 (the first failure is one console line, the rest are "
        "counted on the step lines and in metrics.jsonl; a reward that fails on its first 32 calls "
        "without one success ends the run); fail ends the run at the first failure.")
    env: str | None = Field(None, description="Multi-turn episodes with an environment MODULE:CLASS "
                            "(pipeline_rl.tasks.env.Environment; a class: one instance per episode, an "
                            "instance: shared). Unset: the task's own (--task.name calc), else single-turn.")
    agent: str | None = Field(None, description="An agent as the rollout: MODULE:FUNCTION naming "
                              "agent(client, sample) -> reward (async def: an openai.AsyncOpenAI client, def: "
                              "an openai.OpenAI one, pointed at the worker's endpoint), called --rollout.n "
                              "times per prompt, each bounded by --task.env_timeout_s (docs/episodes.md).")
    max_turns: int = Field(4, ge=1, le=1024, description="Episodes: model turns at most (then finish "
                           "reason 'turns').")
    env_concurrency: int = Field(64, ge=1, le=4096, description="Episodes: environment calls in flight "
                                 "per worker at most (threads, or concurrent async calls).")
    env_timeout_s: float = Field(60.0, gt=0.0, le=86_400.0, description="Episodes: an environment call "
                                 "running longer ends its episode as failed.")
    env_errors: Literal["zero", "fail"] = Field(
        "zero", description="Episodes: an environment that raises, answers with no EnvReply or times "
        "out: zero ends that episode with reward 0 (counted like a reward failure); fail ends the run.")
    digits: int = Field(4, ge=1, le=12, description="Built-in tasks: operand digits / list length.")
    max_level: int = Field(2, ge=1, le=5, description="word_problems: the hardest level drawn; levels "
                           "1..max_level come equally often (1: one step up to 20; 2: larger numbers or a "
                           "small product; 3: two steps; 4: a product then a difference; 5: equal sharing "
                           "of a sum).")
    num_prompts: int = Field(100_000, ge=1, description="Built-in tasks: size of the prompt pool.")

    @model_validator(mode="before")
    @classmethod
    def _dataset_implies_name(cls, data: object) -> object:
        if isinstance(data, dict) and data.get("dataset") is not None and "name" not in data:
            return {**data, "name": "dataset"}
        return data

    @model_validator(mode="after")
    def _dataset_given(self) -> "TaskConfig":
        if (self.name == "dataset") != (self.dataset is not None):
            raise ValueError("task.dataset: give a data file exactly when task.name is 'dataset'")
        return self

    @model_validator(mode="after")
    def _countdown_digits(self) -> "TaskConfig":
        if self.name == "countdown" and self.digits < 3:
            raise ValueError(f"task.digits: countdown needs numbers of 3 or more digits (got {self.digits})")
        return self

    @model_validator(mode="after")
    def _template_and_reward(self) -> "TaskConfig":
        """The system prompt needs a template; the reward is spelt MODULE:FUNCTION or
        http(s)://HOST:PORT/PATH (it is imported or probed when the task is built, before
        anything starts)."""
        if self.system_prompt and self.chat_template == "none":
            raise ValueError("task.system_prompt: needs --task.chat_template auto (got none)")
        from pipeline_rl.tasks.plugin import REWARD_SPEC, check_reward_spec  # torch-free, stdlib only

        if self.reward is not None:
            check_reward_spec(self.reward)
        if self.env is not None and not REWARD_SPEC.match(self.env):
            raise ValueError(f"task.env: expected MODULE:CLASS (e.g. my_envs:Game), got {self.env!r}")
        if self.agent is not None and not REWARD_SPEC.match(self.agent):
            raise ValueError(f"task.agent: expected MODULE:FUNCTION (e.g. my_agents:solve), got {self.agent!r}")
        if self.agent is not None and self.env is not None:
            raise ValueError("task.agent: an agent is the rollout; it takes no --task.env")
        return self
