from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PromptQuery(_message.Message):
    __slots__ = ("ns_id", "keys", "tokens", "by_tokens")
    NS_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    BY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ns_id: bytes
    keys: bytes
    tokens: _containers.RepeatedScalarFieldContainer[int]
    by_tokens: bool
    def __init__(self, ns_id: _Optional[bytes] = ..., keys: _Optional[bytes] = ..., tokens: _Optional[_Iterable[int]] = ..., by_tokens: _Optional[bool] = ...) -> None: ...

class Holding(_message.Message):
    __slots__ = ("location", "kind", "node", "gpu_run", "cpu_run", "disk_run", "total", "last_seen", "stored_at")
    LOCATION_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    GPU_RUN_FIELD_NUMBER: _ClassVar[int]
    CPU_RUN_FIELD_NUMBER: _ClassVar[int]
    DISK_RUN_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_FIELD_NUMBER: _ClassVar[int]
    STORED_AT_FIELD_NUMBER: _ClassVar[int]
    location: str
    kind: str
    node: str
    gpu_run: int
    cpu_run: int
    disk_run: int
    total: int
    last_seen: float
    stored_at: float
    def __init__(self, location: _Optional[str] = ..., kind: _Optional[str] = ..., node: _Optional[str] = ..., gpu_run: _Optional[int] = ..., cpu_run: _Optional[int] = ..., disk_run: _Optional[int] = ..., total: _Optional[int] = ..., last_seen: _Optional[float] = ..., stored_at: _Optional[float] = ...) -> None: ...

class PromptAnswer(_message.Message):
    __slots__ = ("ns_id", "num_chunks", "holdings", "health")
    NS_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    HOLDINGS_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    ns_id: bytes
    num_chunks: int
    holdings: _containers.RepeatedCompositeFieldContainer[Holding]
    health: str
    def __init__(self, ns_id: _Optional[bytes] = ..., num_chunks: _Optional[int] = ..., holdings: _Optional[_Iterable[_Union[Holding, _Mapping]]] = ..., health: _Optional[str] = ...) -> None: ...

class QueryRequest(_message.Message):
    __slots__ = ("queries",)
    QUERIES_FIELD_NUMBER: _ClassVar[int]
    queries: _containers.RepeatedCompositeFieldContainer[PromptQuery]
    def __init__(self, queries: _Optional[_Iterable[_Union[PromptQuery, _Mapping]]] = ...) -> None: ...

class QueryReply(_message.Message):
    __slots__ = ("answers",)
    ANSWERS_FIELD_NUMBER: _ClassVar[int]
    answers: _containers.RepeatedCompositeFieldContainer[PromptAnswer]
    def __init__(self, answers: _Optional[_Iterable[_Union[PromptAnswer, _Mapping]]] = ...) -> None: ...

class RegisterNamespaceRequest(_message.Message):
    __slots__ = ("namespace_json", "ns_id")
    NAMESPACE_JSON_FIELD_NUMBER: _ClassVar[int]
    NS_ID_FIELD_NUMBER: _ClassVar[int]
    namespace_json: str
    ns_id: bytes
    def __init__(self, namespace_json: _Optional[str] = ..., ns_id: _Optional[bytes] = ...) -> None: ...

class RegisterNamespaceReply(_message.Message):
    __slots__ = ("ns_id",)
    NS_ID_FIELD_NUMBER: _ClassVar[int]
    ns_id: bytes
    def __init__(self, ns_id: _Optional[bytes] = ...) -> None: ...

class NamespacesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NamespaceEntry(_message.Message):
    __slots__ = ("ns_id", "namespace_json")
    NS_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_JSON_FIELD_NUMBER: _ClassVar[int]
    ns_id: bytes
    namespace_json: str
    def __init__(self, ns_id: _Optional[bytes] = ..., namespace_json: _Optional[str] = ...) -> None: ...

class NamespacesReply(_message.Message):
    __slots__ = ("namespaces",)
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    namespaces: _containers.RepeatedCompositeFieldContainer[NamespaceEntry]
    def __init__(self, namespaces: _Optional[_Iterable[_Union[NamespaceEntry, _Mapping]]] = ...) -> None: ...

