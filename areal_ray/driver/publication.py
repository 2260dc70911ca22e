"""Publication: which weights the replicas must serve, and who has loaded them.

Every weight push (and every rollback after a trainer restart) is an *announcement*
with a serial number; a replica acks the serials it loads. A push completes when every
registered replica has acked its serial; replicas that miss the deadline are dropped
(`drop_behind`). Serials, not versions, identify a publication: a rollback to an older
version is still a new one that every replica must load.

The collective weight path adds *membership epochs*: the broadcast group is formed
from the registered replicas, and re-formed (a new epoch) whenever that set changed. A
replica that registers while a broadcast is announced is not in it: it counts as having
loaded that serial and takes the next publication (every step makes one).

With rolling updates the *load slot* lets one replica at a time swap weights. A holder
that died or was dropped frees it, since it is no longer registered.

Pure bookkeeping: the driver actor (actor.py) holds one and waits on a condition
variable for the predicates here (`newer_than`, `all_loaded`, `slot_free_for`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Announcement:
    serial: int  # 0: the model on disk, loaded by every replica at start
    version: int
    payload: Any  # a typed weight payload (areal_ray/weights/payloads.py); None: from disk

    def as_tuple(self) -> tuple:
        """(serial, version, payload): what replicas receive over Ray."""
        return self.serial, self.version, self.payload


def admits(payload, replica_id: str) -> bool:
    """Whether `replica_id` can load this publication (None: the model on disk)."""
    return payload is None or payload.admits(replica_id)


class Publication:
    def __init__(self):
        self.latest = Announcement(0, 0, None)
        self.loaded: dict[str, int] = {}  # registered replica -> last serial it loaded
        self.nodes: dict[str, str] = {}  # replica -> Ray node id
        self.load_s: dict[str, tuple[int, float]] = {}  # replica -> (serial, seconds to load it)
        self.loader: str | None = None  # rolling updates: the replica swapping weights now
        self.store: tuple[str, int] | None = None  # collective path: trainer rank 0's store
        self.members: list[str] | None = None  # replicas of the current group epoch
        self.epoch = 0

    # ------------------------------------------------------------ replicas
    def register(self, replica_id: str, node_id: str = "") -> Announcement:
        """A new replica: it loads the latest publication, unless that is a broadcast
        already formed without it (then it waits for the next)."""
        late = not admits(self.latest.payload, replica_id)
        self.loaded[replica_id] = self.latest.serial if late else -1
        self.nodes[replica_id] = node_id
        return self.latest

    def unregister(self, replica_id: str) -> None:
        self.loaded.pop(replica_id, None)

    def rejoin(self, replica_id: str, have: int) -> None:
        """A replica polling after it was dropped is registered again at what it has."""
        self.loaded.setdefault(replica_id, have)

    def ack(self, replica_id: str, serial: int, load_s: float = 0.0) -> None:
        self.loaded[replica_id] = serial
        self.load_s[replica_id] = (serial, load_s)

    def replica_nodes(self) -> set[str]:
        return {self.nodes.get(r, "") for r in self.loaded}

    # ------------------------------------------------------------ publications
    def announce(self, version: int, payload) -> Announcement:
        self.latest = Announcement(self.latest.serial + 1, version, payload)
        return self.latest

    def swap_payload(self, payload) -> None:
        """The same publication carried by another payload (the driver's own copy of
        the trainer's objects): same serial, so no replica loads it again."""
        self.latest = Announcement(self.latest.serial, self.latest.version, payload)

    def newer_than(self, serial: int) -> bool:
        return self.latest.serial > serial

    def all_loaded(self, serial: int) -> bool:
        return all(s >= serial for s in self.loaded.values())

    def drop_behind(self, serial: int) -> list[str]:
        """Unregister every replica that has not loaded `serial` (the push deadline passed)."""
        dropped = [r for r, s in self.loaded.items() if s < serial]
        for r in dropped:
            self.loaded.pop(r)
        return dropped

    def load_time(self, serial: int) -> float:
        """The slowest replica's load of `serial`, in seconds."""
        return max((t for s, t in self.load_s.values() if s == serial), default=0.0)

    # ------------------------------------------------------------ collective groups
    def set_store(self, host: str, port: int) -> None:
        """A (new) trainer rank 0 serves the rendezvous store: the next push forms a group."""
        self.store, self.members = (host, port), None

    def group_for_push(self) -> tuple[int, dict[str, int], int] | None:
        """(epoch, rank of each replica, world size) of the group of every registered
        replica, rank 0 being the trainer; a new epoch when membership changed. None
        when no group can be formed (no store or no replica)."""
        if self.store is None or not self.loaded:
            return None
        members = sorted(self.loaded)
        if members != self.members:
            self.epoch, self.members = self.epoch + 1, members
        return self.epoch, {r: i + 1 for i, r in enumerate(members)}, len(members) + 1

    def forget_group(self) -> None:
        """A broadcast failed: the next collective push forms a group of the live replicas."""
        self.members = None

    # ------------------------------------------------------------ rolling updates
    def slot_free_for(self, replica_id: str) -> bool:
        return self.loader in (None, replica_id) or self.loader not in self.loaded

    def take_slot(self, replica_id: str) -> None:
        self.loader = replica_id

    def release_slot(self, replica_id: str) -> bool:
        if self.loader != replica_id:
            return False
        self.loader = None
        return True
