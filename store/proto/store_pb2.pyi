from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LookupStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    HIT: _ClassVar[LookupStatus]
    MISS: _ClassVar[LookupStatus]
    PENDING: _ClassVar[LookupStatus]

class AllocStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ALLOCATED: _ClassVar[AllocStatus]
    EXISTS: _ClassVar[AllocStatus]
    IN_PROGRESS: _ClassVar[AllocStatus]
    NO_SPACE: _ClassVar[AllocStatus]

class LeaseStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OK: _ClassVar[LeaseStatus]
    EXPIRED: _ClassVar[LeaseStatus]
    UNKNOWN: _ClassVar[LeaseStatus]

class EventKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STORED: _ClassVar[EventKind]
    REMOVED: _ClassVar[EventKind]
    CLEARED: _ClassVar[EventKind]

class FetchStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FETCH_OK: _ClassVar[FetchStatus]
    FETCH_HOLDER_MISS: _ClassVar[FetchStatus]
    FETCH_PEER_UNREACHABLE: _ClassVar[FetchStatus]
    FETCH_TIMEOUT: _ClassVar[FetchStatus]
    FETCH_TRANSFER_FAILED: _ClassVar[FetchStatus]
    FETCH_CHECKSUM_MISMATCH: _ClassVar[FetchStatus]
    FETCH_NO_SPACE: _ClassVar[FetchStatus]
    FETCH_BUSY: _ClassVar[FetchStatus]
    FETCH_REFUSED: _ClassVar[FetchStatus]
HIT: LookupStatus
MISS: LookupStatus
PENDING: LookupStatus
ALLOCATED: AllocStatus
EXISTS: AllocStatus
IN_PROGRESS: AllocStatus
NO_SPACE: AllocStatus
OK: LeaseStatus
EXPIRED: LeaseStatus
UNKNOWN: LeaseStatus
STORED: EventKind
REMOVED: EventKind
CLEARED: EventKind
FETCH_OK: FetchStatus
FETCH_HOLDER_MISS: FetchStatus
FETCH_PEER_UNREACHABLE: FetchStatus
FETCH_TIMEOUT: FetchStatus
FETCH_TRANSFER_FAILED: FetchStatus
FETCH_CHECKSUM_MISMATCH: FetchStatus
FETCH_NO_SPACE: FetchStatus
FETCH_BUSY: FetchStatus
FETCH_REFUSED: FetchStatus

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoReply(_message.Message):
    __slots__ = ("node_id", "epoch", "segment_name", "segment_size", "page_size", "version", "transfer_address", "transfer_base", "lease_ttl_s", "session_timeout_s", "control_socket", "view_offset", "view_bytes")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_NAME_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BASE_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    SESSION_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    CONTROL_SOCKET_FIELD_NUMBER: _ClassVar[int]
    VIEW_OFFSET_FIELD_NUMBER: _ClassVar[int]
    VIEW_BYTES_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    epoch: int
    segment_name: str
    segment_size: int
    page_size: int
    version: str
    transfer_address: str
    transfer_base: int
    lease_ttl_s: float
    session_timeout_s: float
    control_socket: str
    view_offset: int
    view_bytes: int
    def __init__(self, node_id: _Optional[str] = ..., epoch: _Optional[int] = ..., segment_name: _Optional[str] = ..., segment_size: _Optional[int] = ..., page_size: _Optional[int] = ..., version: _Optional[str] = ..., transfer_address: _Optional[str] = ..., transfer_base: _Optional[int] = ..., lease_ttl_s: _Optional[float] = ..., session_timeout_s: _Optional[float] = ..., control_socket: _Optional[str] = ..., view_offset: _Optional[int] = ..., view_bytes: _Optional[int] = ...) -> None: ...

class RegisterNamespaceRequest(_message.Message):
    __slots__ = ("epoch", "namespace_json", "chunk_bytes")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_JSON_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    namespace_json: str
    chunk_bytes: int
    def __init__(self, epoch: _Optional[int] = ..., namespace_json: _Optional[str] = ..., chunk_bytes: _Optional[int] = ...) -> None: ...

