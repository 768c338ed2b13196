"""Typed, size-bounded message codecs and the compatibility handshake every side channel starts with.

Runs in: every process that talks to a peer (scheduler, workers, store clients). Every message that
crosses a process boundary is a `msgspec.Struct` encoded with msgpack; there is no pickle, no
``eval`` and no ``torch.load`` of received bytes. A `Codec` decodes strictly into one declared type
(usually a tagged union) and refuses frames over its size bound before looking at them.

Schema evolution rules (for every Struct sent through a `Codec`, `Handshake` included):

1. New fields always get a default, so an older peer's message still decodes.
2. Fields are never renamed or retyped; a field that is no longer used keeps its name and type.
3. Unknown fields are accepted (msgspec's default), so a newer peer may add fields.
4. Structs with ``array_like=True`` (hot paths only) may only gain fields at the end.
5. Any change an older peer cannot read, or a change of meaning, bumps the channel's protocol
   version, which `check_compatible` compares before anything else is exchanged.

A `Handshake` carries the channel name, its protocol version and a hash over the values both
sides must agree on (model, dtype, block size, layout, parallel sizes). It also carries those
values in readable form, so a refused peer is told *which* field differs, not just that a hash did.
"""

from __future__ import annotations

import hashlib
import json
import logging
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, Generic, TypeVar, overload

import msgspec

from ascend_dist.common.errors import ConfigError, IncompatiblePeer, MessageTooLarge, ProtocolError

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "Codec",
    "Refuse",
    "CompatValue",
    "Handshake",
    "check_compatible",
    "compat_fields",
    "compat_hash",
    "make_handshake",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024
"""Default bound on one encoded message (16 MiB); larger frames are refused undecoded."""

# Bytes of a refused frame shown (as hex) in an error message: enough to recognise a wrong
# protocol, too few to leak a payload into logs.
_PREFIX_BYTES = 16

# Domain separator for compat_hash: changing the canonical encoding must change every hash.
_HASH_DOMAIN = b"ascend-dist/compat-hash/v1\n"

Refuse = Callable[[ProtocolError, bytes], bytes | None]
"""A codec's ``refuse`` hook: the encoded answer to a frame it could not decode (None: no answer)."""

# What msgspec (or the C stack under it) raises for hostile input: invalid msgpack, a wrong type
# or range, nesting deeper than the interpreter's recursion limit, absurd integers.
_DECODE_ERRORS = (msgspec.DecodeError, msgspec.ValidationError, RecursionError, ValueError, TypeError, OverflowError)

CompatValue = str | int | float | bool | tuple[Any, ...]
"""Types accepted by `compat_fields`; tuples may nest and hold the same scalar types."""


def _type_name(type_: object) -> str:
    """Readable name of a decode target, such as ``Hello | PullRequest``."""
    if isinstance(type_, types.UnionType) or typing.get_origin(type_) is typing.Union:
        return " | ".join(_type_name(arg) for arg in typing.get_args(type_))
    name = getattr(type_, "__qualname__", None)
    return name if isinstance(name, str) else repr(type_)


def _nbytes(buf: bytes | bytearray | memoryview) -> int:
    """Length in bytes of a buffer (a memoryview's ``len`` counts items, not bytes)."""
    return buf.nbytes if isinstance(buf, memoryview) else len(buf)


