"""How the broker plans the lanes of a transfer between two instances.

A lane is one (prefill rank, decode rank) pair and the KV heads that move on it
(`protocols.heads`); the broker keys transfers by lane (`broker.transfers.lane_id`),
reserves each lane's bytes on its decode rank's pool, and tells both ends which heads
the lane carries. Planning needs both instances' TP sizes, which the broker knows from
their registrations: an Offer is planned against the decode instance its request went
to (named by the Offer, or claiming it already), an Expect against the prefill
instance it names or that offered it already. Where the other instance is not known
yet, every registered instance of that role with the right model serves one TP size in
a homogeneous deployment, and that size is taken; failing that, equal TP sizes.

Pure functions over `Register` messages; no state.
"""

from __future__ import annotations

from collections.abc import Iterable

from protocols.heads import Lane, lane_refusal, lanes, rank_heads
from protocols.messages import Layout, Register

__all__ = ["claim_share", "equal_tp_refusal", "lane_share", "pairing_refusal", "plan", "wire_heads"]


def pairing_refusal(p: Register, d: Register) -> str | None:
    """Why prefill `p`'s instance cannot feed decode `d`'s, in one sentence, or None."""
    if p.kv_replicated or d.kv_replicated:
        return None
    why = lane_refusal(p.kv_heads, p.world_size, d.world_size)
    if why is None:
        return None
    return (
        f"prefill instance {p.instance_id} (TP {p.world_size}) cannot feed decode instance {d.instance_id} "
        f"(TP {d.world_size}): {why}; serve both with TP sizes that divide the model's KV heads, or with equal TP"
    )


def equal_tp_refusal(a: Register, b: Register) -> str | None:
    """Why instances `a` and `b` of a model that moves between equal TP sizes only (its
    compatibility fields hold the TP size) cannot pair, where their TP sizes differ: one
    sentence, or None. A hybrid model is one (its staged rows differ in width, which
    lanes do not cut), as is a model whose KV head count vLLM does not report."""
    if "world_size" not in a.compat or a.compat.get("world_size") == b.compat.get("world_size"):
        return None
    what = ("a hybrid model (several KV cache groups)" if "kv_groups" in a.compat
            else "a model whose KV head count vLLM does not report")
    return (f"{a.role} instance {a.instance_id} (TP {a.world_size}) cannot pair with {b.role} instance "
            f"{b.instance_id} (TP {b.world_size}): {what} moves between equal TP sizes only; serve both with the "
            "same tensor-parallel size")


def plan(p: Register, d: Register) -> list[Lane]:
    """Every lane from `p`'s instance to `d`'s (raises ValueError: `pairing_refusal`)."""
    why = pairing_refusal(p, d)
    if why:
        raise ValueError(why)
    return lanes(p.kv_heads, p.world_size, d.world_size, replicated=p.kv_replicated)


def lane_share(nbytes: int, layout: Layout, lane: Lane, p: Register) -> tuple[int, Layout]:
    """The bytes and the staged layout of `lane` out of prefill rank `lane.source`'s
    offer of `nbytes`: its heads' share of every block."""
    if p.kv_replicated or p.kv_heads == 0:
        return nbytes, layout
    start, stop = rank_heads(p.kv_heads, p.world_size, lane.source)
    held, moved = stop - start, lane.stop - lane.start
    if moved == held:
        return nbytes, layout
    block = layout.block_nbytes // held * moved
    return nbytes // held * moved, Layout(kind=layout.kind, dtype=layout.dtype, num_layers=layout.num_layers,
                                          num_blocks=layout.num_blocks, block_nbytes=block)


def claim_share(nbytes: int, lane: Lane, d: Register) -> int:
    """The bytes of `lane` out of decode rank `lane.rank`'s claim of `nbytes` (its Expect:
    every lane into that rank together): its heads' share, as `lane_share` cuts the
    Offer's on the prefill side. Only the room reserved at the claim rests on it; the
    Offer's own size is what is sent, and a claim's room of another size is given back
    and reserved again at the Offer."""
    if d.kv_replicated or d.kv_heads == 0:
        return nbytes
    start, stop = rank_heads(d.kv_heads, d.world_size, lane.rank)
    held, moved = stop - start, lane.stop - lane.start
    return nbytes if moved == held else nbytes // held * moved


def wire_heads(lane: Lane, p: Register, d: Register) -> tuple[int, int]:
    """The head run that Prepare and Go carry: (0, 0) where the lane moves all of the
    source rank's heads into a rank that holds exactly those (equal TP)."""
    if p.world_size == d.world_size or p.kv_heads == 0 and not p.kv_replicated:
        return 0, 0
    return lane.start, lane.stop


def one_size(regs: Iterable[Register]) -> Register | None:
    """A registration standing for all of `regs` when they share one TP size, else None."""
    found: dict[int, Register] = {}
    for reg in regs:
        found.setdefault(reg.world_size, reg)
        if len(found) > 1:
            return None
    return next(iter(found.values()), None)