class Registration(_message.Message):
    __slots__ = ("location", "kind", "namespaces", "node", "endpoints")
    class EndpointsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    LOCATION_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    location: str
    kind: str
    namespaces: _containers.RepeatedScalarFieldContainer[bytes]
    node: str
    endpoints: _containers.ScalarMap[str, str]
    def __init__(self, location: _Optional[str] = ..., kind: _Optional[str] = ..., namespaces: _Optional[_Iterable[bytes]] = ..., node: _Optional[str] = ..., endpoints: _Optional[_Mapping[str, str]] = ...) -> None: ...

class LocationInfo(_message.Message):
    __slots__ = ("registration", "status", "last_seen", "epoch", "seq", "entries")
    class EntriesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    REGISTRATION_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    registration: Registration
    status: str
    last_seen: float
    epoch: int
    seq: int
    entries: _containers.ScalarMap[str, int]
    def __init__(self, registration: _Optional[_Union[Registration, _Mapping]] = ..., status: _Optional[str] = ..., last_seen: _Optional[float] = ..., epoch: _Optional[int] = ..., seq: _Optional[int] = ..., entries: _Optional[_Mapping[str, int]] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("registration",)
    REGISTRATION_FIELD_NUMBER: _ClassVar[int]
    registration: Registration
    def __init__(self, registration: _Optional[_Union[Registration, _Mapping]] = ...) -> None: ...

class RegisterReply(_message.Message):
    __slots__ = ("info",)
    INFO_FIELD_NUMBER: _ClassVar[int]
    info: LocationInfo
    def __init__(self, info: _Optional[_Union[LocationInfo, _Mapping]] = ...) -> None: ...

class LocationRequest(_message.Message):
    __slots__ = ("location",)
    LOCATION_FIELD_NUMBER: _ClassVar[int]
    location: str
    def __init__(self, location: _Optional[str] = ...) -> None: ...

class ExistedReply(_message.Message):
    __slots__ = ("existed",)
    EXISTED_FIELD_NUMBER: _ClassVar[int]
    existed: bool
    def __init__(self, existed: _Optional[bool] = ...) -> None: ...

class LocationsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LocationsReply(_message.Message):
    __slots__ = ("locations",)
    LOCATIONS_FIELD_NUMBER: _ClassVar[int]
    locations: _containers.RepeatedCompositeFieldContainer[LocationInfo]
    def __init__(self, locations: _Optional[_Iterable[_Union[LocationInfo, _Mapping]]] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("locations",)
    LOCATIONS_FIELD_NUMBER: _ClassVar[int]
    locations: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, locations: _Optional[_Iterable[str]] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("statuses",)
    STATUSES_FIELD_NUMBER: _ClassVar[int]
    statuses: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, statuses: _Optional[_Iterable[str]] = ...) -> None: ...

class ReapRequest(_message.Message):
    __slots__ = ("timeout_s",)
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    timeout_s: float
    def __init__(self, timeout_s: _Optional[float] = ...) -> None: ...

class ReapReply(_message.Message):
    __slots__ = ("dropped",)
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    dropped: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, dropped: _Optional[_Iterable[str]] = ...) -> None: ...

class ChunkOp(_message.Message):
    __slots__ = ("kind", "tier", "ns_id", "keys")
    KIND_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    NS_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    kind: str
    tier: str
    ns_id: bytes
    keys: bytes
    def __init__(self, kind: _Optional[str] = ..., tier: _Optional[str] = ..., ns_id: _Optional[bytes] = ..., keys: _Optional[bytes] = ...) -> None: ...

class ApplyRequest(_message.Message):
    __slots__ = ("location", "ops", "epoch", "seq_from", "seq_to")
    LOCATION_FIELD_NUMBER: _ClassVar[int]
    OPS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQ_FROM_FIELD_NUMBER: _ClassVar[int]
    SEQ_TO_FIELD_NUMBER: _ClassVar[int]
    location: str
    ops: _containers.RepeatedCompositeFieldContainer[ChunkOp]
    epoch: int
    seq_from: int
    seq_to: int
    def __init__(self, location: _Optional[str] = ..., ops: _Optional[_Iterable[_Union[ChunkOp, _Mapping]]] = ..., epoch: _Optional[int] = ..., seq_from: _Optional[int] = ..., seq_to: _Optional[int] = ...) -> None: ...

