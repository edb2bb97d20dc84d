"""ExtensibleCache (extkv.integrations.transformers) gives memory back when the
shared KV budget asks, and never a token of a generation that may go on.

A tiny random-initialised transformers model generates greedily, two
sequences at once, into an ExtensibleCache under a real daemon
(extkv.testing.budget) over the host driver, with a granule of one page so
that block counts, not granules, decide the footprint. Mid-generation a
second engine's reserve makes the daemon reclaim from the cache: the cache
gives back blocks of its margin only, the blocks holding tokens read as
before, and generate goes on to DynamicCache's tokens. A reclaim the margin
cannot cover is answered `cannot` and changes nothing. A generation
declared finished is given back whole; the cache then refuses updates until
`reset()`. A margin shrink whose release fails part way keeps every token,
and generate goes on. After each, the daemon's ledger holds exactly the
cache's physical bytes.

Then a real workload (extkv.testing.generating_engines): two engine
processes of the same model, each with its own cache and floor under one
budget, bursting in turn; each burst reaches the budget less the idle
engine's floor, taking the idle engine's finished generation whole, and
generates DynamicCache's tokens. It runs on each device of the harness's
`device` (`host`, `cuda:N`): its sizes are counted in granules and growth
steps, so on a GPU's 2 MiB granule the same blocks are 512 times the
host's bytes, and its checks read what extkv maps and the daemon counts.

The other tests here are host only: each builds its cache over the host
driver and its daemon over the host device (extkv.testing.budget's
`served_daemon`), as the budget's other proofs do.
"""

from __future__ import annotations

import contextlib
import os

import pytest

# Before transformers is imported: nothing here may reach the Hub.
os.environ["HF_HUB_OFFLINE"] = "1"
transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed: pip install 'extkv[transformers]' to test ExtensibleCache"
)

import torch
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList

from extkv import OutOfMemoryError, StateError
from extkv.budget.client import BudgetClient
from extkv.errors import BudgetDeniedError, DriverError
from extkv.integrations.transformers import ExtensibleCache
from extkv.testing.budget import served_daemon
from extkv.testing.checks import check_unchanged, snapshot
from extkv.testing import generating_engines
from extkv.vmm import HostDriver
from extkv.vmm.faults import FaultInjectingDriver

pytestmark = pytest.mark.budget_proof("reclaim")

#: Seconds a client waits for the daemon.
TIMEOUT_S = 60
BUDGET = 4 << 20
NEW_TOKENS = 60
#: A granule of one page, so that block counts, not granules, decide the footprint.
GRANULE = os.sysconf("SC_PAGE_SIZE")
BATCH = generating_engines.BATCH
PROMPT = generating_engines.PROMPT
#: The tiny Llama, seeded as the two engines' is; no eos, so every generation runs its length.
CONFIG = generating_engines.TINY_LLAMA
#: Logits of the two caches differ by rounding only.
LOGITS = {"rtol": 1e-4, "atol": 1e-4}


@pytest.fixture(scope="module")
def model():
    return generating_engines.tiny_llama(GRANULE, torch.device("cpu"))


@pytest.fixture(scope="module")
def ids():
    generator = torch.Generator().manual_seed(1)
    return torch.randint(1, CONFIG["vocab_size"], (BATCH, PROMPT), generator=generator)


class EachStep(LogitsProcessor):
    """Calls `action(step)` after every forward of a generation (step 0:
    after the prefill; after step k the cache holds the prompt and k
    tokens), leaving the scores alone."""

    def __init__(self, action):
        self.action, self.step = action, 0

    def __call__(self, input_ids, scores):
        self.action(self.step)
        self.step += 1
        return scores


def greedy(model, ids, cache, new_tokens: int, each_step=None):
    """(sequences, logits of every step) of a greedy generation."""
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=new_tokens, do_sample=False,
        output_logits=True, return_dict_in_generate=True, disable_compile=True,
        logits_processor=LogitsProcessorList([EachStep(each_step)] if each_step else []),
    )
    return out.sequences, torch.stack(out.logits)


def expect_same_generation(got, expected, what: str) -> None:
    (tokens, logits), (expected_tokens, expected_logits) = got, expected
    if not torch.equal(tokens, expected_tokens):
        differ = (tokens != expected_tokens).any(0).nonzero().flatten().tolist()
        raise AssertionError(f"{what}: tokens differ from DynamicCache's at positions {differ}")
    torch.testing.assert_close(logits, expected_logits, **LOGITS, msg=lambda m: f"{what}: logits: {m}")


