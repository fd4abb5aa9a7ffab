"""The engines a rollout worker generates with: the interface every engine keeps (``engine.py``),
vLLM's ``LLMEngine`` stepped in the worker (``engine_inprocess.py``) and ``AsyncLLM`` with its
engine core in its own process (``engine_async.py``), which one on which device
(``engine_factory.py``), and the one module that knows vLLM's engines apart (``vllm_compat.py``)."""
