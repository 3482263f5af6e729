from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ProposeRequest(_message.Message):
    __slots__ = ("request_id", "num_cached", "new_token_ids", "max_tokens", "min_confidence", "expected_ids", "max_branches", "verifier_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_BRANCHES_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    num_cached: int
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_tokens: int
    min_confidence: float
    expected_ids: _containers.RepeatedScalarFieldContainer[int]
    max_branches: int
    verifier_id: str
    def __init__(self, request_id: _Optional[str] = ..., num_cached: _Optional[int] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., max_tokens: _Optional[int] = ..., min_confidence: _Optional[float] = ..., expected_ids: _Optional[_Iterable[int]] = ..., max_branches: _Optional[int] = ..., verifier_id: _Optional[str] = ...) -> None: ...

class Branch(_message.Message):
    __slots__ = ("prefix_len", "token_ids", "confidences")
    PREFIX_LEN_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCES_FIELD_NUMBER: _ClassVar[int]
    prefix_len: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    confidences: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, prefix_len: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., confidences: _Optional[_Iterable[float]] = ...) -> None: ...

class ProposeResponse(_message.Message):
    __slots__ = ("token_ids", "confidences", "draft_s", "drafter", "prefix_len", "branches")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_S_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    PREFIX_LEN_FIELD_NUMBER: _ClassVar[int]
    BRANCHES_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    confidences: _containers.RepeatedScalarFieldContainer[float]
    draft_s: float
    drafter: str
    prefix_len: int
    branches: _containers.RepeatedCompositeFieldContainer[Branch]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., confidences: _Optional[_Iterable[float]] = ..., draft_s: _Optional[float] = ..., drafter: _Optional[str] = ..., prefix_len: _Optional[int] = ..., branches: _Optional[_Iterable[_Union[Branch, _Mapping]]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_id", "verifier_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    verifier_id: str
    def __init__(self, request_id: _Optional[str] = ..., verifier_id: _Optional[str] = ...) -> None: ...

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
    def __init__(self, model: _Optional[str] = ..., tokenizer_family: _Optional[str] = ..., vocab_size: _Optional[int] = ..., pool: _Optional[str] = ...) -> None: ...
