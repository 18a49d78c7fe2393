"""The exact multiple-choice knapsack: one option per decision, least predicted cost within the bytes.

Pure math, no I/O. Dynamic programming over the decisions keeps the Pareto front of (bytes, cost): a
partial mix is dropped only when another has no more bytes and no more cost, so the optimum is never
lost (no rounding of sizes, no relaxation). States that cannot fit whatever the remaining decisions pick
are cut early. V4-Flash has 43 layers x 4 decisions x 2-4 options; identical layers give few distinct
byte sums, so the front stays small (tests/test_automix.py checks the solver against brute force).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Option:
    label: str
    bytes: int
    cost: float


def solve(groups: list[list[Option]], capacity: int) -> list[int] | None:
    """Index of the chosen option per group: least total cost with total bytes <= ``capacity``; ties go to
    fewer bytes. None when even the smallest options do not fit."""
    if any(not g for g in groups):
        raise ValueError("every decision needs at least one option")
    smallest = [min(o.bytes for o in g) for g in groups]
    rest = np.cumsum([0] + smallest[::-1])[::-1]          # rest[i]: least bytes of groups i..end
    if rest[0] > capacity:
        return None
    sizes = np.zeros(1, dtype=np.int64)
    costs = np.zeros(1, dtype=np.float64)
    trail: list[tuple[np.ndarray, np.ndarray]] = []
    for i, group in enumerate(groups):
        option_bytes = np.array([o.bytes for o in group], dtype=np.int64)
        option_costs = np.array([o.cost for o in group], dtype=np.float64)
        new_sizes = (sizes[:, None] + option_bytes[None, :]).ravel()
        new_costs = (costs[:, None] + option_costs[None, :]).ravel()
        parents = np.repeat(np.arange(sizes.size), len(group))
        choices = np.tile(np.arange(len(group)), sizes.size)
        keep = new_sizes + rest[i + 1] <= capacity
        new_sizes, new_costs, parents, choices = new_sizes[keep], new_costs[keep], parents[keep], choices[keep]
        order = np.lexsort((new_costs, new_sizes))
        new_sizes, new_costs, parents, choices = new_sizes[order], new_costs[order], parents[order], choices[order]
        best_before = np.minimum.accumulate(np.concatenate([[np.inf], new_costs[:-1]]))
        front = new_costs < best_before                    # strictly better than everything no larger
        sizes, costs = new_sizes[front], new_costs[front]
        trail.append((parents[front], choices[front]))
    state = int(np.argmin(costs))                          # the front's cost falls as bytes grow
    picked = []
    for parents, choices in reversed(trail):
        picked.append(int(choices[state]))
        state = int(parents[state])
    return picked[::-1]


def total(groups: list[list[Option]], picked: list[int]) -> tuple[int, float]:
    return (sum(g[i].bytes for g, i in zip(groups, picked)), sum(g[i].cost for g, i in zip(groups, picked)))
