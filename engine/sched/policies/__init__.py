"""Scheduling policies over one loop (base.py); make_policy(name) builds one."""

from __future__ import annotations

from .apt import AptPolicy, FCFSHybridPolicy
from .base import Group, Policy
from .bros import BROSPolicy
from .fcfs import FCFSPolicy
from .infermax import InferMaxPolicy
from .priority import PriorityPolicy
from .rr import RoundRobinPolicy
from .sarathi import SarathiPolicy

POLICIES: dict[str, type[Policy]] = {
    p.name: p for p in (FCFSPolicy, SarathiPolicy, PriorityPolicy, InferMaxPolicy, AptPolicy,
                        BROSPolicy, RoundRobinPolicy, FCFSHybridPolicy)
}


def make_policy(name: str) -> Policy:
    if name not in POLICIES:
        raise ValueError(f"unknown scheduling policy {name!r}; choose from "
                         f"{', '.join(sorted(POLICIES))}")
    return POLICIES[name]()


__all__ = ["POLICIES", "Group", "Policy", "make_policy"]
