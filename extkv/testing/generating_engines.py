"""Two transformers engines under one shared KV budget, bursts alternating, and the check of their reach.

Theory of operation
-------------------
A real workload of the shared budget (extkv.budget): two engine processes
(children of the fork server, extkv.testing.children, fresh processes that
create their own CUDA context where there is one), each a tiny random
Llama (TINY_LLAMA, seeded, so both hold the same weights) generating
greedily into an ExtensibleCache (extkv.integrations.transformers) on the
device the test names, with a BudgetClient of its own and a floor of its
own. The test's process drives them over pipes and holds no model and no
CUDA context: it says "burst n tokens" to one engine while the other
idles, A, B, A, B, and each engine answers once its burst is done, so
every wait is on a pipe message.

Sizes in granules. Each engine's driver is its device's of the finest
granule (extkv.vmm's `finest_driver_for`: a page on the host, the GPU's
2 MiB), and the model is widened to it: its heads' size is multiplied
until a block of a layer (K and V of BLOCK_SIZE tokens of every KV head)
is one granule, 1x on 4 KiB pages, 512x on a GPU (the head count cannot
grow: transformers wants the hidden size a multiple of it). So every block is a granule of every layer on every device, block
counts decide a cache's footprint, and the budget (BUDGET_STEPS growth
steps) and floors (FLOOR_GRANULES granules) are the same counts of blocks
everywhere: on 4 KiB pages 160 KiB and 24 / 40 KiB, as fixed KiB numbers
gave before. Nothing here asks which kind of device it runs on; the
daemon serves the device the engines' driver names (its GPU's UUID, or
the host), from a process of its own (extkv.testing.budget's
`daemon_process`), started once the engines have measured their steps,
since the budget is made of them.

An engine ends each burst with `finish_generation()`, so while it idles the
daemon may take its cache whole when the busy engine needs room; the busy
one starts its burst with `reset()`, which maps its null block again. So a
busy engine can reach the budget less what the idle one may keep, at most
its floor (the daemon never asks an engine below it; a finished generation
goes whole, so it keeps nothing, and an engine's first burst finds the
other holding only its fresh cache's null block, below its floor).

What a burst may reach is derived from the cache itself, not guessed: each
engine, before it joins the daemon, grows an unbudgeted cache of the same
shape as generate grows it (`make_room` of the prompt, then of one token a
step) and reports the physical bytes after each step (`footprints`). The
growth step is the largest rise between two of them (a commit opens the
tokens' chunk and `margin` tokens more, across the batch). A burst of n new
tokens runs n forwards, the prompt's and n - 1 decode steps, so it peaks at
footprints[n]; the test gives each burst the largest n whose peak fits the
budget less the idle engine's floor (`plan_sizes`). That peak is then
above the budget
less the floor less one growth step, and `check_burst` demands it was
reached (read from a driver that counts the bytes the cache's chunks map),
and never above the budget. A burst whose cache could not grow (its
reserve denied: the idle engine kept its bytes) stops short, and the check
names its numbers and the denial.

Each engine also generates its prompt into a DynamicCache after the burst,
and its tokens must equal the ExtensibleCache's. At each quiescent point
(both engines idle, their reclaim handlers done: each answers under its
cache's lock) the daemon's ledger must hold exactly each cache's physical
bytes (extkv.testing.budget's `check_ledger_holds_engines`): what extkv
maps and the daemon counts, never a device's free memory, which on a GPU
holds each engine's CUDA context and torch's own memory too; at the end
each engine frees its cache and closes its lease, and the ledger must come
back to nothing.
"""

from __future__ import annotations

import contextlib
import os
import threading
import traceback
import warnings
from dataclasses import dataclass

import torch

from ..budget.client import ENVIRONMENT_VARIABLE, BudgetClient
from ..errors import BudgetDeniedError
from ..vmm import finest_driver_for
from ..vmm.wrapping import WrappingDriver
from . import planted
from .budget import HANG_S, check_ledger_holds_engines, daemon_process, short_run_dir, wait_for_status
from .children import fork_server

