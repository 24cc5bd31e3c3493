"""A local Ray cluster of two nodes on this machine, for the Ray launcher's bench and tests.

Two raylets (Ray's `cluster_utils.Cluster`), each with one CPU (the head `head_cpus`) and a
resource of its own, and the dashboard on the head (Ray's Jobs API lives there). Kept
small for two cores: 80 MiB object stores, no metrics export. Start-up is about 10 s, so
one cluster serves a whole test module.

`auth_token`: the cluster uses Ray's token authentication (`RAY_AUTH_MODE=token`); this
process's environment carries the mode and the token while the cluster lives (Ray's nodes
and clients read them from there), and `client_env` is what a client of the cluster, the
swarm server, needs.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import httpx

from bench.harness import free_port

__all__ = ["LocalRayCluster", "local_ray_cluster"]

_OBJECT_STORE_BYTES = 80 * 1024 * 1024
_AUTH_VARS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
#: The GCS checks each raylet every second instead of every 3 s, so a removed node is
#: declared dead after 5 failed checks in ~5 s instead of ~15 s. A raylet that is only
#: slow (both cores busy) still answers within the check's own 10 s timeout.
_SYSTEM_CONFIG = {"health_check_period_ms": 1000}


@dataclass
class LocalRayCluster:
    address: str  # the GCS address (ray start --address)
    dashboard_url: str  # the Jobs API: the server's --ray-address
    cluster: object
    startup_s: float
    #: what a client of the cluster needs in its environment (Ray's token, where it has one)
    client_env: dict[str, str] = field(default_factory=dict, repr=False)

    @property
    def headers(self) -> dict[str, str]:
        """HTTP headers for the dashboard (its state API, its Jobs API)."""
        token = self.client_env.get("RAY_AUTH_TOKEN")
        return {"Authorization": f"Bearer {token}"} if token else {}


@contextmanager
def local_ray_cluster(nodes: int = 2, *, cpus_per_node: int = 1, head_cpus: int | None = None,
                      auth_token: str | None = None) -> Iterator[LocalRayCluster]:
    saved = {name: os.environ.get(name) for name in _AUTH_VARS}
    client_env: dict[str, str] = {}
    if auth_token is not None:
        if "ray._raylet" in sys.modules:
            # Ray reads its authentication mode once, at its first import: this process's
            # own connection to the new cluster would go without the token
            raise RuntimeError("a token-authenticated local Ray cluster must be started "
                               "before this process imports ray; import ray lazily in the "
                               "modules a test imports at collection")
        client_env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": auth_token}
        os.environ.pop("RAY_AUTH_TOKEN_PATH", None)
        os.environ.update(client_env)
    try:
        with _cluster(nodes, cpus_per_node, head_cpus, client_env) as cluster:
            yield cluster
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextmanager
def _cluster(nodes: int, cpus_per_node: int, head_cpus: int | None,
             client_env: dict[str, str]) -> Iterator[LocalRayCluster]:
    from ray.cluster_utils import Cluster

    started = time.monotonic()
    port = free_port()
    common = dict(object_store_memory=_OBJECT_STORE_BYTES)
    cluster = Cluster(initialize_head=True, connect=False, head_node_args=dict(
        include_dashboard=True, dashboard_host="127.0.0.1", dashboard_port=port,
        num_cpus=head_cpus if head_cpus is not None else cpus_per_node,
        resources={"ajet_test_node0": 1}, _system_config=_SYSTEM_CONFIG, **common))
    try:
        for index in range(1, nodes):
            cluster.add_node(num_cpus=cpus_per_node, resources={f"ajet_test_node{index}": 1},
                             **common)
        cluster.wait_for_nodes()
        url = f"http://127.0.0.1:{port}"
        handle = LocalRayCluster(address=cluster.address, dashboard_url=url, cluster=cluster,
                                 startup_s=0.0, client_env=client_env)
        deadline = time.monotonic() + 60
        while True:  # the Jobs API answers once the dashboard's job module is up
            try:
                if httpx.get(f"{url}/api/version", headers=handle.headers,
                             timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Ray dashboard did not answer on {url} within 60 s")
            time.sleep(0.2)
        handle.startup_s = time.monotonic() - started
        yield handle
    finally:
        cluster.shutdown()
