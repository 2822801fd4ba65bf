"""Quest (Tang et al. 2024, Algorithm 1), naive: each page's per-channel key minimum and maximum,
the upper bound of the query's logit over the page, and the top pages by that bound."""

from __future__ import annotations


def naive_page_bounds(q_group: list[list[float]], keys: list[list[float]], page: int) -> list[float]:
    """The bound of every ``page``-token page of ``keys [m][D]`` (the last page may be partial):
    ``U_c = sum_i max(q_i * max_{j in c} k_{j,i}, q_i * min_{j in c} k_{j,i})`` with ``q`` the mean of
    the group's queries (one query: the paper's formula). Loops over pages and channels, fp64."""
    D = len(keys[0])
    q = [sum(qv[i] for qv in q_group) / len(q_group) for i in range(D)]
    bounds = []
    for start in range(0, len(keys), page):
        tokens = keys[start : start + page]
        total = 0.0
        for i in range(D):
            low = min(k[i] for k in tokens)
            high = max(k[i] for k in tokens)
            total += max(q[i] * high, q[i] * low)
        bounds.append(total)
    return bounds


def naive_page_choice(
    q_group: list[list[float]], keys: list[list[float]], page: int, n_sel: int
) -> list[int]:
    """The top ``n_sel`` pages of :func:`naive_page_bounds` (ties: lower page), ascending."""
    bounds = naive_page_bounds(q_group, keys, page)
    order = sorted(range(len(bounds)), key=lambda c: (-bounds[c], c))
    return sorted(order[:n_sel])