#: A tiny Llama (2 layers, 2 KV heads of 16) before it is widened to the
#: granule (`llama_config`); no eos, so every generation runs its length.
#: Its weights are torch.manual_seed(MODEL_SEED)'s.
TINY_LLAMA = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "bos_token_id": 0,
    "eos_token_id": None,
    "pad_token_id": 0,
}
MODEL_SEED = 0
#: TINY_LLAMA's head size (hidden size over query heads), before it is
#: widened.
HEAD_DIM = TINY_LLAMA["hidden_size"] // TINY_LLAMA["num_attention_heads"]
#: Tokens a block holds (the ExtensibleCache's default, named: the widening
#: is counted in it); float32 keys and values.
BLOCK_SIZE = 16
ELEMENT_BYTES = 4
BATCH = 2
PROMPT = 12
#: Tokens per sequence each engine's cache is reserved for: its footprint
#: at this length is past the budget, so the budget bounds every burst.
MAX_CACHE_LEN = 192
#: Tokens committed ahead: a growth step of 2 chunks (32 tokens) of both rows.
MARGIN = 16
#: Budget and floors, in the cache's growth steps and in granules (a step
#: is 8 granules: 2 chunks of 2 rows of 2 layers): a burst of A may reach
#: the budget less B's floor (85 new tokens), one of B the budget less A's
#: (117), and the two together are past the budget, so each burst after
#: the first needs the idle engine's bytes (`plan_sizes` checks it).
BUDGET_STEPS = 5
FLOOR_GRANULES = {"A": 6, "B": 10}
#: Who bursts, in order, each with a prompt seeded by its burst's number.
BURSTS = ("A", "B", "A", "B")


class CountsMapped(WrappingDriver):
    """The host driver, counting the bytes of the chunks it holds
    (`mapped`) and the most it held since `peak` was last set."""

    def __init__(self, inner):
        super().__init__(inner)
        self._lock = threading.Lock()  # the reclaim thread releases while the main one may create
        self.mapped = self.peak = 0

    def _create(self, size: int):
        chunk = self.inner._create(size)
        with self._lock:
            self.mapped += size
            self.peak = max(self.peak, self.mapped)
        return chunk

    def _release(self, chunk) -> None:
        self.inner._release(chunk)
        with self._lock:
            self.mapped -= chunk.size


def llama_config(granularity: int) -> dict:
    """TINY_LLAMA widened so that a block of a layer is one granule of
    `granularity` bytes: its head size multiplied (by 1 on 4 KiB pages,
    where it is TINY_LLAMA's own shape and weights; by 512 on a GPU's
    2 MiB, heads of 8192)."""
    block = 2 * BLOCK_SIZE * TINY_LLAMA["num_key_value_heads"] * HEAD_DIM * ELEMENT_BYTES
    if granularity <= 0 or granularity % block:
        raise ValueError(f"granularity must be a positive multiple of {block} bytes (a block of a layer of the "
                         f"tiny Llama), got {granularity}")
    widen = granularity // block
    return TINY_LLAMA | {"head_dim": HEAD_DIM * widen}


