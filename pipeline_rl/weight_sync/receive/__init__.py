"""The worker's side of a weight update: every path's worker half (``receiver.py``), the
backend vLLM builds in its worker (``vllm_backend.py``) and what it reads of vLLM
(``vllm_adapter.py``), the loads into a served CPU model (``loaders.py``, and
``core_staging.py`` inside an AsyncLLM engine core), and a LoRA run's updates
(``lora_update.py``)."""