class RegisterNamespaceReply(_message.Message):
    __slots__ = ("ns_id",)
    NS_ID_FIELD_NUMBER: _ClassVar[int]
    ns_id: bytes
    def __init__(self, ns_id: _Optional[bytes] = ...) -> None: ...

class Locations(_message.Message):
    __slots__ = ("sizes", "checksums", "extent_counts", "extent_offsets", "extent_lengths", "keys")
    SIZES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    EXTENT_COUNTS_FIELD_NUMBER: _ClassVar[int]
    EXTENT_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    EXTENT_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    sizes: _containers.RepeatedScalarFieldContainer[int]
    checksums: _containers.RepeatedScalarFieldContainer[int]
    extent_counts: _containers.RepeatedScalarFieldContainer[int]
    extent_offsets: _containers.RepeatedScalarFieldContainer[int]
    extent_lengths: _containers.RepeatedScalarFieldContainer[int]
    keys: bytes
    def __init__(self, sizes: _Optional[_Iterable[int]] = ..., checksums: _Optional[_Iterable[int]] = ..., extent_counts: _Optional[_Iterable[int]] = ..., extent_offsets: _Optional[_Iterable[int]] = ..., extent_lengths: _Optional[_Iterable[int]] = ..., keys: _Optional[bytes] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("epoch", "ns_id", "keys", "lease_ttl_s", "session")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NS_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    ns_id: bytes
    keys: bytes
    lease_ttl_s: float
    session: int
    def __init__(self, epoch: _Optional[int] = ..., ns_id: _Optional[bytes] = ..., keys: _Optional[bytes] = ..., lease_ttl_s: _Optional[float] = ..., session: _Optional[int] = ...) -> None: ...

class LookupReply(_message.Message):
    __slots__ = ("hits", "stop", "lease_id", "lease_ttl_s")
    HITS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    hits: Locations
    stop: LookupStatus
    lease_id: int
    lease_ttl_s: float
    def __init__(self, hits: _Optional[_Union[Locations, _Mapping]] = ..., stop: _Optional[_Union[LookupStatus, str]] = ..., lease_id: _Optional[int] = ..., lease_ttl_s: _Optional[float] = ...) -> None: ...

class AllocateRequest(_message.Message):
    __slots__ = ("epoch", "ns_id", "keys", "sizes", "ttl_s", "session")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NS_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    ns_id: bytes
    keys: bytes
    sizes: _containers.RepeatedScalarFieldContainer[int]
    ttl_s: float
    session: int
    def __init__(self, epoch: _Optional[int] = ..., ns_id: _Optional[bytes] = ..., keys: _Optional[bytes] = ..., sizes: _Optional[_Iterable[int]] = ..., ttl_s: _Optional[float] = ..., session: _Optional[int] = ...) -> None: ...

class AllocateReply(_message.Message):
    __slots__ = ("lease_id", "statuses", "allocated", "lease_ttl_s")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    STATUSES_FIELD_NUMBER: _ClassVar[int]
    ALLOCATED_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    statuses: _containers.RepeatedScalarFieldContainer[AllocStatus]
    allocated: Locations
    lease_ttl_s: float
    def __init__(self, lease_id: _Optional[int] = ..., statuses: _Optional[_Iterable[_Union[AllocStatus, str]]] = ..., allocated: _Optional[_Union[Locations, _Mapping]] = ..., lease_ttl_s: _Optional[float] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("epoch", "lease_id", "keys", "checksums", "as_ns_id", "as_keys")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    AS_NS_ID_FIELD_NUMBER: _ClassVar[int]
    AS_KEYS_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    lease_id: int
    keys: bytes
    checksums: _containers.RepeatedScalarFieldContainer[int]
    as_ns_id: bytes
    as_keys: bytes
    def __init__(self, epoch: _Optional[int] = ..., lease_id: _Optional[int] = ..., keys: _Optional[bytes] = ..., checksums: _Optional[_Iterable[int]] = ..., as_ns_id: _Optional[bytes] = ..., as_keys: _Optional[bytes] = ...) -> None: ...

class CommitReply(_message.Message):
    __slots__ = ("committed",)
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    committed: int
    def __init__(self, committed: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("epoch", "lease_id", "keys")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    lease_id: int
    keys: bytes
    def __init__(self, epoch: _Optional[int] = ..., lease_id: _Optional[int] = ..., keys: _Optional[bytes] = ...) -> None: ...

class AbortReply(_message.Message):
    __slots__ = ("aborted",)
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    aborted: int
    def __init__(self, aborted: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("epoch", "lease_ids")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    lease_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, epoch: _Optional[int] = ..., lease_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ReleaseReply(_message.Message):
    __slots__ = ("statuses",)
    STATUSES_FIELD_NUMBER: _ClassVar[int]
    statuses: _containers.RepeatedScalarFieldContainer[LeaseStatus]
    def __init__(self, statuses: _Optional[_Iterable[_Union[LeaseStatus, str]]] = ...) -> None: ...

class RenewRequest(_message.Message):
    __slots__ = ("epoch", "lease_id", "ttl_s")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    lease_id: int
    ttl_s: float
    def __init__(self, epoch: _Optional[int] = ..., lease_id: _Optional[int] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class RenewReply(_message.Message):
    __slots__ = ("ttl_s",)
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    ttl_s: float
    def __init__(self, ttl_s: _Optional[float] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("epoch", "ns_id", "keys")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NS_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    ns_id: bytes
    keys: bytes
    def __init__(self, epoch: _Optional[int] = ..., ns_id: _Optional[bytes] = ..., keys: _Optional[bytes] = ...) -> None: ...

class DeleteReply(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: int
    def __init__(self, deleted: _Optional[int] = ...) -> None: ...

class OpenSessionRequest(_message.Message):
    __slots__ = ("epoch", "view_leases")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    VIEW_LEASES_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    view_leases: bool
    def __init__(self, epoch: _Optional[int] = ..., view_leases: _Optional[bool] = ...) -> None: ...

class OpenSessionReply(_message.Message):
    __slots__ = ("session", "timeout_s")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    session: int
    timeout_s: float
    def __init__(self, session: _Optional[int] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("epoch", "session")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    session: int
    def __init__(self, epoch: _Optional[int] = ..., session: _Optional[int] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("alive",)
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    alive: bool
    def __init__(self, alive: _Optional[bool] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("epoch", "session")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    session: int
    def __init__(self, epoch: _Optional[int] = ..., session: _Optional[int] = ...) -> None: ...

class CloseSessionReply(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: int
    def __init__(self, released: _Optional[int] = ...) -> None: ...

class ClearRequest(_message.Message):
    __slots__ = ("epoch",)
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    def __init__(self, epoch: _Optional[int] = ...) -> None: ...

class ClearReply(_message.Message):
    __slots__ = ("cleared",)
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    cleared: int
    def __init__(self, cleared: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsReply(_message.Message):
    __slots__ = ("stats_json",)
    STATS_JSON_FIELD_NUMBER: _ClassVar[int]
    stats_json: str
    def __init__(self, stats_json: _Optional[str] = ...) -> None: ...

class SnapshotRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NamespaceChunks(_message.Message):
    __slots__ = ("ns_id", "keys")
    NS_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    ns_id: bytes
    keys: bytes
    def __init__(self, ns_id: _Optional[bytes] = ..., keys: _Optional[bytes] = ...) -> None: ...

class SnapshotReply(_message.Message):
    __slots__ = ("seq", "chunks", "node_id", "epoch", "disk_chunks")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    DISK_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    chunks: _containers.RepeatedCompositeFieldContainer[NamespaceChunks]
    node_id: str
    epoch: int
    disk_chunks: _containers.RepeatedCompositeFieldContainer[NamespaceChunks]
    def __init__(self, seq: _Optional[int] = ..., chunks: _Optional[_Iterable[_Union[NamespaceChunks, _Mapping]]] = ..., node_id: _Optional[str] = ..., epoch: _Optional[int] = ..., disk_chunks: _Optional[_Iterable[_Union[NamespaceChunks, _Mapping]]] = ...) -> None: ...

class Event(_message.Message):
    __slots__ = ("kind", "ns_id", "keys", "tier")
    KIND_FIELD_NUMBER: _ClassVar[int]
    NS_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    kind: EventKind
    ns_id: bytes
    keys: bytes
    tier: str
    def __init__(self, kind: _Optional[_Union[EventKind, str]] = ..., ns_id: _Optional[bytes] = ..., keys: _Optional[bytes] = ..., tier: _Optional[str] = ...) -> None: ...

class EventBatch(_message.Message):
    __slots__ = ("node_id", "epoch", "seq", "timestamp", "events")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    epoch: int
    seq: int
    timestamp: float
    events: _containers.RepeatedCompositeFieldContainer[Event]
    def __init__(self, node_id: _Optional[str] = ..., epoch: _Optional[int] = ..., seq: _Optional[int] = ..., timestamp: _Optional[float] = ..., events: _Optional[_Iterable[_Union[Event, _Mapping]]] = ...) -> None: ...

class ReadEventsRequest(_message.Message):
    __slots__ = ("from_seq", "max_batches", "timeout_s")
    FROM_SEQ_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCHES_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    from_seq: int
    max_batches: int
    timeout_s: float
    def __init__(self, from_seq: _Optional[int] = ..., max_batches: _Optional[int] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class ReadEventsReply(_message.Message):
    __slots__ = ("batches", "gap_oldest")
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    GAP_OLDEST_FIELD_NUMBER: _ClassVar[int]
    batches: _containers.RepeatedCompositeFieldContainer[EventBatch]
    gap_oldest: int
    def __init__(self, batches: _Optional[_Iterable[_Union[EventBatch, _Mapping]]] = ..., gap_oldest: _Optional[int] = ...) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("epoch", "ns_id", "keys", "holder", "timeout_s")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NS_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    ns_id: bytes
    keys: bytes
    holder: str
    timeout_s: float
    def __init__(self, epoch: _Optional[int] = ..., ns_id: _Optional[bytes] = ..., keys: _Optional[bytes] = ..., holder: _Optional[str] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class StageFromDiskRequest(_message.Message):
    __slots__ = ("epoch", "ns_id", "keys", "timeout_s")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NS_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    ns_id: bytes
    keys: bytes
    timeout_s: float
    def __init__(self, epoch: _Optional[int] = ..., ns_id: _Optional[bytes] = ..., keys: _Optional[bytes] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class FetchReply(_message.Message):
    __slots__ = ("status", "local", "fetched", "bytes", "holder_hits", "checksum_mismatches", "present", "message")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_FIELD_NUMBER: _ClassVar[int]
    FETCHED_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    HOLDER_HITS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_MISMATCHES_FIELD_NUMBER: _ClassVar[int]
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    status: FetchStatus
    local: int
    fetched: int
    bytes: int
    holder_hits: int
    checksum_mismatches: int
    present: bytes
    message: str
    def __init__(self, status: _Optional[_Union[FetchStatus, str]] = ..., local: _Optional[int] = ..., fetched: _Optional[int] = ..., bytes: _Optional[int] = ..., holder_hits: _Optional[int] = ..., checksum_mismatches: _Optional[int] = ..., present: _Optional[bytes] = ..., message: _Optional[str] = ...) -> None: ...

class ProveRequest(_message.Message):
    __slots__ = ("nonce",)
    NONCE_FIELD_NUMBER: _ClassVar[int]
    nonce: bytes
    def __init__(self, nonce: _Optional[bytes] = ...) -> None: ...

class ProveReply(_message.Message):
    __slots__ = ("proof",)
    PROOF_FIELD_NUMBER: _ClassVar[int]
    proof: bytes
    def __init__(self, proof: _Optional[bytes] = ...) -> None: ...
