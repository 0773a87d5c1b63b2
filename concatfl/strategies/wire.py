"""The bytes Flower 1.42 ships for a Message, counted from its structure without serializing it.

Flower ships a message as a tree of content-addressed objects (Message → RecordDict → records →
Arrays → ArrayChunks). Each object goes over the wire as its `deflate()`:

    "<type> <child object ids, comma-separated> <body length>" b"\\0" <body>

where every child id is a 64-character hex SHA-256 and identical objects (same bytes, so same
id) are shipped once. Deflating the whole tree hashes and copies every array byte; here the
array payloads are only measured and compared, and only the small bodies (a ConfigRecord's or
MetricRecord's protobuf, the Message's metadata, the JSON of an Array's or a record's
references) are built. The result equals ``sum(len(o.deflate()) for o in
get_all_nested_objects(message).values())``, which tests/test_common.py checks.
"""

from __future__ import annotations

import json
from collections.abc import Hashable

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.app.message import array as flower_array
from flwr.app.message.arraychunk import ArrayChunk
from flwr.common.serde_utils import error_to_proto, metadata_to_proto
from flwr.proto.message_pb2 import Message as ProtoMessage  # pylint: disable=no-name-in-module
from flwr.supercore.constant import HEAD_BODY_DIVIDER

OBJECT_ID_LENGTH = 64  # a hex SHA-256: how a header names each child
_ANY_ID = "0" * OBJECT_ID_LENGTH  # stands for a child id in a JSON body (hex needs no escaping)


def object_size(type_name: str, num_children: int, body_length: int) -> int:
    """Length of one deflated object: its header, the divider and its body."""
    children = num_children * OBJECT_ID_LENGTH + max(num_children - 1, 0)
    return len(type_name) + 1 + children + 1 + len(str(body_length)) + len(HEAD_BODY_DIVIDER) + body_length


def _same_bytes(first: memoryview, second: memoryview) -> bool:
    """Whether two chunks hold the same bytes (a memcmp where both are whole `bytes` objects)."""
    if first.nbytes != second.nbytes:
        return False
    if all(isinstance(view.obj, bytes) and len(view.obj) == view.nbytes for view in (first, second)):
        return first.obj == second.obj
    return bool(np.array_equal(np.frombuffer(first, np.uint8), np.frombuffer(second, np.uint8)))


class _Tree:
    """The distinct objects of one message, each counted once (Flower's content addressing).

    Every object gets a token; equal tokens mean equal deflated bytes, so equal object ids.
    """

    def __init__(self) -> None:
        self.total = 0
        self._tokens: dict[Hashable, int] = {}
        self._chunks: dict[int, list[tuple[memoryview, int]]] = {}  # by length: (data, token)

    def add(self, key: Hashable, size: int) -> int:
        """The token of the object described by `key`; its `size` is counted the first time."""
        token = self._tokens.get(key)
        if token is None:
            token = self._tokens[key] = len(self._tokens)
            self.total += size
        return token

    def chunk(self, data: memoryview) -> int:
        """An ArrayChunk: the same bytes anywhere in the message are one object."""
        candidates = self._chunks.setdefault(data.nbytes, [])
        for seen, token in candidates:
            if _same_bytes(seen, data):
                return token
        size = object_size(ArrayChunk.__qualname__, 0, data.nbytes)
        token = self.add((ArrayChunk.__qualname__, data.nbytes, len(candidates)), size)
        candidates.append((data, token))
        return token

    def array(self, array: Array) -> int:
        """An Array: its chunks, then its JSON metadata naming them by position."""
        data = memoryview(array.data).cast("B")
        step = flower_array.FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE
        chunks = [self.chunk(data[start : start + step]) for start in range(0, data.nbytes, step)]
        unique = list(dict.fromkeys(chunks))
        metadata = {
            "dtype": array.dtype,
            "shape": array.shape,
            "stype": array.stype,
            "arraychunk_ids": [unique.index(chunk) for chunk in chunks],
        }
        body = len(json.dumps(metadata).encode("utf-8"))
        key = (Array.__qualname__, array.dtype, tuple(array.shape), array.stype, tuple(chunks))
        return self.add(key, object_size(Array.__qualname__, len(unique), body))

    def references(self, type_name: str, children: dict[str, int]) -> int:
        """An ArrayRecord or RecordDict: a JSON body mapping each name to its child's id."""
        body = len(json.dumps(dict.fromkeys(children, _ANY_ID)).encode("utf-8"))
        unique = len(set(children.values()))
        return self.add((type_name, tuple(children.items())), object_size(type_name, unique, body))

    def record(self, record: ArrayRecord | ConfigRecord | MetricRecord) -> int:
        """A record of a RecordDict; Config and Metric records have no children and are small,
        so they are deflated as they are."""
        if isinstance(record, ArrayRecord):
            arrays = {name: self.array(array) for name, array in record.items()}
            return self.references(ArrayRecord.__qualname__, arrays)
        deflated = record.deflate()
        return self.add(deflated, len(deflated))


def message_bytes(message: Message) -> int:
    """Bytes of the distinct objects Flower ships for `message` (its pushed or pulled size)."""
    tree = _Tree()
    children = 0
    if message.has_content():
        content: RecordDict = message.content
        tree.references(RecordDict.__qualname__, {name: tree.record(record) for name, record in content.items()})
        children = 1
    # Message.deflate()'s body: the metadata without message id, and the error if any.
    metadata = metadata_to_proto(message.metadata)
    metadata.message_id = ""
    body = ProtoMessage(
        metadata=metadata, content=None, error=error_to_proto(message.error) if message.has_error() else None
    ).SerializeToString(deterministic=True)
    return tree.total + object_size(Message.__qualname__, children, len(body))
