"""``--task.agent``: agents as the rollout. The worker's OpenAI-compatible endpoint
(``endpoint.py``, its requests and answers in ``vllm_tools.py``), the agents' own process
(``agent_host.py``), an agent's calls as a group on the worker's engine (``runner.py``) and
its requests and samples as token ids (``agent_tokens.py``)."""
