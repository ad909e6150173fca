from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class GetServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetServerInfoResponse(_message.Message):
    __slots__ = ("json_info",)
    JSON_INFO_FIELD_NUMBER: _ClassVar[int]
    json_info: str
    def __init__(self, json_info: _Optional[str] = ...) -> None: ...
