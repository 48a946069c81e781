"""The query planner: every query of an llmdb.Connection passes through it.

It finds the LLM call sites of a statement (callsites), prepares the tree with small rules
(rules), replaces each call with a guarded lookup so that it runs only where its value can
matter (guards), fetches each site's distinct arguments in one batch where a driver query can
name them (drivers, memo), and explains what a query will cost (estimate, explain). Results
always equal those of the query as written; a statement it does not understand runs as
written.
"""

from .explain import Report, explain
from .learned import LEARNED
from .run import Plan, Planner, plan

__all__ = ["LEARNED", "Plan", "Planner", "Report", "explain", "plan"]
