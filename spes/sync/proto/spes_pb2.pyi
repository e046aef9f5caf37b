from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DataOp(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DATA_OP_UNSPECIFIED: _ClassVar[DataOp]
    DATA_OP_UPLOAD: _ClassVar[DataOp]
    DATA_OP_DOWNLOAD: _ClassVar[DataOp]
    DATA_OP_PING: _ClassVar[DataOp]
    DATA_OP_PROBE: _ClassVar[DataOp]
DATA_OP_UNSPECIFIED: DataOp
DATA_OP_UPLOAD: DataOp
DATA_OP_DOWNLOAD: DataOp
DATA_OP_PING: DataOp
DATA_OP_PROBE: DataOp

class TensorSpec(_message.Message):
    __slots__ = ("name", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class RunSpec(_message.Message):
    __slots__ = ("mode", "num_peers", "experts_per_block", "block_owners", "sync_steps", "overlap_fragments", "codec", "codec_settings", "last_step")
    class CodecSettingsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    MODE_FIELD_NUMBER: _ClassVar[int]
    NUM_PEERS_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    BLOCK_OWNERS_FIELD_NUMBER: _ClassVar[int]
    SYNC_STEPS_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    CODEC_SETTINGS_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_FIELD_NUMBER: _ClassVar[int]
    mode: str
    num_peers: int
    experts_per_block: int
    block_owners: _containers.RepeatedScalarFieldContainer[int]
    sync_steps: int
    overlap_fragments: int
    codec: str
    codec_settings: _containers.ScalarMap[str, int]
    last_step: int
    def __init__(self, mode: _Optional[str] = ..., num_peers: _Optional[int] = ..., experts_per_block: _Optional[int] = ..., block_owners: _Optional[_Iterable[int]] = ..., sync_steps: _Optional[int] = ..., overlap_fragments: _Optional[int] = ..., codec: _Optional[str] = ..., codec_settings: _Optional[_Mapping[str, int]] = ..., last_step: _Optional[int] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("peer_id", "manifest", "protocol", "dry_run", "spec", "run_id")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    peer_id: int
    manifest: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    protocol: int
    dry_run: bool
    spec: RunSpec
    run_id: str
    def __init__(self, peer_id: _Optional[int] = ..., manifest: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., protocol: _Optional[int] = ..., dry_run: _Optional[bool] = ..., spec: _Optional[_Union[RunSpec, _Mapping]] = ..., run_id: _Optional[str] = ...) -> None: ...

class JoinReply(_message.Message):
    __slots__ = ("current_round", "open_round", "data_port", "manifest_checked", "dry_run", "run_id")
    CURRENT_ROUND_FIELD_NUMBER: _ClassVar[int]
    OPEN_ROUND_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_CHECKED_FIELD_NUMBER: _ClassVar[int]
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    current_round: int
    open_round: int
    data_port: int
    manifest_checked: bool
    dry_run: bool
    run_id: str
    def __init__(self, current_round: _Optional[int] = ..., open_round: _Optional[int] = ..., data_port: _Optional[int] = ..., manifest_checked: _Optional[bool] = ..., dry_run: _Optional[bool] = ..., run_id: _Optional[str] = ...) -> None: ...

class UploadMeta(_message.Message):
    __slots__ = ("peer_id", "round", "fragment", "digest")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    peer_id: int
    round: int
    fragment: int
    digest: int
    def __init__(self, peer_id: _Optional[int] = ..., round: _Optional[int] = ..., fragment: _Optional[int] = ..., digest: _Optional[int] = ...) -> None: ...

class TensorHeader(_message.Message):
    __slots__ = ("name", "dtype", "shape", "num_bytes", "checksum", "base_round", "codec", "params")
    class ParamsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    BASE_ROUND_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    num_bytes: int
    checksum: int
    base_round: int
    codec: str
    params: _containers.ScalarMap[str, int]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., num_bytes: _Optional[int] = ..., checksum: _Optional[int] = ..., base_round: _Optional[int] = ..., codec: _Optional[str] = ..., params: _Optional[_Mapping[str, int]] = ...) -> None: ...

class TensorChunk(_message.Message):
    __slots__ = ("header", "offset", "data", "checksum")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    header: TensorHeader
    offset: int
    data: bytes
    checksum: int
    def __init__(self, header: _Optional[_Union[TensorHeader, _Mapping]] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., checksum: _Optional[int] = ...) -> None: ...

class UploadMessage(_message.Message):
    __slots__ = ("meta", "chunk")
    META_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    meta: UploadMeta
    chunk: TensorChunk
    def __init__(self, meta: _Optional[_Union[UploadMeta, _Mapping]] = ..., chunk: _Optional[_Union[TensorChunk, _Mapping]] = ...) -> None: ...

class UploadReply(_message.Message):
    __slots__ = ("round", "duplicate", "uploaded_peers")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    UPLOADED_PEERS_FIELD_NUMBER: _ClassVar[int]
    round: int
    duplicate: bool
    uploaded_peers: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, round: _Optional[int] = ..., duplicate: _Optional[bool] = ..., uploaded_peers: _Optional[_Iterable[int]] = ...) -> None: ...

class DownloadRequest(_message.Message):
    __slots__ = ("peer_id", "round", "full", "base_round")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    FULL_FIELD_NUMBER: _ClassVar[int]
    BASE_ROUND_FIELD_NUMBER: _ClassVar[int]
    peer_id: int
    round: int
    full: bool
    base_round: int
    def __init__(self, peer_id: _Optional[int] = ..., round: _Optional[int] = ..., full: _Optional[bool] = ..., base_round: _Optional[int] = ...) -> None: ...

class RoundInfo(_message.Message):
    __slots__ = ("round", "merged", "alpha", "names", "peers", "base_round")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    MERGED_FIELD_NUMBER: _ClassVar[int]
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    NAMES_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    BASE_ROUND_FIELD_NUMBER: _ClassVar[int]
    round: int
    merged: bool
    alpha: float
    names: _containers.RepeatedScalarFieldContainer[str]
    peers: _containers.RepeatedScalarFieldContainer[int]
    base_round: int
    def __init__(self, round: _Optional[int] = ..., merged: _Optional[bool] = ..., alpha: _Optional[float] = ..., names: _Optional[_Iterable[str]] = ..., peers: _Optional[_Iterable[int]] = ..., base_round: _Optional[int] = ...) -> None: ...

class DownloadMessage(_message.Message):
    __slots__ = ("info", "chunk")
    INFO_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    info: RoundInfo
    chunk: TensorChunk
    def __init__(self, info: _Optional[_Union[RoundInfo, _Mapping]] = ..., chunk: _Optional[_Union[TensorChunk, _Mapping]] = ...) -> None: ...

class ProbeMessage(_message.Message):
    __slots__ = ("data", "reply_bytes")
    DATA_FIELD_NUMBER: _ClassVar[int]
    REPLY_BYTES_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    reply_bytes: int
    def __init__(self, data: _Optional[bytes] = ..., reply_bytes: _Optional[int] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("current_round", "open_round", "num_peers", "peers_joined", "peers_uploaded", "bytes_in", "bytes_out", "mode", "round_peers", "missing_peers", "open_round_age_s", "dead_peer_policy", "rounds_completed", "persistent", "run_id", "presence", "shutting_down")
    CURRENT_ROUND_FIELD_NUMBER: _ClassVar[int]
    OPEN_ROUND_FIELD_NUMBER: _ClassVar[int]
    NUM_PEERS_FIELD_NUMBER: _ClassVar[int]
    PEERS_JOINED_FIELD_NUMBER: _ClassVar[int]
    PEERS_UPLOADED_FIELD_NUMBER: _ClassVar[int]
    BYTES_IN_FIELD_NUMBER: _ClassVar[int]
    BYTES_OUT_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    ROUND_PEERS_FIELD_NUMBER: _ClassVar[int]
    MISSING_PEERS_FIELD_NUMBER: _ClassVar[int]
    OPEN_ROUND_AGE_S_FIELD_NUMBER: _ClassVar[int]
    DEAD_PEER_POLICY_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_COMPLETED_FIELD_NUMBER: _ClassVar[int]
    PERSISTENT_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_FIELD_NUMBER: _ClassVar[int]
    SHUTTING_DOWN_FIELD_NUMBER: _ClassVar[int]
    current_round: int
    open_round: int
    num_peers: int
    peers_joined: _containers.RepeatedScalarFieldContainer[int]
    peers_uploaded: _containers.RepeatedScalarFieldContainer[int]
    bytes_in: int
    bytes_out: int
    mode: str
    round_peers: _containers.RepeatedScalarFieldContainer[int]
    missing_peers: _containers.RepeatedScalarFieldContainer[int]
    open_round_age_s: float
    dead_peer_policy: str
    rounds_completed: int
    persistent: bool
    run_id: str
    presence: _containers.RepeatedCompositeFieldContainer[PeerPresence]
    shutting_down: bool
    def __init__(self, current_round: _Optional[int] = ..., open_round: _Optional[int] = ..., num_peers: _Optional[int] = ..., peers_joined: _Optional[_Iterable[int]] = ..., peers_uploaded: _Optional[_Iterable[int]] = ..., bytes_in: _Optional[int] = ..., bytes_out: _Optional[int] = ..., mode: _Optional[str] = ..., round_peers: _Optional[_Iterable[int]] = ..., missing_peers: _Optional[_Iterable[int]] = ..., open_round_age_s: _Optional[float] = ..., dead_peer_policy: _Optional[str] = ..., rounds_completed: _Optional[int] = ..., persistent: _Optional[bool] = ..., run_id: _Optional[str] = ..., presence: _Optional[_Iterable[_Union[PeerPresence, _Mapping]]] = ..., shutting_down: _Optional[bool] = ...) -> None: ...

class PeerPresence(_message.Message):
    __slots__ = ("peer", "last_seen_s", "connected")
    PEER_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_S_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    peer: int
    last_seen_s: float
    connected: bool
    def __init__(self, peer: _Optional[int] = ..., last_seen_s: _Optional[float] = ..., connected: _Optional[bool] = ...) -> None: ...

class DataHello(_message.Message):
    __slots__ = ("op", "peer_id", "step", "full", "token", "timeout_s", "session", "up_bytes", "down_bytes", "base_round", "fragment", "digest")
    OP_FIELD_NUMBER: _ClassVar[int]
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    FULL_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    UP_BYTES_FIELD_NUMBER: _ClassVar[int]
    DOWN_BYTES_FIELD_NUMBER: _ClassVar[int]
    BASE_ROUND_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    op: DataOp
    peer_id: int
    step: int
    full: bool
    token: str
    timeout_s: float
    session: str
    up_bytes: int
    down_bytes: int
    base_round: int
    fragment: int
    digest: int
    def __init__(self, op: _Optional[_Union[DataOp, str]] = ..., peer_id: _Optional[int] = ..., step: _Optional[int] = ..., full: _Optional[bool] = ..., token: _Optional[str] = ..., timeout_s: _Optional[float] = ..., session: _Optional[str] = ..., up_bytes: _Optional[int] = ..., down_bytes: _Optional[int] = ..., base_round: _Optional[int] = ..., fragment: _Optional[int] = ..., digest: _Optional[int] = ...) -> None: ...

class DataError(_message.Message):
    __slots__ = ("code", "reason", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: str
    reason: str
    message: str
    def __init__(self, code: _Optional[str] = ..., reason: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class DataReply(_message.Message):
    __slots__ = ("send", "ok", "uploaded", "round", "error")
    SEND_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    UPLOADED_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    send: bool
    ok: bool
    uploaded: UploadReply
    round: RoundInfo
    error: DataError
    def __init__(self, send: _Optional[bool] = ..., ok: _Optional[bool] = ..., uploaded: _Optional[_Union[UploadReply, _Mapping]] = ..., round: _Optional[_Union[RoundInfo, _Mapping]] = ..., error: _Optional[_Union[DataError, _Mapping]] = ...) -> None: ...
