"""Weights from the trainer to the rollout workers, in three parts: the paths' channels
(``channels/``, one path per file, the interface and the path's choice), the trainer's side
(``publish/``) and the worker's side (``receive/``). What both sides share sits here: the
protocol (``protocol.py``), the message (``message.py``), the dtypes on the wire
(``dtypes.py``) and a version's byte layout (``layout.py``). Nothing here imports
``pipeline_rl.rollout``."""
