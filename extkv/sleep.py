"""SleepController: the sleep and wake words engines use, over extkv caches.

Theory of operation
-------------------
Engines put their GPU memory to sleep in one of two vocabularies. vLLM's
`LLM.sleep(level=1|2)` / `wake_up(tags=[...])` works on tagged allocations
of its `CuMemAllocator` (tags "weights" and "kv_cache"); torch_memory_saver's
`pause(tag)` / `resume(tag)` works on what was allocated inside
`region(tag=...)`. Both keep virtual addresses and drop physical memory,
which is what `ExtensibleKVCache.release_physical()` / `recommit()` do. A
`SleepController` speaks both vocabularies over any set of extkv objects,
each registered under a tag (`register(target, tag="kv_cache",
offload=False)`): an `ExtensibleKVCache`, or a plain `ExtensibleTensor`
(weights or any other buffer kept in an extkv reservation).

The mapping, word by word:

- vLLM `sleep(level=1)`: vLLM copies the "weights" tag to pinned CPU memory,
  then unmaps and releases every allocation; the KV cache's contents are
  forgotten. Here: every tag's memory is released; registrations made with
  `offload=True` are first copied to host memory and come back byte for
  byte on wake, the others (a KV cache, by default) wake zeroed. vLLM picks
  the kept tag by its name, "weights"; extkv cannot know what a tag holds,
  so a registration says it itself: register weights with `offload=True`.
- vLLM `sleep(level=2)`: everything is discarded, "weights" too. Here: every
  tag is released with no copy, `offload=True` or not, and wakes zeroed.
- vLLM `sleep(level=0)` (pause the scheduler only) is the engine's, not
  memory's, and is refused here, as is any level but 1 and 2 (vLLM takes 3
  as 2 without a word).
- vLLM `wake_up(tags=None)`: remaps every sleeping tag, copies kept contents
  back. `wake_up(tags=["kv_cache"])` wakes only the tags named, so weights
  can be reloaded before the KV cache takes its memory back; `is_sleeping`
  stays true until every tag is awake. Same here. vLLM's woken, discarded
  memory is fresh driver memory with no promise on what it reads; here it
  reads zero (invariant 4).
- vLLM `sleep(tags=[...])` (discard the named tags) is `pause(tag)` here,
  one tag at a time, which keeps `offload=True` contents.
- torch_memory_saver `region(tag=..., enable_cpu_backup=...)`: the tag and
  its CPU backup are decided when the memory is made. Here:
  `register(target, tag=..., offload=...)`.
- torch_memory_saver `pause(tag=None)` / `resume(tag=None)`: release and
  remap one tag, or every tag when None, backing up and restoring contents
  where `enable_cpu_backup` says so. Same here, with `offload`.

Where the two disagree, each word keeps its own engine's meaning, so code
moved from either engine behaves as it did. vLLM makes sleeping a sleeping
tag and waking an awake one a no-op (with a warning: "already sleeping",
"not sleeping"); torch_memory_saver refuses to pause a paused allocation or
resume an active one (it exits the process). Here `sleep` / `wake_up` skip
such tags, and `pause` / `resume` raise `StateError`, changing nothing. A
tag nobody registered is a `ValueError` for every word (torch_memory_saver
silently matches nothing; vLLM warns and does nothing): a misspelt tag left
asleep is a bug found late. `_TRANSITIONS` is that table, the one place
that decides what each word does in each state.

What level 1 needs that extkv does not keep, and what is provided: vLLM's
level 1 keeps a CPU copy; extkv's release drops the pages and keeps no
copy, so a recommit is fresh zeroed memory. `offload=True` provides the
copy: at `sleep(level=1)` and at `pause`, before anything is released,
every committed byte of each segment of the registration is copied to host
memory (page-locked where the bytes live on a device, so the copies run at
transfer speed); at wake the pages are recommitted, zeroed as always, and
the copy is written back, then dropped. Its cost is host memory equal to
the committed bytes while asleep, one copy each way, and the zeroing the
copy then overwrites. Mapped bytes past the committed ones (a granule's
tail, and the blocks a KV cache's commit-ahead worker mapped past its
committed blocks) are not contents: the copy leaves them out, and they wake
zeroed, or unmapped until the worker maps them again.

States, per tag: awake, asleep (every registration's memory released), or
partly asleep: an operation failed part way (a driver error releasing the
third of five caches, a recommit out of memory), or a sleeping cache's own
operation mapped memory again (`WHILE_ASLEEP`). Each registration records
whether it sleeps; what already moved stays moved, and calling the same
word again completes it, so does the opposite word: a partly asleep tag
goes either way. A copy is taken for
every registration before the first release, so host memory running out
changes nothing.

Checks before change: every argument (a level, a tag, a tag list, an
object) is checked, and every registration the call moves must be live (a
freed, broken or fork-inherited cache refuses everything), before the
first copy or release; a refused call leaves every tag and object as it
was.

What a caller does to a sleeping KV cache. Its operations stay legal while
its tag sleeps (extkv.cache says what each does asleep), and engines make
them: a scheduler commits, a reclaim of the shared budget shrinks keeping
contents. What each means for an `offload=True` copy is `WHILE_ASLEEP`, the
one table of it: the wake writes back the copied blocks the cache still
keeps, and every other block wakes zeroed, as the cache's own growth or
recommit leaves it. In short: a shrink keeping contents to n gets blocks
[0, n) back byte for byte; a discarding shrink or defragment discards the
copy, as the caller asked, and the blocks wake zeroed; a growth gets the
copied blocks back and the new ones zeroed. The cache tells which: the copy
takes a `ContentsWatch` (extkv.cache) at the moment it is made, which the
cache lowers whenever its committed count drops (it drops exactly when an
operation drops contents; a release for sleep keeps it), and the wake
writes back `kept_blocks` blocks of each segment, clamped to the bytes that
segment has committed then: no write reaches past the committed bytes,
whatever happened meanwhile. (The buffer's `release_count` could not say
it: the sleep's own release bumps it, a shrink of a released cache unmaps
nothing and leaves it, and it counts no blocks.) A commit or shrink racing
the wake from another thread ends the same either way: before the wake, as
the table says; after it, on an awake cache. A plain tensor keeps no count
across its release: its wake regrows the sizes it had at the sleep, or
those a caller grew it to meanwhile (it only grows), and writes the copy
back within them. Using a view during a release is a bug in the caller.

Locks. One re-entrant lock per controller serializes its operations, and
a move also holds the locks of the registrations it moves, so no commit
of a scheduler thread lands between a copy and the release it follows.
Callers may hold a reservation's lock themselves (it is re-entrant, for
callers to hold around operations that must not interleave) and call the
controller meanwhile, from any thread. So the controller never waits for a
lock while it holds one: it takes its own lock, then each reservation's
(in address order) without waiting; where one is busy it lets go of every
lock it took, waits for that one alone and starts over (a sleep waiting
for a KV cache's lock gives up a reserve its commit-ahead step waits on
meanwhile, as `release_physical` does: the sleep pauses that worker, and
a KV cache is released even holding nothing, so that it is). The rule: calling
a word while holding reservation A's lock is taking A's lock and then
those of the reservations the word moves; only callers who take two
reservations' locks in opposite orders can deadlock, as they would without
a controller. Reads (`tags`, `state`, `states`, `is_sleeping`,
`offloaded_bytes`, repr) take no lock: each operation publishes, as it
ends, an immutable snapshot of what it left, and a read returns the
latest, the state before or after an operation in flight, never waiting
for it. Between operations a state is read from the registrations
themselves, since a cache's own operations change what it holds without
the controller (a move counts itself in and out, and a read that saw one
begin takes the snapshot).

Signals. Each attempt runs with signal handlers deferred
(extkv.deferred_signals), so a copy or release once begun runs whole. A
wait for a lock runs in tries of `LOCK_RETRY_S` seconds, each ending the
deferral: a handler that raises (Ctrl-C) ends the wait within one try,
having changed nothing.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import threading
from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Mapping, NamedTuple

import torch

from . import validate
from .cache import ContentsWatch, ExtensibleKVCache
from .deferred_signals import deferred_signals
from .errors import StateError
from .tensor import ExtensibleTensor
from .vmm import torch_memory

logger = logging.getLogger(__name__)
_DEFERRED_SIGNALS = deferred_signals()

DEFAULT_TAG = "kv_cache"


class TagState(str, enum.Enum):
    """Where a tag stands; a str, so `state == "asleep"` reads as it says."""

    AWAKE = "awake"
    ASLEEP = "asleep"
    #: Left by an operation that failed part way; either direction completes it.
    PARTLY_ASLEEP = "partly asleep"


class _Move(enum.Enum):
    SLEEP = "sleep"
    WAKE = "wake"
    NO_OP = "no-op"
    REFUSED = "refused"


_AWAKE, _ASLEEP, _PARTLY = TagState.AWAKE, TagState.ASLEEP, TagState.PARTLY_ASLEEP
#: What each word does to a tag in each state (see the module's theory).
_TRANSITIONS: dict[str, dict[TagState, _Move]] = {
    # vLLM: sleeping a sleeping tag, or waking an awake one, is a no-op.
    "sleep": {_AWAKE: _Move.SLEEP, _ASLEEP: _Move.NO_OP, _PARTLY: _Move.SLEEP},
    "wake_up": {_AWAKE: _Move.NO_OP, _ASLEEP: _Move.WAKE, _PARTLY: _Move.WAKE},
    # torch_memory_saver: pausing a paused tag, or resuming an active one, is an error.
    "pause": {_AWAKE: _Move.SLEEP, _ASLEEP: _Move.REFUSED, _PARTLY: _Move.SLEEP},
    "resume": {_AWAKE: _Move.REFUSED, _ASLEEP: _Move.WAKE, _PARTLY: _Move.WAKE},
}
#: Whether a sleeping word keeps the contents of `offload=True` registrations:
#: vLLM's level 1 keeps its offloaded tag and level 2 keeps nothing;
#: torch_memory_saver's pause keeps every CPU-backed region.
_KEEPS_OFFLOADED = {("sleep", 1): True, ("sleep", 2): False, ("pause", None): True}


class AsleepOperation(NamedTuple):
    """A KV cache's operation made while its `offload=True` registration
    sleeps: what the cache does, and what the wake then writes back."""

    #: What the cache does asleep (extkv.cache), and what the wake makes of it.
    means: str
    #: Blocks the wake writes back byte for byte, of the `c` blocks copied at
    #: the sleep, after the call with count `n`; every other committed block wakes zeroed.
    kept: Callable[[int, int], int]


#: What each operation of a sleeping, offloaded KV cache means for its copy
#: (see the module's theory); `c`: blocks committed, and copied, at the sleep.
WHILE_ASLEEP: dict[str, AsleepOperation] = {
    "commit(n)": AsleepOperation(
        "n > c: blocks [0, n) mapped zeroed, which wakes the cache (it holds memory again; a sleep releases it "
        "again, keeping the copy); the wake writes the c copied blocks back over them, and blocks [c, n) stay zero. "
        "n <= c: nothing", lambda c, n: c),
    "commit(n, shrink=True, preserve_contents=True)": AsleepOperation(
        "n < c: the count drops to n and nothing is mapped; the wake maps n blocks and writes blocks [0, n) back. A "
        "later growth, asleep or awake, zeroes blocks from n on", lambda c, n: min(c, n)),
    "commit(n, shrink=True)": AsleepOperation(
        "n < c: contents discarded, as asked: n blocks mapped zeroed, which wakes the cache; the wake writes nothing "
        "back and drops the copy. n >= c: a growth", lambda c, n: 0 if n < c else c),
    "commit(n, defragment=True)": AsleepOperation(
        "n > 0: contents discarded, as asked (nothing is mapped, so every segment is remapped): n blocks mapped "
        "zeroed, which wakes the cache; the wake writes nothing back", lambda c, n: 0 if n else c),
    "commit(n, defragment=True, preserve_contents=True)": AsleepOperation(
        "keeps contents: nothing to move asleep; n > c grows as commit(n)", lambda c, n: c),
    "commit_ahead(window)": AsleepOperation(
        "the worker starts paused, and grows past the committed blocks only after the wake", lambda c, n: c),
    "release_physical()": AsleepOperation("nothing: nothing is mapped", lambda c, n: c),
    "recommit()": AsleepOperation(
        "the committed blocks mapped zeroed, which wakes the cache; the wake writes the copy back over them",
        lambda c, n: c),
    "free()": AsleepOperation(
        "the cache is gone: the wake refuses (StateError: unregister it first), and unregister drops the copy",
        lambda c, n: 0),
}
_LEVEL_WANTED = "1 or 2: vLLM's sleep levels; level 0, pausing the scheduler, is the engine's"
#: Seconds of one try at a busy lock: how long Ctrl-C may wait to end a wait for one.
LOCK_RETRY_S = 0.05


class _Busy(NamedTuple):
    """What an attempt returns, having changed nothing, when `lock` is held
    elsewhere; the wait for it is made inside `meanwhile()`."""

    lock: object
    meanwhile: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext


def _wait_until_free(busy: _Busy) -> None:
    """Return once `busy.lock` was free, holding nothing. Each try is bounded
    and deferred (an acquire never lost to a signal); a handler runs between tries."""
    with busy.meanwhile():
        while True:
            with _DEFERRED_SIGNALS:
                if busy.lock.acquire(timeout=LOCK_RETRY_S):
                    busy.lock.release()
                    return


@dataclass(frozen=True)
class _Snapshot:
    """What the last operation left, for reads that take no lock."""

    #: Each tag's state, tags in the order they were first registered.
    states: Mapping[str, TagState]
    offloaded_bytes: int


_NOTHING_REGISTERED = _Snapshot(MappingProxyType({}), 0)


def _describe(value: object) -> str:
    """`value` for an error message. A tensor is described, never printed:
    its repr reads every element, and a view cut from a reservation may
    reach unmapped memory, which kills the process."""
    if isinstance(value, torch.Tensor):
        return f"a torch.Tensor of shape {tuple(value.shape)}, {value.dtype}, on {value.device}"
    text = repr(value)
    return text if len(text) <= 200 else text[:197] + "..."


class _Backup:
    """Host copies of each segment's contents, taken at a sleep, and for a
    KV cache the watch that says how many of the copied blocks the cache
    still keeps (see `WHILE_ASLEEP`)."""

    def __init__(self, copies: list[torch.Tensor], watch: ContentsWatch | None):
        self.copies = copies
        self.watch = watch

    @property
    def nbytes(self) -> int:
        return sum(copy.numel() for copy in self.copies)


class _Registration:
    """One registered object and what sleeping took from it."""

    def __init__(self, target: ExtensibleKVCache | ExtensibleTensor, tag: str, offload: bool):
        self.target = target
        self.tag = tag
        self.offload = offload
        self.buffer: ExtensibleTensor = target.buffer if isinstance(target, ExtensibleKVCache) else target
        #: Set just before its release and cleared once its wake is whole, so
        #: a failure in between leaves it asleep, for either word to complete.
        self.asleep = False
        #: A plain tensor's committed sizes, which its release zeroes: the wake regrows them.
        self.sizes: list[int] | None = None
        #: Host copies of each segment's committed bytes while asleep, if kept.
        self.backup: _Backup | None = None

    @property
    def state(self) -> TagState:
        if not self.asleep:
            return TagState.AWAKE
        # Asleep, yet holding memory: its release, or its wake, failed part way.
        return TagState.PARTLY_ASLEEP if self.buffer.physical_bytes else TagState.ASLEEP

    @property
    def kind(self) -> str:
        return type(self.target).__name__

    def why_not_live(self) -> str | None:
        buffer = self.buffer
        for flag, what in ((buffer.is_freed, "freed"), (buffer.is_broken, "broken"),
                           (buffer.is_inherited, "inherited by a forked child")):
            if flag:
                return what
        return None

    def copy_out(self) -> _Backup:
        """Copy the contents to host memory (commits held: see `commits_held`)."""
        target = self.target
        # From the moment of the copy: what the cache drops of it while
        # asleep, the wake leaves out.
        watch = target.watch_contents() if isinstance(target, ExtensibleKVCache) else None
        # The copy runs on the current stream; kernels queued on others may
        # still be writing the bytes it reads.
        self.buffer.driver.synchronize()
        copies = []
        for index, size in enumerate(self.contents_sizes(watch)):
            view = self.buffer.segment_view(index)[:size]
            # Page-locked host memory beside a GPU, which copies to it at
            # transfer speed; bytes already in host memory copy as they are.
            copy = torch_memory.host_staging(view.device, (size,))
            if size:
                copy.copy_(view)  # blocking: the release after it unmaps the source
            copies.append(copy)
        return _Backup(copies, watch)

    def contents_sizes(self, watch: ContentsWatch | None) -> list[int]:
        """Bytes of each segment that hold contents: a KV cache's blocks the
        watch keeps (at the copy, the committed ones, never those mapped
        past them); a tensor's committed sizes."""
        target = self.target
        if isinstance(target, ExtensibleKVCache):
            return [watch.kept_blocks * stride for stride in target.segment_strides]
        return self.buffer.segment_sizes

    def release(self) -> None:
        self.target.release_physical()

    def commits_held(self) -> contextlib.AbstractContextManager:
        """No commit lands while inside (buffer lock held): a KV cache's
        commit-ahead counts without that lock otherwise, and a block counted
        between the copy and the release would wake without its bytes."""
        target = self.target
        return target.commits_locked() if isinstance(target, ExtensibleKVCache) else contextlib.nullcontext()

    def recommit(self) -> None:
        if isinstance(self.target, ExtensibleKVCache):
            self.target.recommit()
        else:
            # Never below what a caller grew it to meanwhile (a tensor grows only).
            self.target.resize_segments_(list(map(max, self.sizes, self.buffer.segment_sizes)), zero_new=True)

    def copy_in(self) -> None:
        """Write back what the object still keeps of the copy (`WHILE_ASLEEP`):
        for a KV cache, the blocks its watch keeps; never a byte past what
        each segment has committed now."""
        backup = self.backup
        kept = self.contents_sizes(backup.watch) if backup.watch is not None else None
        for index, copy in enumerate(backup.copies):
            view = self.buffer.segment_view(index)  # exactly the committed bytes
            size = min(copy.numel(), view.numel(), copy.numel() if kept is None else kept[index])
            if size:
                # Blocking, so the copy may be dropped as soon as this returns.
                view[:size].copy_(copy[:size])