class Codec(Generic[T]):
    """A msgpack encoder plus a strict decoder typed by one Struct or one tagged union.

    Both are created once per codec and reused, so a codec should be a module-level singleton of
    the module that defines the messages. A codec is safe to share between threads.

    Example:
        >>> class Ping(msgspec.Struct, frozen=True, kw_only=True, tag="ping"):
        ...     seq: int
        >>> codec = Codec(Ping)
        >>> codec.decode(codec.encode(Ping(seq=3)))
        Ping(seq=3)
    """

    @overload
    def __init__(
        self, type_: type[T], *, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, refuse: Refuse | None = None
    ) -> None: ...
    @overload
    def __init__(
        self, type_: Any, *, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, refuse: Refuse | None = None
    ) -> None: ...

    def __init__(self, type_: Any, *, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, refuse: Refuse | None = None) -> None:
        """Create the encoder and the typed decoder.

        Args:
            type_: The type every decoded message must have: a Struct class or a union of tagged
                Structs (``A | B``).
            max_bytes: Largest encoded message accepted by `decode` and produced by `encode`.
            refuse: Server side: builds the answer to a frame `decode` refuses; it is attached to
                the raised error as ``reply`` (`ascend_dist.common.zmq_server.RpcServer` sends it).

        Raises:
            ConfigError: ``max_bytes`` is not a positive int, or ``type_`` is not a type msgspec
                can decode (for example an untagged union of Structs).
        """
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
            raise ConfigError("max_bytes", max_bytes, "a positive int")
        self._type: Any = type_
        self._type_name = _type_name(type_)
        self._max_bytes = max_bytes
        self._refuse = refuse
        self._encoder = msgspec.msgpack.Encoder()
        try:
            self._decoder: msgspec.msgpack.Decoder[T] = msgspec.msgpack.Decoder(type_)
        except TypeError as exc:
            raise ConfigError(
                "type_", self._type_name, "a msgspec-decodable type (a Struct or a union of tagged Structs)"
            ) from exc

    @property
    def type(self) -> Any:
        """The type (or union) this codec decodes into."""
        return self._type

    @property
    def max_bytes(self) -> int:
        """Largest encoded message this codec accepts."""
        return self._max_bytes

    def encode(self, msg: T) -> bytes:
        """Encode one message to msgpack bytes.

        Args:
            msg: The message; a value of the codec's type.

        Returns:
            The encoded bytes.

        Raises:
            MessageTooLarge: The encoding exceeds ``max_bytes``; the peer would refuse it.
            TypeError: ``msg`` holds a value msgspec cannot encode (a programming error).
        """
        buf = self._encoder.encode(msg)
        if len(buf) > self._max_bytes:
            raise MessageTooLarge(
                f"encoded {self._type_name} message is {len(buf)} bytes, over max_bytes={self._max_bytes}"
            )
        return buf

    def decode(self, buf: bytes | bytearray | memoryview) -> T:
        """Decode one message, checking its size first and its type strictly.

        Args:
            buf: The received frame.

        Returns:
            The decoded message, an instance of the codec's type (for a tagged union, the Struct
            the tag names).

        Raises:
            MessageTooLarge: ``buf`` is larger than ``max_bytes``; it was not decoded.
            ProtocolError: ``buf`` is not valid msgpack, does not match the codec's type, or nests
                deeper than the interpreter allows (every decode failure is this type). With a
                ``refuse`` hook, its answer is the error's ``reply``.
        """
        size = _nbytes(buf)
        error: ProtocolError
        if size > self._max_bytes:
            error = MessageTooLarge(
                f"{self._type_name} frame of {size} bytes exceeds max_bytes={self._max_bytes}; not decoded"
            )
        else:
            try:
                return self._decoder.decode(buf)
            except _DECODE_ERRORS as exc:
                prefix = bytes(memoryview(buf).cast("B")[:_PREFIX_BYTES]).hex()
                error = ProtocolError(
                    f"cannot decode {self._type_name} from {size} bytes (starts 0x{prefix}): "
                    f"{type(exc).__name__}: {exc}"
                )
                error.__cause__ = exc
        if self._refuse is not None:
            try:
                error.reply = self._refuse(error, b"" if size > self._max_bytes else bytes(buf))
            except Exception as exc:  # the hook reads hostile bytes too: no answer beats a crash
                logger.debug("refuse hook of %s raised %s", self._type_name, type(exc).__name__)
        raise error

    def __repr__(self) -> str:
        return f"Codec({self._type_name}, max_bytes={self._max_bytes})"


class Handshake(msgspec.Struct, frozen=True, kw_only=True):
    """First message on every side channel: who speaks which protocol, with which model setup.

    Attributes:
        protocol: The channel, for example ``"kv-mooncake/pull"``.
        protocol_version: Bumped on every change an older peer cannot handle.
        compat_hash: `compat_hash` of ``compat_fields``.
        compat_fields: The canonical values the hash was computed from (see `compat_fields`),
            carried so that a mismatch can name the differing field.
        sender: Free-form identity of the sender (engine id, rank) for log messages.
    """

    protocol: str
    protocol_version: int
    compat_hash: str
    compat_fields: dict[str, str]
    sender: str = ""


def _canonical_item(field: str, value: object) -> object:
    """Validate one (possibly nested) value and turn tuples into lists for JSON."""
    if isinstance(value, tuple):
        return [_canonical_item(field, item) for item in value]
    if isinstance(value, str | int | float | bool):
        return value
    raise ConfigError(field, value, "a str, int, float, bool or a tuple of those")


