"""Launchers other than the local one: how an engine run is placed on a cluster.

The local launcher is `swarm_server.supervisor.PosixSpawner`. `ray_launcher.RaySpawner`
places a run on a Ray cluster (docs/distributed.md, "Several nodes through Ray"); the
package `ajet_ray_job` is what it ships to the cluster as the Ray job's driver.
"""