class SleepController:
    """vLLM's `sleep` / `wake_up` and torch_memory_saver's `pause` /
    `resume` over extkv caches and tensors registered under tags."""

    def __init__(self) -> None:
        self._registrations: list[_Registration] = []
        self._lock = threading.RLock()
        self._snapshot = _NOTHING_REGISTERED
        #: Odd while a move is in flight: a read then takes the snapshot.
        self._moves = 0

    # -- registering ----------------------------------------------------------
    def register(self, target: ExtensibleKVCache | ExtensibleTensor, tag: str = DEFAULT_TAG, *,
                 offload: bool = False) -> None:
        """Put `target` under `tag` (torch_memory_saver's `region(tag=...)`).

        `offload=True` keeps its committed bytes in host memory across
        `sleep(level=1)` and `pause` (torch_memory_saver's
        `enable_cpu_backup`); otherwise it wakes zeroed. The tag must be
        awake, the target live and registered nowhere in this controller.
        """
        self._locked(self._register, target, tag, offload)

    def _register(self, target, tag, offload) -> None:
        if not isinstance(target, (ExtensibleKVCache, ExtensibleTensor)):
            raise ValueError(f"register needs an ExtensibleKVCache or an ExtensibleTensor, got {_describe(target)}")
        tag = self._checked_tag_name("register", tag)
        offload = validate.flag("offload", offload)
        registration = _Registration(target, tag, offload)
        for other in self._registrations:
            if other.buffer is registration.buffer:
                what = "it" if other.target is target else f"the {other.kind} that owns its reservation"
                raise ValueError(f"register: {target!r} is registered already: {what}, under tag {other.tag!r}")
        problem = registration.why_not_live()
        if problem:
            raise StateError(f"register: {target!r} is {problem}; only a live one can sleep and wake")
        if tag in self._live_tags() and self._live_state(tag) is not TagState.AWAKE:
            raise StateError(f"register: tag {tag!r} is {self._live_state(tag).value}; register while it is awake")
        self._registrations.append(registration)
        self._publish()

    def unregister(self, target: ExtensibleKVCache | ExtensibleTensor) -> None:
        """Forget `target`: awake, or freed (its host copy, if any, is dropped)."""
        self._locked(self._unregister, target)

    def _unregister(self, target) -> None:
        found = [r for r in self._registrations if r.target is target]
        if not found:
            raise ValueError(f"unregister: {_describe(target)} is not registered here")
        (registration,) = found
        if registration.asleep and not registration.buffer.is_freed:
            raise StateError(f"unregister: {target!r} is asleep under tag {registration.tag!r}; wake it first")
        self._registrations.remove(registration)
        self._publish()

    # -- what is where: the last snapshot, no lock ---------------------------
    @property
    def tags(self) -> list[str]:
        """Registered tags, in the order they were first registered."""
        return list(self._snapshot.states)

    def state(self, tag: str) -> TagState:
        """Awake, asleep, or partly asleep (an operation failed part way, or
        a cache grew while its tag slept)."""
        states = self._states_now()
        (tag,) = self._checked_tags("state", [tag], list(states))
        return states[tag]

    @property
    def states(self) -> dict[str, TagState]:
        return dict(self._states_now())

    @property
    def is_sleeping(self) -> bool:
        """Whether any tag is not awake (vLLM's `is_sleeping`: true until every tag woke)."""
        return any(state is not TagState.AWAKE for state in self._states_now().values())

    def _states_now(self) -> Mapping[str, TagState]:
        """Each tag's state, taking no lock. Between moves, read from the
        registrations themselves: a cache's own operations change what it
        holds (a growth while its tag sleeps maps memory, leaving the tag
        partly asleep) and publish nothing here. While a move is in flight,
        or if one began during the reading, the snapshot the last move left:
        a move's half-way states are never read."""
        before = self._moves
        if before % 2 == 0:
            states = self._states_of(list(self._registrations))
            if self._moves == before:
                return states
        return self._snapshot.states

    @property
    def offloaded_bytes(self) -> int:
        """Host bytes held by the copies of registrations asleep with their contents kept."""
        return self._snapshot.offloaded_bytes

    def _live_tags(self) -> list[str]:
        return list(dict.fromkeys(r.tag for r in self._registrations))

    def _live_state(self, tag: str) -> TagState:
        return self._state_of([r for r in self._registrations if r.tag == tag])

    @staticmethod
    def _state_of(registrations: list[_Registration]) -> TagState:
        states = {r.state for r in registrations}
        return states.pop() if len(states) == 1 else TagState.PARTLY_ASLEEP

    @classmethod
    def _states_of(cls, registrations: list[_Registration]) -> dict[str, TagState]:
        """Each tag's state, tags in the order they were first registered."""
        tags = dict.fromkeys(r.tag for r in registrations)
        return {tag: cls._state_of([r for r in registrations if r.tag == tag]) for tag in tags}

    def _publish(self) -> None:
        """Snapshot what the registrations hold now (controller's lock held)."""
        self._snapshot = _Snapshot(
            states=MappingProxyType(self._states_of(self._registrations)),
            offloaded_bytes=sum(r.backup.nbytes for r in self._registrations if r.backup is not None),
        )

    # -- vLLM's words ---------------------------------------------------------
    def sleep(self, level: int = 1) -> None:
        """Release every tag's memory, addresses kept. Level 1 first copies
        `offload=True` registrations to host memory; level 2 discards
        everything. A tag asleep already is skipped, as vLLM does."""
        level = validate.integer("level", level, minimum=1, maximum=2, what=_LEVEL_WANTED)
        self._move("sleep", None, keep_offloaded=_KEEPS_OFFLOADED[("sleep", level)])

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Recommit the tags named (every tag when None): fresh zeroed pages at
        the same addresses, kept contents copied back. A tag awake already
        is skipped, as vLLM does."""
        if tags is not None:
            if isinstance(tags, str) or not isinstance(tags, (list, tuple, set, frozenset)):
                raise ValueError(
                    f"tags must be a list of tag names, or None for every tag, got {_describe(tags)}"
                    + (f" (a str: did you mean [{tags!r}]?)" if isinstance(tags, str) else "")
                )
            if not tags:
                raise ValueError("tags must name at least one tag, or be None for every tag, got an empty list")
        self._move("wake_up", None if tags is None else list(tags))

    # -- torch_memory_saver's words -------------------------------------------
    def pause(self, tag: str | None = None) -> None:
        """Release `tag` (every tag when None), copying `offload=True`
        registrations first. A paused tag refuses, as torch_memory_saver does:
        StateError, nothing changed."""
        self._move("pause", None if tag is None else [tag], keep_offloaded=_KEEPS_OFFLOADED[("pause", None)])

    def resume(self, tag: str | None = None) -> None:
        """Recommit `tag` (every tag when None) and copy kept contents back.
        An awake tag refuses, as torch_memory_saver does: StateError,
        nothing changed."""
        self._move("resume", None if tag is None else [tag])

    # -- the one path every word takes ---------------------------------------
    def _locked(self, attempt: Callable, *args):
        """`attempt(*args)` holding the controller's lock, signal handlers
        deferred. An attempt that finds a lock busy returns `_Busy` having
        changed nothing: every lock is let go, and once that one was free
        (signal handlers running between tries) the attempt starts over."""
        while True:
            with _DEFERRED_SIGNALS:
                if self._lock.acquire(blocking=False):
                    try:
                        outcome = attempt(*args)
                    finally:
                        self._lock.release()
                    if not isinstance(outcome, _Busy):
                        return outcome
                    busy = outcome
                else:
                    busy = _Busy(self._lock)
            _wait_until_free(busy)

    def _move(self, word: str, tags: list[str] | None, *, keep_offloaded: bool = False) -> None:
        self._locked(self._attempt_move, word, tags, keep_offloaded)

    def _attempt_move(self, word: str, tags: list[str] | None, keep_offloaded: bool) -> _Busy | None:
        known = self._live_tags()
        tags = known if tags is None else self._checked_tags(word, tags, known)
        moves = {tag: _TRANSITIONS[word][self._live_state(tag)] for tag in tags}
        refused = [tag for tag, move in moves.items() if move is _Move.REFUSED]
        if refused:
            raise StateError(
                f"SleepController.{word}(): "
                + ", ".join(f"tag {tag!r} is {self._live_state(tag).value}" for tag in refused)
                + "; nothing was changed"
            )
        moving = {tag: move for tag, move in moves.items() if move is not _Move.NO_OP}
        if not moving:
            if tags:  # vLLM's "already sleeping" / "not sleeping"
                logger.warning("SleepController.%s(): tags %s are %s already; nothing to do.", word, tags,
                               "asleep" if word == "sleep" else "awake")
            return None
        (direction,) = set(moving.values())  # a word moves one way only
        registrations = [r for r in self._registrations if r.tag in moving]
        for registration in registrations:
            problem = registration.why_not_live()
            if problem:
                raise StateError(
                    f"SleepController.{word}(): the {registration.kind} registered under tag "
                    f"{registration.tag!r} is {problem}; unregister it first. Nothing was changed"
                )
        with contextlib.ExitStack() as held:
            for registration in sorted(registrations, key=lambda registration: registration.buffer.base):
                buffer = registration.buffer
                if not buffer.lock.acquire(blocking=False):
                    # A sleep pauses a KV cache's commit-ahead worker: the daemon's
                    # answer to a reserve its step waits on is of no use to it.
                    gives_up = direction is _Move.SLEEP and isinstance(registration.target, ExtensibleKVCache)
                    return _Busy(buffer.lock, registration.target.worker_reserve_given_up if gives_up
                                 else contextlib.nullcontext)
                held.callback(buffer.lock.release)
            self._moves += 1
            try:
                if direction is _Move.WAKE:
                    self._wake(registrations)
                else:
                    self._sleep(registrations, keep_offloaded)
            finally:
                self._publish()  # a move that failed part way moved some
                self._moves += 1
        logger.info("SleepController.%s(): tags %s now %s.", word, sorted(moving),
                    {tag: self._snapshot.states[tag].value for tag in sorted(moving)})
        return None

    @staticmethod
    def _sleep(registrations: list[_Registration], keep_offloaded: bool) -> None:
        with contextlib.ExitStack() as held:
            for registration in registrations:
                held.enter_context(registration.commits_held())
            SleepController._copy_and_release(registrations, keep_offloaded)

    @staticmethod
    def _copy_and_release(registrations: list[_Registration], keep_offloaded: bool) -> None:
        awake = [r for r in registrations if not r.asleep]
        # Every copy before the first release: host memory running out then changes nothing.
        backups = {id(r): r.copy_out() for r in awake if keep_offloaded and r.offload}
        for registration in registrations:
            if not registration.asleep:
                registration.sizes = registration.buffer.segment_sizes
                registration.backup = backups.get(id(registration))
                # Before the release: one that fails part way has unmapped some
                # of it, and only a wake (which zeroes) or a sleep may follow.
                registration.asleep = True
            # A KV cache holding nothing is released all the same: its release
            # also pauses a commit-ahead worker, which would grow it while the
            # tag sleeps.
            if registration.buffer.physical_bytes or isinstance(registration.target, ExtensibleKVCache):
                registration.release()

    @staticmethod
    def _wake(registrations: list[_Registration]) -> None:
        for registration in registrations:
            if not registration.asleep:
                continue
            registration.recommit()
            if registration.backup is not None:
                registration.copy_in()
            registration.asleep, registration.sizes, registration.backup = False, None, None

    # -- argument checks ------------------------------------------------------
    @staticmethod
    def _checked_tag_name(function: str, tag: object) -> str:
        if not isinstance(tag, str) or not tag:
            raise ValueError(f"{function}: a tag must be a non-empty str, got {_describe(tag)}")
        return tag

    def _checked_tags(self, function: str, tags: list, known: list[str]) -> list[str]:
        for tag in tags:
            self._checked_tag_name(function, tag)
            if tag not in known:
                raise ValueError(f"{function}: tag {tag!r} is not registered; registered tags: {known}")
        return list(dict.fromkeys(tags))

    def __repr__(self) -> str:
        registrations = [r.tag for r in list(self._registrations)]
        parts = [f"{tag}: {state.value} ({registrations.count(tag)})" for tag, state in self._states_now().items()]
        return f"SleepController({', '.join(parts)})"