def _canonical_value(field: str, value: object) -> str:
    """Render one compat value as a string that is equal on every process for equal values."""
    if isinstance(value, str):
        return value
    # bool before int (bool is an int subclass); JSON gives true/false, shortest-repr floats
    # and an unambiguous rendering of nested tuples.
    return json.dumps(_canonical_item(field, value), separators=(",", ":"), ensure_ascii=False)


def compat_fields(**fields: CompatValue) -> dict[str, str]:
    """Canonicalise the values both peers must agree on.

    Strings stay as they are; ints, floats and bools become their JSON text (``True`` ->
    ``"true"``, ``2`` -> ``"2"``, ``0.5`` -> ``"0.5"``); tuples become JSON arrays
    (``(1, 2)`` -> ``"[1,2]"``).

    Args:
        **fields: Name to value, for example ``dtype="bfloat16", block_size=128, tp=8``.

    Returns:
        The canonical strings, keys in sorted order.

    Raises:
        ConfigError: A value (or a tuple item) has another type; the error names the field.
    """
    return {name: _canonical_value(name, fields[name]) for name in sorted(fields)}


def compat_hash(fields: Mapping[str, str]) -> str:
    """Hash canonical compat fields; equal fields give equal hashes in every process.

    Args:
        fields: Canonical values, as returned by `compat_fields` (key order does not matter).

    Returns:
        The hex SHA-256 of a sorted, length-unambiguous JSON encoding of ``fields``.

    Raises:
        ConfigError: A key or a value is not a str.
    """
    for name, value in fields.items():
        if not isinstance(name, str):
            raise ConfigError("compat field name", name, "a str")
        if not isinstance(value, str):
            raise ConfigError(name, value, "a str (canonicalise with compat_fields first)")
    pairs = [[name, fields[name]] for name in sorted(fields)]
    encoded = json.dumps(pairs, separators=(",", ":"), ensure_ascii=True).encode("ascii")
    return hashlib.sha256(_HASH_DOMAIN + encoded).hexdigest()


def make_handshake(protocol: str, version: int, *, sender: str = "", **fields: CompatValue) -> Handshake:
    """Build this side's handshake from the values the peer must share.

    Args:
        protocol: The channel name, for example ``"kv-mooncake/pull"``.
        version: The channel's protocol version.
        sender: Identity shown in the peer's log messages.
        **fields: The compatibility values, as accepted by `compat_fields`.

    Returns:
        A `Handshake` with canonical ``compat_fields`` and their ``compat_hash``.

    Raises:
        ConfigError: ``protocol`` is empty, ``version`` is not a non-negative int, or a field
            value has an unsupported type.
    """
    if not isinstance(protocol, str) or not protocol:
        raise ConfigError("protocol", protocol, "a non-empty str such as 'kv-mooncake/pull'")
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ConfigError("version", version, "a non-negative int")
    canonical = compat_fields(**fields)
    return Handshake(
        protocol=protocol,
        protocol_version=version,
        compat_hash=compat_hash(canonical),
        compat_fields=canonical,
        sender=sender,
    )


def check_compatible(local: Handshake, remote: Handshake) -> None:
    """Refuse a peer whose handshake differs from ours, naming the first difference.

    Fields are compared in this order: ``protocol``, ``protocol_version``, each compat field in
    sorted name order (a field present on one side only differs; the missing side is reported as
    None), then ``compat_hash`` itself (which catches a peer whose hash does not match its own
    fields, or one computed with another canonical encoding).

    Args:
        local: This side's handshake.
        remote: The handshake received from the peer.

    Raises:
        IncompatiblePeer: The handshakes differ; ``field`` names the first differing field
            (a compat field is named by its own name, such as ``"dtype"``).
    """
    if local.protocol != remote.protocol:
        raise IncompatiblePeer("protocol", local.protocol, remote.protocol)
    if local.protocol_version != remote.protocol_version:
        raise IncompatiblePeer("protocol_version", local.protocol_version, remote.protocol_version)
    for name in sorted(local.compat_fields.keys() | remote.compat_fields.keys()):
        mine = local.compat_fields.get(name)
        theirs = remote.compat_fields.get(name)
        if mine != theirs:
            raise IncompatiblePeer(name, mine, theirs)
    if local.compat_hash != remote.compat_hash:
        raise IncompatiblePeer("compat_hash", local.compat_hash, remote.compat_hash)
    logger.debug(
        "peer compatible: protocol=%s version=%d sender=%s",
        remote.protocol,
        remote.protocol_version,
        remote.sender,
    )
