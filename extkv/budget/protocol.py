"""The messages of the shared KV budget, where they are spoken, and their checks.

Theory of operation
-------------------
An engine (extkv.budget.client) and the daemon of its device
(extkv.budget.daemon) exchange JSON objects framed as extkv.wire frames
every message: an 8-byte length, then the JSON. Each has `"op"`; a request
has an `"id"` (an int the client counts up) that its reply echoes.

Engine to daemon (`TO_DAEMON`), one reply each:

- `hello{protocol, floor, cap, weight, held}`: join as an engine; its
  connection is its lease from then on. `held` is the bytes the engine
  holds already: 0 on its first connection, what its caches hold when it
  rejoins a daemon that restarted (extkv.budget.client). The first message
  of a connection is `hello` or `status` (an observer that holds no lease,
  as `extkv budget status`).
- `reserve{bytes, ahead}`, before a physical create: `granted{ticket,
  bytes}` or `denied{reason}`, at once or once the reclaims it waits for
  are answered. `ahead`: bytes asked beside `bytes` for creates to come,
  granted only from room free now; the reply's `bytes` is the ticket's
  whole grant, `bytes` asked and what of `ahead` was granted.
- `confirm{ticket, created}`, `cancel{ticket}`, `returned{bytes}`: `ok`.
- `released{bytes, reclaim}`, `cannot{reclaim}`: the answer to a reclaim.
- `status{}`: `report{device, budget, granted, dead, engines}`.

Daemon to engine (`FROM_DAEMON`): the replies above, `error{reason,
dropped}` for a request refused (`dropped`: the daemon closed the
connection, as it does for malformed input), and the push
`reclaim{reclaim, bytes, deadline_s}` (no id: the engine answers it with
`released` or `cannot` naming `reclaim`).

`validate_message` checks every field's type and range and that no field is
unknown, and raises BudgetProtocolError naming the op, the field and the
value: the daemon validates all it reads before any of it is used, the
client all it is sent.

Where: one daemon per device listens on `socket_path(run_dir, key)`, its
device key ("host", or a GPU's UUID) with `.sock`, in a run directory that
only its uid can reach (`default_run_dir`: $EXTKV_RUN_DIR, else
$XDG_RUNTIME_DIR/extkv, else extkv-UID in the temporary directory).
"""

from __future__ import annotations

import math
import numbers
import os
import tempfile
from typing import Callable

from ..errors import BudgetProtocolError

#: Names the protocol in `hello`; the daemon refuses any other, naming it
#: before any field of the hello.
PROTOCOL = "extkv-budget/3"
#: The most the daemon reads of one engine's message: the largest request
#: (`hello`) is under 200 bytes of JSON.
MAX_REQUEST_BYTES = 4096
#: The most a client reads of one daemon message: a status report is about
#: 300 bytes per engine, so room for thousands.
MAX_REPLY_BYTES = 4 << 20
#: The most bytes any field may count: far past any device, and exact in a
#: JSON number that other languages read as a double.
MAX_BYTES = 1 << 53
#: The longest a `reason` may be.
MAX_REASON_CHARS = 2000
#: Directions of `validate_message`.
TO_DAEMON = "to daemon"
FROM_DAEMON = "from daemon"
#: The environment variable naming the run directory.
RUN_DIR_VARIABLE = "EXTKV_RUN_DIR"


def _count(value: object) -> bool:
    return type(value) is int and 0 <= value <= MAX_BYTES


def _positive_count(value: object) -> bool:
    return _count(value) and value > 0


def _optional_count(value: object) -> bool:
    return value is None or _positive_count(value)


def _weight(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, numbers.Real) and 0 < value < math.inf


def _seconds(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, numbers.Real) and 0 <= value < math.inf


def _text(value: object) -> bool:
    return isinstance(value, str) and len(value) <= MAX_REASON_CHARS


def _optional_text(value: object) -> bool:
    return value is None or _text(value)


def _flag(value: object) -> bool:
    return isinstance(value, bool)


def _engines(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(engine, dict) for engine in value)


#: A field's check, and what it expects in words.
_FIELD_KINDS: dict[Callable[[object], bool], str] = {
    _count: f"an int from 0 to {MAX_BYTES}",
    _positive_count: f"an int from 1 to {MAX_BYTES}",
    _optional_count: f"null or an int from 1 to {MAX_BYTES}",
    _weight: "a finite number > 0",
    _seconds: "a finite number of seconds >= 0",
    _text: f"a string of at most {MAX_REASON_CHARS} characters",
    _optional_text: f"null or a string of at most {MAX_REASON_CHARS} characters",
    _flag: "true or false",
    _engines: "a list of objects",
}

