from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KvCacheTier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_CACHE_TIER_UNSPECIFIED: _ClassVar[KvCacheTier]
    KV_CACHE_TIER_DEVICE: _ClassVar[KvCacheTier]
    KV_CACHE_TIER_HOST: _ClassVar[KvCacheTier]
    KV_CACHE_TIER_DISK: _ClassVar[KvCacheTier]
    KV_CACHE_TIER_EXTERNAL: _ClassVar[KvCacheTier]

class KvCacheLocality(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_CACHE_LOCALITY_UNSPECIFIED: _ClassVar[KvCacheLocality]
    KV_CACHE_LOCALITY_LOCAL: _ClassVar[KvCacheLocality]
    KV_CACHE_LOCALITY_REMOTE: _ClassVar[KvCacheLocality]
KV_CACHE_TIER_UNSPECIFIED: KvCacheTier
KV_CACHE_TIER_DEVICE: KvCacheTier
KV_CACHE_TIER_HOST: KvCacheTier
KV_CACHE_TIER_DISK: KvCacheTier
KV_CACHE_TIER_EXTERNAL: KvCacheTier
KV_CACHE_LOCALITY_UNSPECIFIED: KvCacheLocality
KV_CACHE_LOCALITY_LOCAL: KvCacheLocality
KV_CACHE_LOCALITY_REMOTE: KvCacheLocality

class SubscribeKvEventsRequest(_message.Message):
    __slots__ = ("start_sequence_number", "load_records_before_first_batch")
    START_SEQUENCE_NUMBER_FIELD_NUMBER: _ClassVar[int]
    LOAD_RECORDS_BEFORE_FIRST_BATCH_FIELD_NUMBER: _ClassVar[int]
    start_sequence_number: int
    load_records_before_first_batch: bool
    def __init__(self, start_sequence_number: _Optional[int] = ..., load_records_before_first_batch: bool = ...) -> None: ...

class KvEventBatch(_message.Message):
    __slots__ = ("sequence_number", "timestamp", "events", "dp_rank", "snapshot", "load")
    SEQUENCE_NUMBER_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    sequence_number: int
    timestamp: float
    events: _containers.RepeatedCompositeFieldContainer[KvCacheEvent]
    dp_rank: int
    snapshot: KvSnapshotChunk
    load: EngineLoad
    def __init__(self, sequence_number: _Optional[int] = ..., timestamp: _Optional[float] = ..., events: _Optional[_Iterable[_Union[KvCacheEvent, _Mapping]]] = ..., dp_rank: _Optional[int] = ..., snapshot: _Optional[_Union[KvSnapshotChunk, _Mapping]] = ..., load: _Optional[_Union[EngineLoad, _Mapping]] = ...) -> None: ...

class EngineLoad(_message.Message):
    __slots__ = ("running_requests", "waiting_requests", "waiting_uncached_tokens", "token_usage", "gen_throughput", "max_running_requests", "age_ms", "sample", "load_only", "active_token_usage", "engine_silence_ms", "engine_reports_steps", "prefill_pending_tokens")
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_UNCACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_USAGE_FIELD_NUMBER: _ClassVar[int]
    GEN_THROUGHPUT_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    AGE_MS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    LOAD_ONLY_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_TOKEN_USAGE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_SILENCE_MS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_REPORTS_STEPS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_PENDING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    running_requests: int
    waiting_requests: int
    waiting_uncached_tokens: int
    token_usage: float
    gen_throughput: float
    max_running_requests: int
    age_ms: int
    sample: int
    load_only: bool
    active_token_usage: float
    engine_silence_ms: int
    engine_reports_steps: bool
    prefill_pending_tokens: int
    def __init__(self, running_requests: _Optional[int] = ..., waiting_requests: _Optional[int] = ..., waiting_uncached_tokens: _Optional[int] = ..., token_usage: _Optional[float] = ..., gen_throughput: _Optional[float] = ..., max_running_requests: _Optional[int] = ..., age_ms: _Optional[int] = ..., sample: _Optional[int] = ..., load_only: bool = ..., active_token_usage: _Optional[float] = ..., engine_silence_ms: _Optional[int] = ..., engine_reports_steps: bool = ..., prefill_pending_tokens: _Optional[int] = ...) -> None: ...

class KvSnapshotChunk(_message.Message):
    __slots__ = ("index", "count", "blocks", "unknown_before")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    UNKNOWN_BEFORE_FIELD_NUMBER: _ClassVar[int]
    index: int
    count: int
    blocks: int
    unknown_before: int
    def __init__(self, index: _Optional[int] = ..., count: _Optional[int] = ..., blocks: _Optional[int] = ..., unknown_before: _Optional[int] = ...) -> None: ...

class KvCacheEvent(_message.Message):
    __slots__ = ("event_id", "stored", "removed", "cleared")
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    event_id: int
    stored: KvBlocksStored
    removed: KvBlocksRemoved
    cleared: KvCacheCleared
    def __init__(self, event_id: _Optional[int] = ..., stored: _Optional[_Union[KvBlocksStored, _Mapping]] = ..., removed: _Optional[_Union[KvBlocksRemoved, _Mapping]] = ..., cleared: _Optional[_Union[KvCacheCleared, _Mapping]] = ...) -> None: ...

class KvBlocksStored(_message.Message):
    __slots__ = ("blocks", "parent_block_hash", "tier", "medium", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window", "locality", "ownership", "session_id", "lora_name", "cache_salt")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PARENT_BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    GROUP_IDX_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_SPEC_KIND_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_SPEC_SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    LOCALITY_FIELD_NUMBER: _ClassVar[int]
    OWNERSHIP_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    blocks: _containers.RepeatedCompositeFieldContainer[KvBlock]
    parent_block_hash: int
    tier: KvCacheTier
    medium: str
    group_idx: int
    kv_cache_spec_kind: str
    kv_cache_spec_sliding_window: int
    locality: KvCacheLocality
    ownership: str
    session_id: str
    lora_name: str
    cache_salt: str
    def __init__(self, blocks: _Optional[_Iterable[_Union[KvBlock, _Mapping]]] = ..., parent_block_hash: _Optional[int] = ..., tier: _Optional[_Union[KvCacheTier, str]] = ..., medium: _Optional[str] = ..., group_idx: _Optional[int] = ..., kv_cache_spec_kind: _Optional[str] = ..., kv_cache_spec_sliding_window: _Optional[int] = ..., locality: _Optional[_Union[KvCacheLocality, str]] = ..., ownership: _Optional[str] = ..., session_id: _Optional[str] = ..., lora_name: _Optional[str] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class KvBlockExtraKey(_message.Message):
    __slots__ = ("text", "blob", "number", "multimodal")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    BLOB_FIELD_NUMBER: _ClassVar[int]
    NUMBER_FIELD_NUMBER: _ClassVar[int]
    MULTIMODAL_FIELD_NUMBER: _ClassVar[int]
    text: str
    blob: bytes
    number: int
    multimodal: KvMultimodalKey
    def __init__(self, text: _Optional[str] = ..., blob: _Optional[bytes] = ..., number: _Optional[int] = ..., multimodal: _Optional[_Union[KvMultimodalKey, _Mapping]] = ...) -> None: ...

class KvMultimodalKey(_message.Message):
    __slots__ = ("identifier", "offset")
    IDENTIFIER_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    identifier: str
    offset: int
    def __init__(self, identifier: _Optional[str] = ..., offset: _Optional[int] = ...) -> None: ...

class KvBlock(_message.Message):
    __slots__ = ("block_hash", "token_ids", "block_size", "lora_id", "cache_level", "extra_keys")
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    LORA_ID_FIELD_NUMBER: _ClassVar[int]
    CACHE_LEVEL_FIELD_NUMBER: _ClassVar[int]
    EXTRA_KEYS_FIELD_NUMBER: _ClassVar[int]
    block_hash: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    lora_id: int
    cache_level: int
    extra_keys: _containers.RepeatedCompositeFieldContainer[KvBlockExtraKey]
    def __init__(self, block_hash: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ..., lora_id: _Optional[int] = ..., cache_level: _Optional[int] = ..., extra_keys: _Optional[_Iterable[_Union[KvBlockExtraKey, _Mapping]]] = ...) -> None: ...

class KvBlocksRemoved(_message.Message):
    __slots__ = ("block_hashes", "cache_level", "tier", "medium", "group_idx", "locality", "ownership")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    CACHE_LEVEL_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    GROUP_IDX_FIELD_NUMBER: _ClassVar[int]
    LOCALITY_FIELD_NUMBER: _ClassVar[int]
    OWNERSHIP_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    cache_level: int
    tier: KvCacheTier
    medium: str
    group_idx: int
    locality: KvCacheLocality
    ownership: str
    def __init__(self, block_hashes: _Optional[_Iterable[int]] = ..., cache_level: _Optional[int] = ..., tier: _Optional[_Union[KvCacheTier, str]] = ..., medium: _Optional[str] = ..., group_idx: _Optional[int] = ..., locality: _Optional[_Union[KvCacheLocality, str]] = ..., ownership: _Optional[str] = ...) -> None: ...

class KvCacheCleared(_message.Message):
    __slots__ = ("ownership",)
    OWNERSHIP_FIELD_NUMBER: _ClassVar[int]
    ownership: str
    def __init__(self, ownership: _Optional[str] = ...) -> None: ...

class RankCountRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RankCountResponse(_message.Message):
    __slots__ = ("dp_rank_count",)
    DP_RANK_COUNT_FIELD_NUMBER: _ClassVar[int]
    dp_rank_count: int
    def __init__(self, dp_rank_count: _Optional[int] = ...) -> None: ...
