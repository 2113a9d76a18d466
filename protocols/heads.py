"""Which KV heads each tensor-parallel rank holds, and which prefill rank feeds which
decode rank when the two instances run different TP sizes.

vLLM splits a model's KV heads across the ranks of one instance
(``QKVParallelLinear``): with ``H`` KV heads on ``tp`` ranks, rank ``r`` holds heads
``[r * H / tp, (r + 1) * H / tp)`` when ``tp`` divides ``H``; when ``H`` divides ``tp``,
each head is replicated on ``tp / H`` ranks and rank ``r`` holds head ``r // (tp / H)``.
Any other pair (6 heads on 4 ranks) does not split, and vLLM refuses it too. MLA's
latent cache has no head axis: every rank holds all of it (``replicated``).

A *lane* is one (prefill rank, decode rank) pair and the run of heads that moves on it.
For equal TP sizes the lanes are ``(r, r)``, all of rank r's heads. A decode rank whose
heads lie on several prefill ranks gets one lane from each (P TP 2 -> D TP 1: two lanes
into D rank 0); a prefill rank whose heads several decode ranks need feeds each of them
(P TP 1 -> D TP 2: P rank 0 feeds D ranks 0 and 1, half of its heads each). Where
several prefill ranks hold a head (replicated), decode ranks spread over them.

Pure Python (no torch): the broker routes by these lanes and the workers cut and join
heads by them, so both must compute the same ones.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Lane", "lane_refusal", "lanes", "rank_heads", "split_refusal"]


@dataclass(frozen=True)
class Lane:
    """Prefill rank `source` sends decode rank `rank` the global KV heads ``[start, stop)``."""

    source: int
    rank: int
    start: int
    stop: int


def split_refusal(total: int, tp: int) -> str | None:
    """Why `tp` ranks cannot split `total` KV heads, or None when they can."""
    if total < 1 or tp < 1:
        return f"{total} KV heads on {tp} ranks is not a cache this connector can split"
    if total % tp and tp % total:
        return f"{total} KV heads do not split over {tp} ranks (neither count divides the other)"
    return None


def rank_heads(total: int, tp: int, rank: int, *, replicated: bool = False) -> tuple[int, int]:
    """The global KV heads ``[start, stop)`` that `rank` of `tp` holds."""
    if replicated:
        return 0, 1
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} is outside 0..{tp - 1}")
    why = split_refusal(total, tp)
    if why:
        raise ValueError(why)
    if total >= tp:
        per = total // tp
        return rank * per, (rank + 1) * per
    head = rank // (tp // total)
    return head, head + 1


def lane_refusal(total: int, p_tp: int, d_tp: int) -> str | None:
    """Why prefill TP `p_tp` and decode TP `d_tp` cannot map `total` KV heads, or None.

    `total` 0 means the heads are not known (a cache without a head axis that is not
    replicated): then only equal TP sizes map, rank to rank.
    """
    if total == 0:
        return None if p_tp == d_tp else (
            f"the KV cache has no head count to split, so prefill TP {p_tp} and decode TP {d_tp} must be equal")
    for side, tp in (("prefill", p_tp), ("decode", d_tp)):
        why = split_refusal(total, tp)
        if why:
            return f"{why} on the {side} side"
    return None


def lanes(total: int, p_tp: int, d_tp: int, *, replicated: bool = False) -> list[Lane]:
    """Every lane from a prefill instance of TP `p_tp` to a decode instance of TP `d_tp`,
    ordered by decode rank, then head.

    Raises:
        ValueError: the sizes cannot map (`lane_refusal` says why).
    """
    if replicated:
        return [Lane(r % p_tp, r, 0, 1) for r in range(d_tp)]
    why = lane_refusal(total, p_tp, d_tp)
    if why:
        raise ValueError(why)
    if total == 0:
        return [Lane(r, r, 0, 0) for r in range(d_tp)]
    out: list[Lane] = []
    for r in range(d_tp):
        start, stop = rank_heads(total, d_tp, r)
        run: Lane | None = None
        for h in range(start, stop):
            src = _holder(total, p_tp, h, r)
            if run is not None and run.source == src:
                run = Lane(src, r, run.start, h + 1)
            else:
                if run is not None:
                    out.append(run)
                run = Lane(src, r, h, h + 1)
        assert run is not None
        out.append(run)
    return out


def _holder(total: int, tp: int, head: int, rank: int) -> int:
    """The prefill rank that sends `head` to decode rank `rank`: the one holding it, or,
    where several replicate it, one picked by `rank` so decode ranks spread over them."""
    if total >= tp:
        return head // (total // tp)
    replicas = tp // total
    return head * replicas + rank % replicas
