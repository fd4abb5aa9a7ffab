"""A real multi-node Ray cluster on one machine, for the tests that place work on nodes."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def two_node_cluster(node_cpus: int, head_resources: dict[str, float] | None = None,
                     node_resources: dict[str, float] | None = None) -> Iterator[Any]:
    """A real two-node Ray cluster on this machine (``ray.cluster_utils.Cluster``: each
    node its own raylet and object store), ``node_cpus`` CPUs each. Its Ray files live
    in a private temporary folder, so a plain ``ray.init()`` elsewhere on the machine
    never finds this cluster's address file and joins it by mistake. Yields the cluster
    (``.address`` to join it); nothing is connected to it yet."""
    from ray.cluster_utils import Cluster

    scratch = tempfile.mkdtemp(prefix="prl-", dir="/tmp")  # short: Unix socket paths
    old = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = scratch
    memory = 100 * 2**20  # object store per node
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": node_cpus, "resources": head_resources or {}, "object_store_memory": memory,
        "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=node_cpus, resources=node_resources or {}, object_store_memory=memory)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        cluster.shutdown()
        if old is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = old
        shutil.rmtree(scratch, ignore_errors=True)
