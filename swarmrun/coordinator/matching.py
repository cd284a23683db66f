"""Bipartite b-matching of workers to runs, with preferences: the feasibility oracle of placement.

Device and memory constraints make "can these runs hold their minimums at once?" a matching question:
counting workers is not enough when a CUDA run and a CPU run both want the one CUDA box. This module
answers it exactly, with augmenting paths (Kuhn's algorithm, each run expanded to as many slots as
it demands). Each run lists its candidate workers best first; a slot takes an unmatched candidate in
that order before it tries to reroute another slot, so a run keeps the workers it already holds
(listed first) whenever the demands allow it: placement stays stable from one tick to the next.
"""

from __future__ import annotations

from typing import Mapping, Sequence


def b_matching(demands: Mapping[str, int], candidates: Mapping[str, Sequence[str]]) -> dict[str, str]:
    """Match workers to runs, at most ``demands[run]`` workers per run, as many in all as possible.

    Args:
        demands: run id -> how many workers it asks for; runs are served in this mapping's order.
        candidates: run id -> the workers it may take, best first.

    Returns:
        worker id -> run id. Every demand is met if and only if any matching meets them all.
    """
    match: dict[str, str] = {}
    for run, want in demands.items():
        for _ in range(want):
            if not _take_free(run, candidates[run], match):
                _augment(run, candidates, match, set())
    return match


def matched_counts(match: Mapping[str, str]) -> dict[str, int]:
    """How many workers each run got in ``match``."""
    counts: dict[str, int] = {}
    for run in match.values():
        counts[run] = counts.get(run, 0) + 1
    return counts


def _take_free(run: str, cands: Sequence[str], match: dict[str, str]) -> bool:
    """Give ``run`` its best unmatched candidate, if any (preference before rerouting)."""
    for worker in cands:
        if worker not in match:
            match[worker] = run
            return True
    return False


def _augment(run: str, candidates: Mapping[str, Sequence[str]], match: dict[str, str], seen: set[str]) -> bool:
    """One more worker for ``run`` along an augmenting path: a candidate's holder moves to another of its own.

    Recursion depth is bounded by the number of workers (each is visited once per search).
    """
    for worker in candidates[run]:
        holder = match.get(worker)
        if worker in seen or holder == run:
            continue
        seen.add(worker)
        if holder is None or _augment(holder, candidates, match, seen):
            match[worker] = run
            return True
    return False
