"""The one boundary between a request's client-controlled ``kv_transfer_params`` and the scheduler hooks.

Runs in: vLLM's scheduler process, inside the three adapters' scheduler-side hooks. In ``vllm
serve`` a request's ``kv_transfer_params`` come from any API client's body (the field itself, or
``vllm_xargs``, which can even make them a string or a list), so they are hostile input. Each
connector builds one `ParamsGate` around its scheduler's strict, typed check (``check_params``:
raises `ConfigError` naming ``kv_transfer_params.<key>``) and passes every request through it:

* `ParamsGate.admit`, in the hooks that may change a request (``on_new_request``,
  ``update_state_after_alloc``, ``request_finished``): params failing the check are dropped from
  the request (``request.kv_transfer_params = None``) after ONE warning naming the key and a
  truncated repr of the value. From then on every hook (vLLM's own reads included) sees a plain
  local request: D computes the prompt itself and pulls nothing, P frees its blocks at once and
  returns no params. vLLM calls ``on_new_request`` first, so that is where the warning is logged.
* `ParamsGate.accepts`, in ``get_num_new_matched_tokens`` (vLLM requires it to have no side
  effects): the same check without logging or changing anything; a rejected request gets
  ``(0, False)``.

The check is a pure function of the params and the prompt length, so a request is admitted by
every hook or by none: nothing is half-registered. Unknown keys are ignored (peers and proxies add
their own, e.g. upstream's ``aborted_request``); each new unknown key name is logged once per
connector. The helpers below (`convert_params`, `check_host`, `check_url`, `check_block_ids`) are
the shared pieces of the three checks.
"""

from __future__ import annotations

import ipaddress
import logging
import re
import reprlib
import urllib.parse
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Annotated, Any, Protocol, TypeVar

import msgspec

from ascend_dist.common.errors import ConfigError
from ascend_dist.common.log import OnceRegistry

__all__ = [
    "MAX_ID",
    "MAX_TEXT",
    "Count",
    "ParallelSize",
    "UPSTREAM_KEYS",
    "ParamsGate",
    "Port",
    "Preview",
    "Text",
    "check_block_ids",
    "check_flags",
    "check_host",
    "check_url",
    "convert_params",
]

logger = logging.getLogger(__name__)

MAX_TEXT = 256
"""Longest id or host string accepted in ``kv_transfer_params``."""
MAX_URL = 2048
"""Longest metaserver URL accepted."""
MAX_ID = 2**31 - 1
"""Largest block id, token count or size accepted (a bound, not a real limit of any engine)."""

Text = Annotated[str, msgspec.Meta(max_length=MAX_TEXT)]
"""An id or host in ``kv_transfer_params``."""
Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_ID)]
"""A block id, token count or block size (0 = not given, where the field allows it)."""
ParallelSize = Annotated[int, msgspec.Meta(ge=1, le=4096)]
"""A TP/PCP/DCP size."""
Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
"""A TCP port."""

UPSTREAM_KEYS = frozenset(
    {"aborted_request", "remote_prefill_cached_tokens", "metaserver", "num_computed_tokens", "_p_side_truncated"}
)
"""Keys vLLM (``remote_prefill_cached_tokens``), upstream proxies (``aborted_request``,
``metaserver``) or the schedulers themselves add: known to every gate."""

FLAGS = ("do_remote_prefill", "do_remote_decode", "do_virtual")
"""Keys that must be JSON booleans: vLLM and the schedulers read them by truthiness."""

_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlong = 3, 60, 60, 40
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 8
_PATH_RE = re.compile(r"at `\$\.?([^`\[]*)")
_MISSING_RE = re.compile(r"missing required field `([^`]*)`")
_HOST_RE = re.compile(
    r"(?=.{1,253}\Z)[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,62})(?:\.[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,62}))*\.?\Z"
)

StructT = TypeVar("StructT", bound=msgspec.Struct)


class Preview:
    """A value's repr cut to a few dozen characters and three levels, for errors and logs of hostile input."""

    __slots__ = ("text",)

    def __init__(self, value: object) -> None:
        """Take the truncated repr now (the value may be huge or deeply nested)."""
        self.text = _REPR.repr(value)

    def __repr__(self) -> str:
        """The truncated repr."""
        return self.text


def _bad(key: str, value: object, expected: str) -> ConfigError:
    return ConfigError(f"kv_transfer_params.{key}", Preview(value), expected)


def convert_params(raw: object, struct: type[StructT]) -> StructT:
    """Convert ``raw`` into ``struct`` (msgspec, lenient about ``"5"`` for 5) after the flag check.

    Raises:
        ConfigError: ``raw`` is not a dict with string keys, a `FLAGS` key is not a bool, or a key
            has the wrong type, range or length; names ``kv_transfer_params.<key>``.
    """
    if not isinstance(raw, Mapping):
        raise ConfigError("kv_transfer_params", Preview(raw), "a dict")
    check_flags(raw)
    try:
        return msgspec.convert(dict(raw), struct, strict=False)
    except msgspec.ValidationError as exc:
        text = str(exc)[:300]
        missing = _MISSING_RE.search(text)
        match = missing or _PATH_RE.search(text)
        key = match.group(1) if match else ""
        if not key:  # e.g. "Expected `str` - at `key` in `$`": a key that is not a string
            raise ConfigError("kv_transfer_params", Preview(raw), f"a dict with string keys ({text})") from exc
        detail = text.split(" - at `")[0]  # "Expected `int | null`, got `str`" -> "`int | null`, got `str`"
        expected = "present" if missing else detail.removeprefix("Expected ")
        raise _bad(key, raw.get(key), expected) from exc


