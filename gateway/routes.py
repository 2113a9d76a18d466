"""Which prefill and decode instance serve a request: the gateway's decisions, sans IO.

The gateway (`gateway.proxy`) asks a `Router` for a `Route` per client request, tells it
when each upstream request starts and ends, and feeds it the broker's `Status` and the
clock. Nothing here touches a socket, so the choices are plain to test.

Every instance given can take a request; a route ranks them, and never refuses one for
what the broker said. What a route prefers, in order:
1. Instances the broker has registered under the role they serve: their KV can move. An
   instance the broker does not list (the broker is unreachable or has just restarted,
   the instance is registering again) still gets requests when no registered one of its
   role is left: the request is sent as usual, P/D resumes as soon as they register,
   and D's `kv_load_failure_policy` covers a transfer that cannot happen. Without a
   recent status every instance counts as registered.
2. Instances that have not just failed a request of the gateway's (`down_s`).
3. For decode, one with room in its receive pool: a decode instance whose pools are full
   would make the transfer wait for credit.
4. The least busy: the gateway's own requests in flight on it, or the broker's count of
   its transfers when that is higher (with several gateways in front of the same
   servers, the only sign of the others' requests); then the most free pool bytes;
   then whichever was picked longest ago (so equal instances take turns).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import urlsplit

from protocols.messages import Status

Role = Literal["prefill", "decode"]


@dataclass(frozen=True)
class Upstream:
    """One vLLM OpenAI server behind the gateway, named as its connector registers."""

    instance_id: str
    role: Role
    host: str
    port: int

    @classmethod
    def parse(cls, role: Role, spec: str) -> Upstream:
        """`INSTANCE_ID=http://HOST:PORT`, as given on the command line."""
        name, sep, url = spec.partition("=")
        if not sep or not name or not url:
            raise ValueError(f"--{role} {spec!r} must look like INSTANCE_ID=http://HOST:PORT (the connector's instance_id).")
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname or parts.path not in ("", "/"):
            raise ValueError(f"--{role} {spec!r}: the URL must be http://HOST:PORT with no path (https is not spoken).")
        try:
            port = parts.port or 80
        except ValueError:
            raise ValueError(f"--{role} {spec!r}: the port must be a number from 1 to 65535.") from None
        return cls(instance_id=name, role=role, host=parts.hostname, port=port)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


@dataclass(frozen=True)
class Route:
    transfer_id: str
    prefill: Upstream
    decode: Upstream


@dataclass
class _Load:
    in_flight: int = 0
    down_until: float = float("-inf")
    last_picked: int = -1  # the pick counter when it was last chosen


@dataclass
class BrokerView:
    """What the last status said, as the router uses it."""

    at: float
    registered: dict[Role, set[str]] = field(default_factory=dict)
    free_bytes: dict[str, int] = field(default_factory=dict)  # decode instance -> free bytes over its pools
    # instance -> transfers the broker has in flight for it, whoever sent their requests:
    # with several gateways in front of the same servers, the load the others put there
    transfers: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_status(cls, status: Status, now: float) -> BrokerView:
        view = cls(at=now, registered={"prefill": set(), "decode": set()})
        instance_of = {}
        for peer in status.peers:
            if peer.role in ("prefill", "decode"):
                view.registered[peer.role].add(peer.instance_id)  # type: ignore[index]
            instance_of[peer.peer_id] = peer.instance_id
            view.transfers[peer.instance_id] = view.transfers.get(peer.instance_id, 0) + peer.transfers
        for pool in status.pools:
            inst = instance_of.get(pool.peer_id)
            if inst is not None:
                view.free_bytes[inst] = view.free_bytes.get(inst, 0) + pool.free
        return view


class Router:
    """Picks a (prefill, decode) pair per request and keeps what it needs for the next pick.

    `stale_s`: a status older than this no longer ranks instances. `down_s`: how long an
    instance that failed a request (refused the connection, answered 5xx) is passed over
    while others remain. `new_transfer_id` makes each route's transfer_id.
    """

    def __init__(
        self, upstreams: Sequence[Upstream], *, stale_s: float = 5.0, down_s: float = 5.0,
        new_transfer_id: Callable[[], str] | None = None,
    ) -> None:
        check_upstreams(upstreams)
        self.upstreams = list(upstreams)
        self.stale_s = stale_s
        self.down_s = down_s
        self.new_transfer_id = new_transfer_id or random_transfer_id
        self.view: BrokerView | None = None
        self._load = {u.instance_id: _Load() for u in upstreams}
        self._given: dict[str, list[Upstream]] = {r: [u for u in upstreams if u.role == r] for r in ("prefill", "decode")}
        self._given_ids = {r: {u.instance_id for u in us} for r, us in self._given.items()}
        self._picks = 0

    # --- what the router is told ---------------------------------------------------

    def observe(self, status: Status, now: float) -> None:
        self.view = BrokerView.from_status(status, now)

    def started(self, upstream: Upstream) -> None:
        self._load[upstream.instance_id].in_flight += 1

    def finished(self, upstream: Upstream, now: float, *, failed: bool = False) -> None:
        load = self._load[upstream.instance_id]
        load.in_flight = max(0, load.in_flight - 1)
        if failed:
            load.down_until = now + self.down_s

    # --- what it answers ---------------------------------------------------------------

    def in_flight(self, upstream: Upstream) -> int:
        return self._load[upstream.instance_id].in_flight

    def fresh_view(self, now: float) -> BrokerView | None:
        v = self.view
        return v if v is not None and now - v.at <= self.stale_s else None

    def registered(self, role: Role, now: float) -> set[str]:
        """The instances of `role` the broker lists, or every one given while it is silent."""
        view = self.fresh_view(now)
        given = self._given_ids[role]
        return set(given) if view is None else given & view.registered.get(role, set())

    def candidates(self, role: Role, now: float, exclude: Iterable[str] = ()) -> list[Upstream]:
        """Every instance of `role` not in `exclude`, best first (module docstring)."""
        skip = set(exclude)
        pool = [u for u in self._given[role] if u.instance_id not in skip]
        if len(pool) < 2:
            return pool  # nothing to rank
        view = self.fresh_view(now)
        registered = self.registered(role, now)
        free = view.free_bytes if view is not None else {}
        transfers = view.transfers if view is not None else {}

        def key(u: Upstream) -> tuple[int, int, int, int, int, int]:
            load = self._load[u.instance_id]
            full = int(role == "decode" and u.instance_id in free and free[u.instance_id] <= 0)
            # This gateway's own requests count at once; the broker's count of the
            # instance's transfers (which also holds other gateways' requests, a status
            # late) when it is higher.
            busy = max(load.in_flight, transfers.get(u.instance_id, 0))
            return (int(u.instance_id not in registered), int(load.down_until > now), full, busy,
                    -free.get(u.instance_id, 0), load.last_picked)

        return sorted(pool, key=key)

    def usable(self, role: Role, now: float) -> set[str]:
        """Instances a request's first choice may fall on: registered, not failed lately."""
        return {i for i in self.registered(role, now) if self._load[i].down_until <= now}

    def pick(self, role: Role, now: float, exclude: Iterable[str] = ()) -> Upstream | None:
        ranked = self.candidates(role, now, exclude)
        return self._take(ranked[0]) if ranked else None

    def _take(self, up: Upstream) -> Upstream:
        self._picks += 1
        self._load[up.instance_id].last_picked = self._picks
        return up

    def route(self, now: float, exclude: Iterable[str] = ()) -> Route | None:
        """A new transfer's route, or None when `exclude` leaves a role no instance."""
        skip = list(exclude)
        ps, ds = self.candidates("prefill", now, skip), self.candidates("decode", now, skip)
        if not ps or not ds:
            return None
        return Route(transfer_id=self.new_transfer_id(), prefill=self._take(ps[0]), decode=self._take(ds[0]))

    def degraded(self, now: float) -> str | None:
        """Why requests may go to instances the broker does not list, in one sentence,
        or None while it answers and lists one of each role."""
        if self.view is None:
            return "no status from the broker yet; requests go to every instance given."
        if now - self.view.at > self.stale_s:
            return (f"the broker has not answered for {now - self.view.at:.0f} s; requests go to every instance "
                    f"given until it does.")
        for role in ("prefill", "decode"):
            if not self.registered(role, now):  # type: ignore[arg-type]
                given = ", ".join(u.instance_id for u in self.upstreams if u.role == role)
                return (
                    f"no {role} instance is registered at the broker (given: {given}); requests go to those given "
                    f"until one registers: start one whose kv_connector_extra_config names this broker and one of "
                    f"these instance_ids."
                )
        return None


def check_upstreams(upstreams: Sequence[Upstream]) -> None:
    """Distinct instance ids, and at least one instance of each role; else a ValueError
    that says what to give."""
    names = [u.instance_id for u in upstreams]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"instance id {dup[0]!r} is given twice; each vLLM server registers under its own instance_id.")
    for role in ("prefill", "decode"):
        if not any(u.role == role for u in upstreams):
            raise ValueError(f"no {role} instance given; name at least one with --{role} INSTANCE_ID=http://HOST:PORT.")


def random_transfer_id() -> str:
    """The gateway's transfer_ids: unique, and naming the gateway as their maker. The one
    place an id is made (a `Router`'s `new_transfer_id` replaces it)."""
    return f"gw-{uuid.uuid4().hex}"
