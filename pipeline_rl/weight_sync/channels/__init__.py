"""The weight paths, one per file (``shm.py`` with ``host_gpu.py`` for its GPU ends,
``object_store.py``, ``cuda_ipc.py``, ``gloo.py``, ``nccl.py``), each with its trainer half and
its wire infos; the one channel interface and decoder (``channel.py``), every path's traits
(``path_table.py``), which path a worker gets (``paths.py``) and the run key's proof at a
rendezvous (``rendezvous_auth.py``)."""