def check_flags(raw: Mapping[str, Any]) -> None:
    """Every `FLAGS` key present is ``true``, ``false`` or null (``"false"`` would be truthy downstream).

    Raises:
        ConfigError: Names the flag.
    """
    for key in FLAGS:
        value = raw.get(key)
        if value is not None and not isinstance(value, bool):
            raise _bad(key, value, "true or false")


def check_host(key: str, host: str) -> None:
    """``host`` is an IP address or a DNS name (no ports, schemes, spaces or endpoint syntax).

    Raises:
        ConfigError: Names ``kv_transfer_params.<key>``.
    """
    try:
        ipaddress.ip_address(host.strip("[]"))
        return
    except ValueError:
        pass
    if not _HOST_RE.match(host):
        raise _bad(key, host, "an IP address or host name")


def check_url(key: str, url: object, allowed_hosts: Collection[str] | None = None) -> str:
    """``url`` is an ``http://`` or ``https://`` URL with a host, at most `MAX_URL` characters.

    ``allowed_hosts``: the hosts the operator configured (``metaserver_hosts``); a URL naming any
    other host is refused, so a client cannot make D post its contact and block ids elsewhere.

    Raises:
        ConfigError: Names ``kv_transfer_params.<key>`` (``file:``, ``ftp:`` and the like included).
    """
    if not isinstance(url, str) or len(url) > MAX_URL:
        raise _bad(key, url, f"an http(s) URL of at most {MAX_URL} characters")
    try:
        parts = urllib.parse.urlsplit(url)
        host = parts.hostname
        parts.port  # noqa: B018  (raises ValueError on a bad port)
    except ValueError as exc:
        raise _bad(key, url, f"an http(s) URL ({exc})") from exc
    if parts.scheme not in ("http", "https") or not host:
        raise _bad(key, url, "an http:// or https:// URL with a host")
    check_host(key, host)
    if allowed_hosts is not None and host.lower() not in allowed_hosts:
        raise _bad(key, url, "a URL on a host listed in metaserver_hosts (kv_connector_extra_config)")
    return url


def check_block_ids(key: str, ids: Sequence[Sequence[int]], groups: int, per_group: int) -> None:
    """One list per KV-cache group, each of at most ``per_group`` ids (range is checked by the Struct).

    Raises:
        ConfigError: Names ``kv_transfer_params.<key>``.
    """
    if len(ids) != groups:
        raise _bad(key, ids, f"{groups} lists (one per KV-cache group)")
    for g, group in enumerate(ids):
        if len(group) > per_group:
            raise _bad(f"{key}[{g}]", group, f"at most {per_group} block ids (what the prompt needs)")


class _Carrier(Protocol):
    """What `ParamsGate.admit` reads and clears: vLLM's ``Request`` or this package's request views."""

    request_id: str
    kv_transfer_params: Any


Check = Callable[[str, Mapping[str, Any], int], object]
"""``check(request_id, params, prompt_len)``: raises `ConfigError` for params the scheduler must not see."""


class ParamsGate:
    """Admits a request's ``kv_transfer_params`` into a connector's scheduler, or drops them (see module)."""

    def __init__(self, connector: str, check: Check, known_keys: Collection[str]) -> None:
        """Create the gate.

        Args:
            connector: The connector's name (in the warnings).
            check: The scheduler's strict check.
            known_keys: Keys the connector reads (`UPSTREAM_KEYS` are added); others are logged once.
        """
        self._connector = connector
        self._check = check
        self._known = frozenset(known_keys) | UPSTREAM_KEYS
        self._unknown = OnceRegistry(capacity=64)

    def _error(self, request_id: str, raw: object, prompt_len: int) -> ConfigError | None:
        if raw is None or (isinstance(raw, Mapping) and not raw):
            return None
        if not isinstance(raw, Mapping):
            return ConfigError("kv_transfer_params", Preview(raw), "a dict")
        try:
            self._check(request_id, raw, prompt_len)
        except ConfigError as exc:
            return exc
        return None

    def accepts(self, request_id: str, raw: object, prompt_len: int) -> bool:
        """Whether ``raw`` passes the check (nothing is logged or changed: for side-effect-free hooks)."""
        return self._error(request_id, raw, prompt_len) is None

    def admit(self, request: _Carrier, prompt_len: int) -> bool:
        """Check the request's params; drop them (one warning) when they fail.

        Returns:
            Whether the request keeps its params (True also when it has none).
        """
        raw = request.kv_transfer_params
        error = self._error(request.request_id, raw, prompt_len)
        if error is None:
            if isinstance(raw, Mapping):
                self._log_unknown(raw)
            return True
        self.drop(request, error)
        return False

    def drop(self, request: _Carrier, error: ConfigError) -> None:
        """Drop the request's params after one warning naming ``error``'s key (a check of the adapter's own)."""
        request.kv_transfer_params = None
        logger.warning(
            "%s: request %s: ignoring its kv_transfer_params and computing it locally: %s=%r is invalid: expected %s",
            self._connector,
            request.request_id[:128],  # ids can come from clients too (X-Request-Id)
            error.field,
            error.value if isinstance(error.value, Preview) else Preview(error.value),
            error.expected[:200],
        )

    def _log_unknown(self, raw: Mapping[str, Any]) -> None:
        new = [
            name
            for name in (Preview(k).text for k in raw if k not in self._known)
            if self._unknown.first_time(logger.name, name)
        ]
        if new:
            logger.warning(
                "%s: ignoring unknown kv_transfer_params keys %s (each logged once)",
                self._connector,
                ", ".join(new[:8]),
            )