class ApplyReply(_message.Message):
    __slots__ = ("status",)
    STATUS_FIELD_NUMBER: _ClassVar[int]
    status: str
    def __init__(self, status: _Optional[str] = ...) -> None: ...

class TierChunks(_message.Message):
    __slots__ = ("tier", "ns_id", "keys")
    TIER_FIELD_NUMBER: _ClassVar[int]
    NS_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    tier: str
    ns_id: bytes
    keys: bytes
    def __init__(self, tier: _Optional[str] = ..., ns_id: _Optional[bytes] = ..., keys: _Optional[bytes] = ...) -> None: ...

class ReplaceRequest(_message.Message):
    __slots__ = ("location", "holdings", "epoch", "seq")
    LOCATION_FIELD_NUMBER: _ClassVar[int]
    HOLDINGS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    location: str
    holdings: _containers.RepeatedCompositeFieldContainer[TierChunks]
    epoch: int
    seq: int
    def __init__(self, location: _Optional[str] = ..., holdings: _Optional[_Iterable[_Union[TierChunks, _Mapping]]] = ..., epoch: _Optional[int] = ..., seq: _Optional[int] = ...) -> None: ...

class ReplaceReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ClaimRequest(_message.Message):
    __slots__ = ("location", "owner", "ttl_s")
    LOCATION_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    location: str
    owner: str
    ttl_s: float
    def __init__(self, location: _Optional[str] = ..., owner: _Optional[str] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class ClaimReply(_message.Message):
    __slots__ = ("granted",)
    GRANTED_FIELD_NUMBER: _ClassVar[int]
    granted: bool
    def __init__(self, granted: _Optional[bool] = ...) -> None: ...

class Change(_message.Message):
    __slots__ = ("seq", "namespace", "register", "unregister", "drop", "apply", "replace", "heartbeat", "router")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    REGISTER_FIELD_NUMBER: _ClassVar[int]
    UNREGISTER_FIELD_NUMBER: _ClassVar[int]
    DROP_FIELD_NUMBER: _ClassVar[int]
    APPLY_FIELD_NUMBER: _ClassVar[int]
    REPLACE_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    ROUTER_FIELD_NUMBER: _ClassVar[int]
    seq: int
    namespace: RegisterNamespaceRequest
    register: Registration
    unregister: str
    drop: str
    apply: ApplyRequest
    replace: ReplaceRequest
    heartbeat: HeartbeatRequest
    router: RouterShare
    def __init__(self, seq: _Optional[int] = ..., namespace: _Optional[_Union[RegisterNamespaceRequest, _Mapping]] = ..., register: _Optional[_Union[Registration, _Mapping]] = ..., unregister: _Optional[str] = ..., drop: _Optional[str] = ..., apply: _Optional[_Union[ApplyRequest, _Mapping]] = ..., replace: _Optional[_Union[ReplaceRequest, _Mapping]] = ..., heartbeat: _Optional[_Union[HeartbeatRequest, _Mapping]] = ..., router: _Optional[_Union[RouterShare, _Mapping]] = ...) -> None: ...

class InstanceShare(_message.Message):
    __slots__ = ("instance", "in_flight", "pending_prefill_tokens", "ejected_for_s", "ejected_reason")
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    PENDING_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EJECTED_FOR_S_FIELD_NUMBER: _ClassVar[int]
    EJECTED_REASON_FIELD_NUMBER: _ClassVar[int]
    instance: str
    in_flight: int
    pending_prefill_tokens: float
    ejected_for_s: float
    ejected_reason: str
    def __init__(self, instance: _Optional[str] = ..., in_flight: _Optional[int] = ..., pending_prefill_tokens: _Optional[float] = ..., ejected_for_s: _Optional[float] = ..., ejected_reason: _Optional[str] = ...) -> None: ...

class RoutedKeys(_message.Message):
    __slots__ = ("instance", "ns_id", "keys")
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    NS_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    instance: str
    ns_id: bytes
    keys: bytes
    def __init__(self, instance: _Optional[str] = ..., ns_id: _Optional[bytes] = ..., keys: _Optional[bytes] = ...) -> None: ...

class RouterShare(_message.Message):
    __slots__ = ("router", "ttl_s", "instances", "routed")
    ROUTER_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    ROUTED_FIELD_NUMBER: _ClassVar[int]
    router: str
    ttl_s: float
    instances: _containers.RepeatedCompositeFieldContainer[InstanceShare]
    routed: _containers.RepeatedCompositeFieldContainer[RoutedKeys]
    def __init__(self, router: _Optional[str] = ..., ttl_s: _Optional[float] = ..., instances: _Optional[_Iterable[_Union[InstanceShare, _Mapping]]] = ..., routed: _Optional[_Iterable[_Union[RoutedKeys, _Mapping]]] = ...) -> None: ...

class ShareReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FollowRequest(_message.Message):
    __slots__ = ("epoch", "after", "limit", "wait_s")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    AFTER_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    epoch: str
    after: int
    limit: int
    wait_s: float
    def __init__(self, epoch: _Optional[str] = ..., after: _Optional[int] = ..., limit: _Optional[int] = ..., wait_s: _Optional[float] = ...) -> None: ...

class FollowReply(_message.Message):
    __slots__ = ("epoch", "gap", "last", "changes")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    GAP_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    CHANGES_FIELD_NUMBER: _ClassVar[int]
    epoch: str
    gap: bool
    last: int
    changes: _containers.RepeatedCompositeFieldContainer[Change]
    def __init__(self, epoch: _Optional[str] = ..., gap: _Optional[bool] = ..., last: _Optional[int] = ..., changes: _Optional[_Iterable[_Union[Change, _Mapping]]] = ...) -> None: ...

class SnapshotRequest(_message.Message):
    __slots__ = ("snapshot_id", "part")
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    snapshot_id: str
    part: int
    def __init__(self, snapshot_id: _Optional[str] = ..., part: _Optional[int] = ...) -> None: ...

class TierEntries(_message.Message):
    __slots__ = ("tier", "keys", "stored_at")
    TIER_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    STORED_AT_FIELD_NUMBER: _ClassVar[int]
    tier: str
    keys: bytes
    stored_at: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, tier: _Optional[str] = ..., keys: _Optional[bytes] = ..., stored_at: _Optional[_Iterable[float]] = ...) -> None: ...

