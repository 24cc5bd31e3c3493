"""Who ended a Ray-launched run, from the node agents' states: the driver's verdict.

Kept apart from the driver (`__main__`), which imports Ray at the top: this is plain
logic, and a process that imports it (the tests, say) must not load Ray before it means
to (Ray reads its authentication mode once, when it is first imported).
"""

from __future__ import annotations

from typing import Any

__all__ = ["verdict", "where"]


def where(info: dict[str, Any]) -> str:
    return f"node {info['index']} ({info['ip']}, host {info['host']}, Ray node {info['node_id'][:8]})"


def verdict(states: list[dict[str, Any]], infos: list[dict[str, Any]]) -> tuple[int, str]:
    """(exit code, who ended the run) once some node's torchrun has ended."""
    ends = [(s["first_end"]["at"], i) for i, s in enumerate(states) if s.get("first_end")]
    if ends:
        _, culprit = min(ends)
    else:
        culprit = next(i for i, s in enumerate(states) if s["exit_code"] is not None)
    state, end = states[culprit], states[culprit].get("first_end")
    code = state["exit_code"] if state["exit_code"] is not None else 1
    if end and end.get("rank") is not None:
        detail = (f"rank {end['rank']} (pid {end['pid']}) on {where(infos[culprit])} ended "
                  f"first; that node's torchrun exited with code {code}")
    else:
        detail = f"the engine on {where(infos[culprit])} exited with code {code}"
    if all(s["exit_code"] == 0 for s in states):
        return 0, "every node's engine exited with code 0"
    return (code if code != 0 else 1), detail