def tiny_llama(granularity: int, device: torch.device):
    """The tiny Llama widened to `granularity` (`llama_config`), its weights
    seeded, on `device`; transformers is imported here, in the process that
    runs it, and never reaches the Hub."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    import transformers

    torch.manual_seed(MODEL_SEED)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**llama_config(granularity))).to(device).eval()


def prompt(burst: int, device: torch.device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(burst)
    return torch.randint(1, TINY_LLAMA["vocab_size"], (BATCH, PROMPT), generator=generator).to(device)


def greedy(model, ids: torch.Tensor, cache, new_tokens: int) -> torch.Tensor:
    return model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=new_tokens,
                          do_sample=False, disable_compile=True)


def footprints(model, driver) -> list[int]:
    """Physical bytes of an unbudgeted cache of the engines' shape on
    `driver`: [0] as made, [1 + s] after step s of a generation (the
    prompt's, then one token each), as generate grows it, up to
    MAX_CACHE_LEN tokens."""
    from ..integrations.transformers import ExtensibleCache

    cache = ExtensibleCache(model.config, MAX_CACHE_LEN, device=driver, batch_size=BATCH, block_size=BLOCK_SIZE,
                            margin=MARGIN, budget=None)
    try:
        found = [cache.physical_bytes]
        cache.make_room(PROMPT)
        found.append(cache.physical_bytes)
        while cache.seq_length < MAX_CACHE_LEN:
            cache.make_room(1)
            found.append(cache.physical_bytes)
        return found
    finally:
        cache.free()


def generating_engine(device: torch.device, defect: str | None, commands, replies) -> None:
    """An engine's life on `device`: report its footprints, its granule and
    its daemon's device; join the daemon whose socket and floor the
    "join" command names; then do each command and answer it. A cache of
    the planted defect `defect` (extkv.testing.planted) stands in for the
    real ExtensibleCache where it is given."""
    try:
        torch.set_num_threads(1)  # two engines and the test on a small host; one works at a time
        # The footprints' cache must join no daemon, and no other cache here may join another.
        os.environ.pop(ENVIRONMENT_VARIABLE, None)
        # generate's notice that `past_key_values` will be renamed, once per process, would reach the test's
        # output unfiltered from here; the ExtensibleCache tests of the test process see it through pytest.
        warnings.filterwarnings("ignore", message=".*past_key_values.* is deprecated", category=FutureWarning)
        from transformers import DynamicCache

        from ..integrations.transformers import ExtensibleCache

        inner = finest_driver_for(device)  # CUDA, where it is one, starts here, in this fresh process
        granularity = inner.granularity
        model = tiny_llama(granularity, inner.device)
        steps = footprints(model, inner)  # freed before the lease: the host's outside reading counts every memfd
        layers = model.config.num_hidden_layers
        if steps[0] != layers * granularity:
            raise ValueError(f"a fresh cache holds {steps[0]} bytes, expected its null block, one granule of "
                             f"{granularity} bytes in each of {layers} layers: a block of a layer is not one granule")
        replies.send({"footprints": steps, "granularity": granularity, "daemon_device": inner.device_key()})
        command, socket_path, floor = commands.recv()
        if command != "join":
            raise ValueError(f"an engine's first command must be join, got {command!r}")
        driver = CountsMapped(inner)
        client = BudgetClient(socket_path, floor=floor, timeout=HANG_S)
        cache_class = ExtensibleCache if defect is None else planted.DEFECTS[defect].make(None)
        cache = cache_class(model.config, MAX_CACHE_LEN, device=driver, batch_size=BATCH, block_size=BLOCK_SIZE,
                            margin=MARGIN, budget=client)
        replies.send({"engine": client.report()["asker"], "physical": cache.physical_bytes})
        while True:
            command, *arguments = commands.recv()
            if command == "burst":
                burst, new_tokens = arguments
                with cache.lock:
                    cache.reset()  # a new generation; maps the null block again where a reclaim took it
                    driver.peak = driver.mapped
                ids, denied, tokens = prompt(burst, inner.device), None, None
                try:
                    tokens = greedy(model, ids, cache, new_tokens).tolist()
                except BudgetDeniedError as error:
                    denied = f"{type(error).__name__}: {error}"
                cache.finish_generation()
                expected = greedy(model, ids, DynamicCache(config=model.config), new_tokens).tolist()
                replies.send({"peak": driver.peak, "tokens": tokens, "expected": expected, "denied": denied})
            elif command == "state":
                with cache.lock:  # a reclaim being answered ends first
                    replies.send({"physical": cache.physical_bytes, "mapped": driver.mapped})
            elif command == "free":
                cache.free()
                client.close()
                replies.send({"physical": cache.physical_bytes, "mapped": driver.mapped})
                return
            else:
                raise ValueError(f"command must be burst, state or free, got {command!r}")
    except BaseException:
        replies.send({"error": traceback.format_exc()})
        raise


class Engine:
    """The test's side of a `generating_engine` child: `ask(command)`
    sends it and returns the answer. Started, it measures (`measured()`),
    then joins a daemon (`ask("join", socket_path, floor)`)."""

    def __init__(self, name: str, device: torch.device, defect: str | None):
        context = fork_server()
        commands_in, self.commands = context.Pipe(duplex=False)
        self.replies, replies_out = context.Pipe(duplex=False)
        self.name = name
        self.process = context.Process(target=generating_engine, args=(device, defect, commands_in, replies_out),
                                       daemon=True)
        self.process.start()
        commands_in.close()
        replies_out.close()

    def measured(self) -> dict:
        return self.answer("start")

    def answer(self, what: str) -> dict:
        if not self.replies.poll(HANG_S):
            raise AssertionError(f"engine {self.name} did not answer {what} within {HANG_S} s")
        try:
            answer = self.replies.recv()
        except EOFError:
            self.process.join(HANG_S)
            raise AssertionError(f"engine {self.name} exited (exit code {self.process.exitcode}) before it "
                                 f"answered {what}") from None
        if "error" in answer:
            raise AssertionError(f"engine {self.name} failed at {what}:\n{answer['error']}")
        return answer

    def ask(self, *command) -> dict:
        self.commands.send(command)
        return self.answer(command[0])

    def kill(self) -> None:
        self.process.kill()
        self.process.join(HANG_S)
        self.commands.close()
        self.replies.close()


@dataclass(frozen=True)
class Burst:
    """One burst, as the check saw it."""

    number: int
    engine: str
    new_tokens: int
    peak: int
    #: What it must reach: the budget less the idle engine's floor less one growth step.
    least: int
    #: What it must stay within.
    budget: int
    #: The idle engine's physical bytes before the burst, and after it.
    idle_before: int
    idle_after: int


@dataclass(frozen=True)
class Sizes:
    """What the bursts are made of, derived from the engines' granule and
    their cache's growth step."""

    granularity: int
    #: The largest rise between two footprints: one commit of the margin.
    step: int
    budget: int
    floors: dict[str, int]
    #: What a burst of each engine may reach: the budget less the other's floor.
    rooms: dict[str, int]
    #: The new tokens of each engine's bursts (`plan`).
    tokens: dict[str, int]


def plan_sizes(steps: list[int], granularity: int) -> Sizes:
    """The budget (BUDGET_STEPS growth steps), floors (FLOOR_GRANULES
    granules) and each engine's burst for footprints `steps` of a cache of
    `granularity`; ValueError where two bursts would both fit the budget,
    since then no burst would need the idle engine's bytes."""
    step = max(after - before for before, after in zip(steps, steps[1:]))
    budget = BUDGET_STEPS * step
    floors = {name: granules * granularity for name, granules in FLOOR_GRANULES.items()}
    rooms = {name: budget - floors[other] for name, other in (("A", "B"), ("B", "A"))}
    tokens = {name: plan(steps, room) for name, room in rooms.items()}
    if steps[tokens["A"]] + steps[tokens["B"]] <= budget:
        raise ValueError(f"bursts of {steps[tokens['A']]} and {steps[tokens['B']]} bytes both fit the budget "
                         f"{budget}: no burst would need the idle engine's bytes")
    return Sizes(granularity, step, budget, floors, rooms, tokens)


def plan(steps: list[int], room: int) -> int:
    """The most new tokens a burst may generate with its cache's peak
    within `room` bytes (`steps`: `footprints`)."""
    fitting = [n for n in range(1, len(steps)) if steps[n] <= room]
    if not fitting or fitting[-1] == len(steps) - 1:
        raise ValueError(f"a room of {room} bytes must hold a burst of 1 token ({steps[1]} bytes) and not one of "
                         f"{MAX_CACHE_LEN - PROMPT + 1} tokens ({steps[-1]} bytes): the budget bounds the bursts")
    return fitting[-1]


def check_burst(burst: Burst, report: dict, other: str, other_floor: int) -> None:
    """Engine `burst.engine`'s burst reached the budget less `other`'s
    floor less one growth step, stayed within the budget, and generated
    DynamicCache's tokens."""
    what = f"burst {burst.number} (engine {burst.engine}, {burst.new_tokens} new tokens)"
    if burst.peak < burst.least:
        raise AssertionError(
            f"{what}: its cache peaked at {burst.peak} bytes, below {burst.least}: the budget {burst.budget} less "
            f"engine {other}'s floor {other_floor} less one growth step {burst.budget - other_floor - burst.least}; "
            f"engine {other} "
            f"held {burst.idle_before} bytes before the burst and {burst.idle_after} after"
            + (f"; the burst stopped at {report['denied']}" if report["denied"] else ""))
    if burst.peak > burst.budget:
        raise AssertionError(f"{what}: its cache peaked at {burst.peak} bytes, above the budget {burst.budget}")
    if report["denied"] is not None:
        raise AssertionError(f"{what}: {report['denied']}")
    if report["tokens"] != report["expected"]:
        tokens, expected = torch.tensor(report["tokens"]), torch.tensor(report["expected"])
        differ = (tokens != expected).any(0).nonzero().flatten().tolist() if tokens.shape == expected.shape else "all"
        raise AssertionError(f"{what}: tokens differ from DynamicCache's at positions {differ}")


def alternating_bursts(defect: str | None = None, device: torch.device | str = "cpu") -> tuple[Sizes, list[Burst]]:
    """Two engines on `device` (`defect`'s cache in each, if given) under a
    daemon of that device, sized by `plan_sizes`, bursting in the order of
    BURSTS; every check made as it goes. Returns the sizes and the bursts."""
    done = []
    with contextlib.ExitStack() as alive:
        engines = {}
        for name in sorted(FLOOR_GRANULES):  # both start, then both measure, side by side
            engines[name] = Engine(name, torch.device(device), defect)
            alive.callback(engines[name].kill)
        measured = {name: engine.measured() for name, engine in engines.items()}
        if measured["A"] != measured["B"]:
            raise AssertionError(f"the two engines' caches differ: A measured {measured['A']}, B {measured['B']}")
        sizes = plan_sizes(measured["A"]["footprints"], measured["A"]["granularity"])
        run_dir = alive.enter_context(short_run_dir())
        served = alive.enter_context(daemon_process(run_dir, sizes.budget, device=measured["A"]["daemon_device"]))
        joined = {name: engine.ask("join", served.path, sizes.floors[name]) for name, engine in engines.items()}

        def quiescent(when: str) -> dict[str, int]:
            states = {name: engine.ask("state") for name, engine in engines.items()}
            for name, state in states.items():
                if state["mapped"] != state["physical"]:
                    raise AssertionError(f"{when}: engine {name}'s cache holds {state['physical']} bytes, its "
                                         f"driver's chunks {state['mapped']}")
            check_ledger_holds_engines(served.path, {joined[name]["engine"]: state["physical"]
                                                     for name, state in states.items()})
            return {name: state["physical"] for name, state in states.items()}

        held = quiescent("at the start")
        for number, name in enumerate(BURSTS, 1):
            (other,) = set(engines) - {name}
            report = engines[name].ask("burst", number, sizes.tokens[name])
            after = quiescent(f"after burst {number}")
            burst = Burst(number, name, sizes.tokens[name], report["peak"], sizes.rooms[name] - sizes.step,
                          sizes.budget, held[other], after[other])
            check_burst(burst, report, other, sizes.floors[other])
            done.append(burst)
            held = after
        for name, engine in engines.items():
            freed = engine.ask("free")
            if (freed["physical"], freed["mapped"]) != (0, 0):
                raise AssertionError(f"engine {name}'s freed cache holds {freed['physical']} bytes, its driver's "
                                     f"chunks {freed['mapped']}")
        wait_for_status(served.path, lambda r: not r["engines"] and r["granted"] == 0 and r["dead"] == 0,
                        "the ledger empty once both engines freed their caches and closed their leases")
    return sizes, done