#: Every op each way, and its fields beside `op` (and `id`, which every
#: request carries, and every reply but a connection's refusal).
MESSAGES: dict[str, dict[str, dict[str, Callable[[object], bool]]]] = {
    TO_DAEMON: {
        "hello": {"protocol": _text, "floor": _count, "cap": _optional_count, "weight": _weight, "held": _count},
        "reserve": {"bytes": _positive_count, "ahead": _count},
        "confirm": {"ticket": _positive_count, "created": _count},
        "cancel": {"ticket": _positive_count},
        "returned": {"bytes": _count},
        "released": {"bytes": _count, "reclaim": _positive_count},
        "cannot": {"reclaim": _positive_count},
        "status": {},
    },
    FROM_DAEMON: {
        "ok": {},
        "granted": {"ticket": _positive_count, "bytes": _positive_count},
        "denied": {"reason": _text},
        "error": {"reason": _text, "dropped": _flag},
        "report": {"device": _text, "budget": _count, "granted": _count, "dead": _count, "engines": _engines,
                   "asker": _optional_text},
        "reclaim": {"reclaim": _positive_count, "bytes": _positive_count, "deadline_s": _seconds},
    },
}
#: Daemon messages that are pushed, not replies: they carry no id.
PUSHES = frozenset({"reclaim"})
#: Fields of each engine in a `report`, with their checks.
REPORT_ENGINE_FIELDS: dict[str, Callable[[object], bool]] = {
    "engine": _text, "pid": _count, "lease": _text, "grant": _count, "held": _count, "dead": _count,
    "outside": lambda value: value is None or _count(value), "floor": _count, "cap": _count, "weight": _weight,
    "open_tickets": _count, "reclaim_pending_bytes": _count, "reclaims_ignored": _count,
}


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 100 else f"{text[:100]}... ({len(text)} characters)"


def validate_message(message: object, direction: str) -> dict:
    """`message` if it is a well-formed message going `direction`
    (TO_DAEMON or FROM_DAEMON); BudgetProtocolError naming the op, the
    field and the value otherwise."""
    if direction not in MESSAGES:
        raise ValueError(f"direction must be one of {sorted(MESSAGES)}, got {direction!r}")
    if not isinstance(message, dict):
        raise BudgetProtocolError(f"a budget message must be a JSON object, got {_shown(message)}")
    op = message.get("op")
    # Another version's hello is named as such first: its fields may differ too.
    if direction == TO_DAEMON and op == "hello" and message.get("protocol") != PROTOCOL:
        raise BudgetProtocolError(f"hello: field 'protocol' must be {PROTOCOL!r}, got {_shown(message.get('protocol'))}")
    fields = MESSAGES[direction].get(op) if isinstance(op, str) else None
    if fields is None:
        raise BudgetProtocolError(f"op must be one of {sorted(MESSAGES[direction])} ({direction}), got {_shown(op)}")
    expected = {"op", *fields} | ({"id"} if op not in PUSHES else set())
    unknown = sorted(set(message) - expected)
    if unknown:
        raise BudgetProtocolError(f"{op}: unknown field(s) {_shown(unknown)}; {op} takes {sorted(expected)}")
    if op not in PUSHES:
        request_id = message.get("id")
        # A refusal of a whole connection (a uid not allowed, input that
        # could not be read) answers no request: its id is null.
        if not (_count(request_id) or (op == "error" and request_id is None)):
            raise BudgetProtocolError(f"{op}: field 'id' must be an int from 0 to {MAX_BYTES}, got {_shown(request_id)}")
    for name, check in fields.items():
        if name not in message:
            raise BudgetProtocolError(f"{op}: field {name!r} is missing")
        if not check(message[name]):
            raise BudgetProtocolError(f"{op}: field {name!r} must be {_FIELD_KINDS[check]}, got {_shown(message[name])}")
    if op == "report":
        for index, engine in enumerate(message["engines"]):
            for name, check in REPORT_ENGINE_FIELDS.items():
                if name not in engine or not check(engine[name]):
                    raise BudgetProtocolError(f"report: engines[{index}] field {name!r} is missing or malformed, "
                                              f"got {_shown(engine.get(name))}")
    return message


def default_run_dir() -> str:
    """Where the daemons of this uid listen: $EXTKV_RUN_DIR, else
    $XDG_RUNTIME_DIR/extkv (a directory of the user's own, which the
    system empties at logout), else extkv-UID in the temporary directory."""
    if os.environ.get(RUN_DIR_VARIABLE):
        return os.environ[RUN_DIR_VARIABLE]
    if os.environ.get("XDG_RUNTIME_DIR"):
        return os.path.join(os.environ["XDG_RUNTIME_DIR"], "extkv")
    return os.path.join(tempfile.gettempdir(), f"extkv-{os.geteuid()}")


def socket_path(run_dir: str, device_key: str) -> str:
    """The socket of the daemon of the device `device_key` ("host", or a
    GPU's UUID) in `run_dir`."""
    if not device_key or "/" in device_key or device_key in (".", ".."):
        raise ValueError(f"device_key must name a file (no '/'), got {device_key!r}")
    return os.path.join(run_dir, f"{device_key}.sock")
