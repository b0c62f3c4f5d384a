"""The change feed and its snapshots on the wire (index.proto, "the change feed"), shared by
the index's server and client."""

from __future__ import annotations

from collections.abc import Iterator

from kvtier.core.keys import Namespace, pack_keys, unpack_keys
from kvtier.index.client.changes import (
    Change,
    ChangeKind,
    FeedBatch,
    IndexDump,
    InstanceShare,
    LocationDump,
    RouterShare,
)
from kvtier.index.client.wire import (
    info_from_pb,
    info_to_pb,
    op_from_pb,
    op_to_pb,
    registration_from_pb,
    registration_to_pb,
    tier_from,
)
from kvtier.index.proto import index_pb2 as pb

# entries per snapshot part: 16-byte keys and 8-byte times, ~24 MB, under MESSAGE_LIMIT
PART_ENTRIES = 1 << 20
# bounds of one router share (a router's whole view every 100 ms is far below them)
SHARE_MAX_INSTANCES = 4096
SHARE_MAX_KEYS = 1 << 16
SHARE_MAX_TTL_S = 10.0
SHARE_MAX_NAME = 256


def namespace_to_pb(ns_id: bytes, definition: Namespace | None) -> pb.NamespaceEntry:
    return pb.NamespaceEntry(
        ns_id=ns_id, namespace_json=definition.model_dump_json() if definition else ""
    )


def namespace_from_pb(msg: pb.NamespaceEntry) -> tuple[bytes, Namespace | None]:
    if msg.namespace_json:
        return msg.ns_id, Namespace.model_validate_json(msg.namespace_json)
    return msg.ns_id, None


def change_to_pb(change: Change) -> pb.Change:
    msg = pb.Change(seq=change.seq)
    kind = change.kind
    if kind is ChangeKind.NAMESPACE:
        ns = change.namespace
        if isinstance(ns, Namespace):
            msg.namespace.namespace_json = ns.model_dump_json()
        else:
            msg.namespace.ns_id = ns or b""
    elif kind is ChangeKind.REGISTER:
        assert change.registration is not None
        msg.register.CopyFrom(registration_to_pb(change.registration))
    elif kind is ChangeKind.UNREGISTER:
        msg.unregister = change.location
    elif kind is ChangeKind.DROP:
        msg.drop = change.location
    elif kind is ChangeKind.APPLY:
        msg.apply.location = change.location
        msg.apply.ops.extend(op_to_pb(op) for op in change.ops)
    elif kind is ChangeKind.REPLACE:
        msg.replace.location = change.location
        for tier, by_ns in (change.holdings or {}).items():
            for ns_id, keys in by_ns.items():
                msg.replace.holdings.add(tier=tier.value, ns_id=ns_id, keys=pack_keys(keys))
    elif kind is ChangeKind.ROUTER:
        assert change.share is not None
        msg.router.CopyFrom(share_to_pb(change.share))
    else:
        msg.heartbeat.locations.extend(change.locations)
    return msg


def change_from_pb(msg: pb.Change) -> Change:
    which = msg.WhichOneof("change")
    if which == "namespace":
        ns = msg.namespace
        definition = (
            Namespace.model_validate_json(ns.namespace_json) if ns.namespace_json else ns.ns_id
        )
        return Change(msg.seq, ChangeKind.NAMESPACE, namespace=definition)
    if which == "register":
        reg = registration_from_pb(msg.register)
        return Change(msg.seq, ChangeKind.REGISTER, location=reg.location, registration=reg)
    if which == "unregister":
        return Change(msg.seq, ChangeKind.UNREGISTER, location=msg.unregister)
    if which == "drop":
        return Change(msg.seq, ChangeKind.DROP, location=msg.drop)
    if which == "apply":
        ops = tuple(op_from_pb(op) for op in msg.apply.ops)
        return Change(msg.seq, ChangeKind.APPLY, location=msg.apply.location, ops=ops)
    if which == "replace":
        holdings: dict = {}
        for part in msg.replace.holdings:
            by_ns = holdings.setdefault(tier_from(part.tier), {})
            by_ns.setdefault(part.ns_id, []).extend(unpack_keys(part.keys))
        return Change(msg.seq, ChangeKind.REPLACE, location=msg.replace.location, holdings=holdings)
    if which == "heartbeat":
        return Change(msg.seq, ChangeKind.HEARTBEAT, locations=tuple(msg.heartbeat.locations))
    if which == "router":
        return Change(msg.seq, ChangeKind.ROUTER, share=share_from_pb(msg.router))
    raise ValueError(f"a change of no known kind (seq {msg.seq})")


