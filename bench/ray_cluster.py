"""A local Ray cluster of two nodes on this machine, for the Ray launcher's bench and tests.

Two raylets (Ray's `cluster_utils.Cluster`), each with one CPU and a resource of its own,
and the dashboard on the head (Ray's Jobs API lives there). Kept small for two cores:
80 MiB object stores, no metrics export. Start-up is about 10 s, so one cluster serves a
whole test module.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx

from bench.harness import free_port

__all__ = ["LocalRayCluster", "local_ray_cluster"]

_OBJECT_STORE_BYTES = 80 * 1024 * 1024


@dataclass
class LocalRayCluster:
    address: str  # the GCS address (ray start --address)
    dashboard_url: str  # the Jobs API: the server's --ray-address
    cluster: object
    startup_s: float


@contextmanager
def local_ray_cluster(nodes: int = 2, *, cpus_per_node: int = 1) -> Iterator[LocalRayCluster]:
    from ray.cluster_utils import Cluster

    started = time.monotonic()
    port = free_port()
    common = dict(num_cpus=cpus_per_node, object_store_memory=_OBJECT_STORE_BYTES)
    cluster = Cluster(initialize_head=True, connect=False, head_node_args=dict(
        include_dashboard=True, dashboard_host="127.0.0.1", dashboard_port=port,
        resources={"ajet_test_node0": 1}, **common))
    try:
        for index in range(1, nodes):
            cluster.add_node(resources={f"ajet_test_node{index}": 1}, **common)
        cluster.wait_for_nodes()
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:  # the Jobs API answers once the dashboard's job module is up
            try:
                if httpx.get(f"{url}/api/version", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Ray dashboard did not answer on {url} within 60 s")
            time.sleep(0.2)
        yield LocalRayCluster(address=cluster.address, dashboard_url=url, cluster=cluster,
                              startup_s=time.monotonic() - started)
    finally:
        cluster.shutdown()