class LocationDump(_message.Message):
    __slots__ = ("info", "tiers")
    INFO_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    info: LocationInfo
    tiers: _containers.RepeatedCompositeFieldContainer[TierEntries]
    def __init__(self, info: _Optional[_Union[LocationInfo, _Mapping]] = ..., tiers: _Optional[_Iterable[_Union[TierEntries, _Mapping]]] = ...) -> None: ...

class SnapshotPart(_message.Message):
    __slots__ = ("snapshot_id", "parts", "epoch", "seq", "namespaces", "locations")
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    LOCATIONS_FIELD_NUMBER: _ClassVar[int]
    snapshot_id: str
    parts: int
    epoch: str
    seq: int
    namespaces: _containers.RepeatedCompositeFieldContainer[NamespaceEntry]
    locations: _containers.RepeatedCompositeFieldContainer[LocationDump]
    def __init__(self, snapshot_id: _Optional[str] = ..., parts: _Optional[int] = ..., epoch: _Optional[str] = ..., seq: _Optional[int] = ..., namespaces: _Optional[_Iterable[_Union[NamespaceEntry, _Mapping]]] = ..., locations: _Optional[_Iterable[_Union[LocationDump, _Mapping]]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsReply(_message.Message):
    __slots__ = ("stats_json", "health", "health_reason")
    STATS_JSON_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    HEALTH_REASON_FIELD_NUMBER: _ClassVar[int]
    stats_json: str
    health: str
    health_reason: str
    def __init__(self, stats_json: _Optional[str] = ..., health: _Optional[str] = ..., health_reason: _Optional[str] = ...) -> None: ...