@pytest.fixture(scope="module")
def expected(model, ids):
    return greedy(model, ids, DynamicCache(config=model.config), NEW_TOKENS)


@contextlib.contextmanager
def cache_under(client: BudgetClient, model, driver=None):
    driver = HostDriver(GRANULE) if driver is None else driver
    cache = ExtensibleCache(model.config, 256, device=driver, batch_size=BATCH, budget=client)
    try:
        yield cache
    finally:
        cache.free()


def held(client: BudgetClient) -> int:
    """What the daemon's ledger holds for this client's engine."""
    report = client.report()
    (engine,) = [engine for engine in report["engines"] if engine["engine"] == report["asker"]]
    return engine["held"]


def holding_blocks(cache: ExtensibleCache) -> int:
    """Blocks up to the last that holds a token, the null block included."""
    return 1 + -(-cache.seq_length // cache.block_size) * cache.batch_size


def token_blocks(cache: ExtensibleCache) -> list[torch.Tensor]:
    """Copies of every layer's blocks 1 to `holding_blocks` - 1: the tokens."""
    buffer, end = cache.kv_cache.buffer, holding_blocks(cache)
    return [buffer.segment_view(segment).view(-1, stride)[1:end].clone()
            for segment, stride in enumerate(cache.kv_cache.segment_strides)]


@contextlib.contextmanager
def at_step(model, where: str, step: int, action):
    """Run `action()` once, at `step` of the generation inside: after the
    step's forward ("between steps": yields greedy's `each_step`), or
    inside it, after layer 0's update and before layer 1's ("between two
    layers": yields None, a hook on layer 1 runs it), as the budget
    client's thread may find the cache. Step 0 is the prefill; after step
    k's layer 0 the cache counts the prompt and k tokens."""
    calls = []

    def before_layer_1(module, args):
        calls.append(None)
        if len(calls) - 1 == step:
            action()

    def after_forward(step_done):
        if step_done == step:
            action()

    if where == "between steps":
        yield after_forward
        return
    hook = model.model.layers[1].register_forward_pre_hook(before_layer_1)
    try:
        yield None
    finally:
        hook.remove()


@pytest.mark.invariant(1)
@pytest.mark.invariant(5)
@pytest.mark.invariant(7)
@pytest.mark.parametrize("where", ["between steps", "between two layers"])
def test_a_reclaim_takes_the_margin_only_and_generate_goes_on_as_dynamic_cache(model, ids, expected, where):
    """At step 20 (32 tokens: 2 chunks of 2 rows, blocks 1-4; 5 chunks, 11
    blocks, committed) engine B reserves what leaves the budget 3 blocks
    short; B weighs so much more that the daemon asks the cache for exactly
    those 3 blocks. They lie in the last two chunks, each a physical chunk
    of its own, which a shrink keeping contents gives back whole: the cache
    gives 4 blocks, and B is granted once it did; the token blocks read as
    before, staying mapped (the same physical chunks), the chunks past the
    new top point at the null block, and generate grows again past them to
    DynamicCache's tokens."""
    with served_daemon(BUDGET) as served, BudgetClient(served.path, timeout=TIMEOUT_S) as client_a, \
            cache_under(client_a, model) as cache, \
            BudgetClient(served.path, timeout=TIMEOUT_S, weight=1e6) as client_b:
        reclaimed = []

        def reclaim():
            kv_cache = cache.kv_cache
            committed, before, tokens = kv_cache.num_committed_blocks, cache.physical_bytes, token_blocks(cache)
            assert (cache.seq_length, holding_blocks(cache), committed) == (PROMPT + 20, 5, 11)
            want = before - kv_cache.physical_bytes_for(committed - 3)
            chunks = kv_cache.buffer.mapped_chunks  # held: a freed object's id may be reused
            ticket = client_b.reserve(BUDGET - before + want)  # granted only once the cache gave `want` back
            # B's grant came from bytes the cache's handler returned under
            # its lock: holding it, the handler has ended.
            with cache.lock:
                assert kv_cache.num_committed_blocks == committed - 4, "not the 2 chunks holding the 3 blocks asked"
                assert before - cache.physical_bytes == kv_cache.bytes_per_block * 4 >= want
                assert cache.block_table[:, 3:].eq(0).all(), "a chunk past the new top still names its block"
                remapped = [m.first_granule for m in kv_cache.buffer.mapped_chunks if not any(m is c for c in chunks)]
                assert remapped == [], f"physical chunks at granules {remapped} were mapped anew in the reclaim"
                for layer, (now, then) in enumerate(zip(token_blocks(cache), tokens)):
                    assert torch.equal(now, then), f"layer {layer}'s token blocks changed in the reclaim"
                assert held(client_a) == cache.physical_bytes
            client_b.cancel(ticket)
            # A cancel is sent, not awaited, and the daemon orders messages
            # per connection only: B's report, answered once the cancel is
            # counted, keeps the cache's next reserve from finding B's grant
            # still held (denied so on a loaded 2-core host).
            client_b.report()
            reclaimed.append(committed - kv_cache.num_committed_blocks)

        with at_step(model, where, 20, reclaim) as each_step:
            got = greedy(model, ids, cache, NEW_TOKENS, each_step=each_step)
        assert reclaimed == [4], reclaimed
        expect_same_generation(got, expected, f"reclaimed at step 20, {where}")
        assert cache.kv_cache.num_committed_blocks > 11, "generate did not grow past the reclaimed blocks"
        assert held(client_a) == cache.physical_bytes


@pytest.mark.invariant(1)
@pytest.mark.invariant(5)
def test_a_reclaim_the_margin_cannot_cover_is_answered_cannot_and_changes_nothing(model, ids, expected):
    """At step 10 B reserves what leaves the budget short by the margin and
    one byte: the cache answers `cannot` rather than drop a token, so B is
    denied; the cache's blocks, committed count and table are as they
    were, the ledger holds its bytes, and generate goes on as DynamicCache."""
    with served_daemon(BUDGET) as served, BudgetClient(served.path, timeout=TIMEOUT_S) as client_a, \
            cache_under(client_a, model) as cache, \
            BudgetClient(served.path, timeout=TIMEOUT_S, weight=1e6) as client_b:
        refused = []

        def reclaim_at(step):
            if step != 10:
                return
            kv_cache = cache.kv_cache
            before, state, table = cache.physical_bytes, snapshot(kv_cache), cache.block_table.clone()
            margin = before - kv_cache.physical_bytes_for(holding_blocks(cache))
            assert margin > 0
            with pytest.raises(BudgetDeniedError) as denied:
                client_b.reserve(BUDGET - before + margin + 1)
            with cache.lock:
                check_unchanged(kv_cache, state)
                assert torch.equal(cache.block_table, table)
                assert held(client_a) == cache.physical_bytes == before
            refused.append(str(denied.value))

        got = greedy(model, ids, cache, NEW_TOKENS, each_step=reclaim_at)
        assert len(refused) == 1, refused
        expect_same_generation(got, expected, "a reclaim refused at step 10")
        assert held(client_a) == cache.physical_bytes


@pytest.mark.invariant(1)
@pytest.mark.invariant(5)
def test_a_generation_growing_on_bytes_granted_ahead_is_dynamic_cache_s_and_the_ledger_holds_them(model, ids, expected):
    """A client keeping bytes ahead: the cache grows on them as generate
    goes, its tokens are DynamicCache's, and the ledger holds the cache's
    bytes and those kept ahead, before and after the generation is given back."""
    ahead = 16 * GRANULE
    with served_daemon(BUDGET) as served, BudgetClient(served.path, timeout=TIMEOUT_S, ahead=ahead) as client, \
            cache_under(client, model) as cache:
        expect_same_generation(greedy(model, ids, cache, NEW_TOKENS), expected, "a generation on bytes ahead")
        assert 0 < client.ahead_bytes <= ahead
        assert held(client) == cache.physical_bytes + client.ahead_bytes
        cache.finish_generation()
        assert cache.on_reclaim(1) > 0 and cache.physical_bytes == 0
        assert held(client) == client.ahead_bytes == ahead  # what the cache gave back refilled the bytes ahead


@pytest.mark.invariant(5)
@pytest.mark.invariant(6)
def test_a_finished_generation_is_given_back_whole_and_the_cache_refuses_until_reset(model, ids, expected):
    """finish_generation(): updates are refused from then on; a reclaim of
    one byte takes every block, the null block included, and the ledger
    holds nothing; updates are still refused, now as given back, before any
    block is touched; reset() maps the null block again and a new
    generation is DynamicCache's."""
    with served_daemon(BUDGET) as served, BudgetClient(served.path, timeout=TIMEOUT_S) as client, \
            cache_under(client, model) as cache:
        sequences, _ = greedy(model, ids, cache, 20)
        cache.finish_generation()
        with pytest.raises(StateError, match="finished"):
            greedy(model, sequences, cache, 4)
        before = cache.physical_bytes
        assert before > 0 and held(client) == before

        assert cache.on_reclaim(1) == before, "a finished generation was not given back whole"
        assert cache.physical_bytes == 0 and cache.kv_cache.num_committed_blocks == 0
        assert held(client) == 0
        assert cache.seq_length == 0 and cache.block_table.eq(0).all()
        states = torch.zeros(BATCH, CONFIG["num_key_value_heads"], 1, 16)
        for refused in (lambda: greedy(model, sequences, cache, 4), lambda: cache.update(states, states, 1),
                        cache.make_room):
            with pytest.raises(StateError, match=r"given back .*reset\(\)"):
                refused()
        assert cache.on_reclaim(1) == 0 and held(client) == cache.physical_bytes == 0

        cache.reset()
        assert cache.kv_cache.num_committed_blocks == 1 and held(client) == cache.physical_bytes > 0
        expect_same_generation(greedy(model, ids, cache, NEW_TOKENS), expected, "a new generation after reset()")
        assert held(client) == cache.physical_bytes


@pytest.mark.invariant(1)
@pytest.mark.invariant(5)
@pytest.mark.parametrize("step", ["unmap", "release"])
def test_a_margin_shrink_failing_part_way_keeps_every_token_and_generate_goes_on(model, ids, expected, step):
    """At step 20 a reclaim of the margin meets a driver step that fails as
    the shrink releases the margin's chunks: the error reaches the caller
    (the budget client warns and answers `cannot`), but the shrink keeps
    contents and lowered the count first, so the token blocks read as
    before, the chunks past the new top point at the null block, the ledger
    holds what is mapped, and generate goes on to DynamicCache's tokens."""
    driver = FaultInjectingDriver(HostDriver(GRANULE))
    with served_daemon(BUDGET) as served, BudgetClient(served.path, timeout=TIMEOUT_S) as client, \
            cache_under(client, model, driver) as cache:
        failed = []

        def reclaim_at(done):
            if done != 20:
                return
            kv_cache = cache.kv_cache
            tokens, holding = token_blocks(cache), holding_blocks(cache)
            margin = cache.physical_bytes - kv_cache.physical_bytes_for(holding)
            assert margin > 0
            driver.fail_in(step)
            with pytest.raises(DriverError, match="injected fault") as raised:
                cache.on_reclaim(margin)
            assert kv_cache.num_committed_blocks == holding and not cache.is_asleep
            assert cache.block_table[:, (holding - 1) // BATCH :].eq(0).all(), "a chunk past the new top names its block"
            for layer, (now, then) in enumerate(zip(token_blocks(cache), tokens)):
                assert torch.equal(now, then), f"layer {layer}'s token blocks changed in the failed shrink"
            if step == "unmap":  # a chunk released but not returned is the next release's to retry
                assert held(client) == cache.physical_bytes
            failed.append(str(raised.value))

        got = greedy(model, ids, cache, NEW_TOKENS, each_step=reclaim_at)
        assert len(failed) == 1, failed
        expect_same_generation(got, expected, f"a reclaim whose {step} failed at step 20")
        assert cache.kv_cache.num_committed_blocks > holding_blocks(cache) - BATCH


@pytest.mark.invariant(5)
@pytest.mark.invariant(7)
@pytest.mark.long
def test_two_engines_alternating_bursts_each_reach_the_budget_less_the_other_s_floor(device):
    """Engines A and B, processes of their own with floors of their own,
    burst A, B, A, B; the idle one holds its finished generation (at first,
    B, only its fresh cache). Each burst's peak is at least the budget less
    the idle engine's floor less one growth step (derived from the cache's
    own footprints) and at most the budget; the idle engine's finished
    generation went whole (every burst after the first needed its bytes);
    each burst's tokens are DynamicCache's; at every quiescent point the
    ledger holds each cache's bytes, and at the end nothing
    (extkv.testing.generating_engines, which checks all of it as it goes).
    The engines' processes make their models and CUDA contexts; this one
    holds neither."""
    sizes, bursts = generating_engines.alternating_bursts(device=device)
    print(f"granule {sizes.granularity} bytes, growth step {sizes.step}, budget {sizes.budget}, floors {sizes.floors}")
    assert [(burst.number, burst.engine) for burst in bursts] == list(enumerate(generating_engines.BURSTS, 1))
    for burst in bursts:
        print(f"burst {burst.number}: engine {burst.engine}, {burst.new_tokens} new tokens, peak {burst.peak} bytes "
              f"(at least {burst.least}, at most {burst.budget}); the idle engine held "
              f"{burst.idle_before} bytes before, {burst.idle_after} after")
        if burst.number > 1:
            assert burst.idle_after == 0 < burst.idle_before, f"burst {burst.number}: the idle engine's finished " \
                f"generation of {burst.idle_before} bytes was not given back whole: it holds {burst.idle_after}"
