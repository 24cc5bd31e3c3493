"""The Ray job of one engine run: its driver (`__main__`) and one agent per node (`agent`).

Shipped by the swarm server's Ray launcher as a `runtime_env` py_module, so it imports
only the standard library, Ray and psutil (both in the engine's interpreter), never the
server: the cluster's nodes need not have the server installed. `wire` is the one shape
the driver and the server share: the marker lines in the job's log.
"""
