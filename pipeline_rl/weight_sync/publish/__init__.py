"""The trainer's side of a weight update: a version gathered off the training thread
(``gather.py``) and published to every worker, newest only, one channel each
(``publisher.py``), through a worker's Ray actor (``clients.py``)."""
