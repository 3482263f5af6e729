from collections.abc import Iterable as _Iterable
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar

from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from google.protobuf.internal import containers as _containers

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    def __init__(self, temperature: float | None = ..., top_p: float | None = ..., top_k: int | None = ...) -> None: ...

class Compression(_message.Message):
    __slots__ = ("top_k", "bits")
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    BITS_FIELD_NUMBER: _ClassVar[int]
    top_k: int
    bits: int
    def __init__(self, top_k: int | None = ..., bits: int | None = ...) -> None: ...

class ProposeRequest(_message.Message):
    __slots__ = ("request_id", "num_cached", "new_token_ids", "max_tokens", "min_confidence", "sampling", "seed", "compression")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    num_cached: int
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_tokens: int
    min_confidence: float
    sampling: SamplingParams
    seed: int
    compression: Compression
    def __init__(self, request_id: str | None = ..., num_cached: int | None = ..., new_token_ids: _Iterable[int] | None = ..., max_tokens: int | None = ..., min_confidence: float | None = ..., sampling: SamplingParams | _Mapping | None = ..., seed: int | None = ..., compression: Compression | _Mapping | None = ...) -> None: ...

class DraftDistribution(_message.Message):
    __slots__ = ("token_ids", "codes")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CODES_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    codes: bytes
    def __init__(self, token_ids: _Iterable[int] | None = ..., codes: bytes | None = ...) -> None: ...

class ProposeResponse(_message.Message):
    __slots__ = ("token_ids", "confidences", "dists", "bits", "draft_s", "drafter")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCES_FIELD_NUMBER: _ClassVar[int]
    DISTS_FIELD_NUMBER: _ClassVar[int]
    BITS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_S_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    confidences: _containers.RepeatedScalarFieldContainer[float]
    dists: _containers.RepeatedCompositeFieldContainer[DraftDistribution]
    bits: int
    draft_s: float
    drafter: str
    def __init__(self, token_ids: _Iterable[int] | None = ..., confidences: _Iterable[float] | None = ..., dists: _Iterable[DraftDistribution | _Mapping] | None = ..., bits: int | None = ..., draft_s: float | None = ..., drafter: str | None = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: str | None = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("model", "tokenizer_family", "vocab_size", "pool")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FAMILY_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    model: str
    tokenizer_family: str
    vocab_size: int
    pool: str
    def __init__(self, model: str | None = ..., tokenizer_family: str | None = ..., vocab_size: int | None = ..., pool: str | None = ...) -> None: ...