def share_to_pb(share: RouterShare) -> pb.RouterShare:
    return pb.RouterShare(
        router=share.router,
        ttl_s=share.ttl_s,
        instances=[
            pb.InstanceShare(
                instance=i.instance,
                in_flight=i.in_flight,
                pending_prefill_tokens=i.pending_prefill_tokens,
                ejected_for_s=i.ejected_for_s,
                ejected_reason=i.ejected_reason,
            )
            for i in share.instances
        ],
        routed=[
            pb.RoutedKeys(instance=inst, ns_id=ns_id, keys=pack_keys(keys))
            for inst, ns_id, keys in share.routed
        ],
    )


def share_from_pb(msg: pb.RouterShare) -> RouterShare:
    """A router's share, checked against the bounds (a malformed one is INVALID_ARGUMENT)."""
    if not msg.router or len(msg.router) > SHARE_MAX_NAME:
        raise ValueError(f"a router share names its router in 1..{SHARE_MAX_NAME} characters")
    if not 0 < msg.ttl_s <= SHARE_MAX_TTL_S:
        raise ValueError(f"a router share's ttl_s is in (0, {SHARE_MAX_TTL_S}]")
    if len(msg.instances) > SHARE_MAX_INSTANCES:
        raise ValueError(f"a router share names at most {SHARE_MAX_INSTANCES} instances")
    instances = []
    for i in msg.instances:
        if len(i.instance) > SHARE_MAX_NAME or len(i.ejected_reason) > SHARE_MAX_NAME:
            raise ValueError("an instance name or reason in a router share is too long")
        if not (i.pending_prefill_tokens >= 0 and 0 <= i.ejected_for_s <= 3600):
            raise ValueError("a router share's load or ejection is out of range")
        instances.append(
            InstanceShare(
                i.instance,
                i.in_flight,
                i.pending_prefill_tokens,
                i.ejected_for_s,
                i.ejected_reason,
            )
        )
    routed = []
    total = 0
    for r in msg.routed:
        keys = tuple(unpack_keys(r.keys))
        total += len(keys)
        if total > SHARE_MAX_KEYS or len(r.instance) > SHARE_MAX_NAME or len(r.ns_id) != 16:
            raise ValueError("a router share's routed prompts are out of bounds")
        routed.append((r.instance, r.ns_id, keys))
    return RouterShare(msg.router, msg.ttl_s, tuple(instances), tuple(routed))


def batch_to_pb(batch: FeedBatch) -> pb.FollowReply:
    return pb.FollowReply(
        epoch=batch.epoch,
        gap=batch.gap,
        last=batch.last,
        changes=[change_to_pb(c) for c in batch.changes],
    )


def batch_from_pb(msg: pb.FollowReply) -> FeedBatch:
    return FeedBatch(msg.epoch, [change_from_pb(c) for c in msg.changes], msg.last, msg.gap)


def dump_to_parts(dump: IndexDump, snapshot_id: str) -> list[pb.SnapshotPart]:
    """The snapshot cut into parts of at most ``PART_ENTRIES`` entries (a location's entries
    may continue in the next part)."""
    parts = [pb.SnapshotPart(snapshot_id=snapshot_id, epoch=dump.epoch, seq=dump.seq)]
    parts[0].namespaces.extend(namespace_to_pb(n, d) for n, d in dump.namespaces.items())
    room = PART_ENTRIES
    for location in dump.locations:
        current = parts[-1].locations.add(info=info_to_pb(location.info))
        for tier, entries in location.entries.items():
            items = list(entries.items())
            while items:
                if room == 0:
                    parts.append(pb.SnapshotPart(snapshot_id=snapshot_id))
                    current = parts[-1].locations.add(info=info_to_pb(location.info))
                    room = PART_ENTRIES
                take, items = items[:room], items[room:]
                current.tiers.add(
                    tier=tier.value,
                    keys=pack_keys([k for k, _ in take]),
                    stored_at=[at for _, at in take],
                )
                room -= len(take)
    for part in parts:
        part.parts = len(parts)
    return parts


def dump_from_parts(parts: Iterator[pb.SnapshotPart]) -> IndexDump:
    first = next(parts)
    namespaces = dict(namespace_from_pb(n) for n in first.namespaces)
    by_name: dict[str, LocationDump] = {}
    for part in (first, *parts):
        for msg in part.locations:
            info = info_from_pb(msg.info)
            location = by_name.setdefault(info.registration.location, LocationDump(info))
            for tier_msg in msg.tiers:
                keys = unpack_keys(tier_msg.keys)
                if len(keys) != len(tier_msg.stored_at):
                    raise ValueError("a snapshot part's keys and times differ in number")
                entries = location.entries.setdefault(tier_from(tier_msg.tier), {})
                entries.update(zip(keys, tier_msg.stored_at, strict=True))
    return IndexDump(first.epoch, first.seq, namespaces, list(by_name.values()))
