"""ExtensibleCache (extkv.integrations.transformers) under transformers models,
on the host driver and each CUDA device.

Every model is random-initialised from a config built here, in fp32, and
nothing is downloaded. Greedy tokens must equal those of transformers' own
DynamicCache on the same weights exactly, and logits within a small
tolerance (the two attend over different lengths, so sums round
differently), through growth, a content-preserving defragment and a sleep
and wake in the middle of generation, at batch sizes above one, in
`generate` and in a decode loop of our own. Physical memory is read outside
extkv (memfd pages, NVML) and must follow the tokens, not max_cache_len.
The CUDA graph tests capture a decode step before growth and replay it
after; they skip without a GPU.
"""

from __future__ import annotations

import os
from itertools import pairwise

import pytest

# Before transformers is imported: nothing here may reach the Hub.
os.environ["HF_HUB_OFFLINE"] = "1"
transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed: pip install 'extkv[transformers]' to test ExtensibleCache"
)

import torch
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList

from extkv import SleepController, StateError
from extkv.integrations.transformers import DEFAULT_MARGIN, ExtensibleCache
from extkv.testing.checks import (
    check_all_equal,
    check_readback_matches_bookkeeping,
    check_usage_matches,
    readback_one_chunk_per_segment,
    register_workload_warm_up,
)
from extkv.testing.generating_engines import TINY_LLAMA
from extkv.vmm import PoisoningDriver, cuda_usable, driver_for

POISON = 0xA5
#: The two engines' tiny decoder (no eos, so every generation runs its
#: length), with room for the longest generation here.
COMMON = {**TINY_LLAMA, "max_position_embeddings": 8192}
#: name -> (config class, model class, config overrides).
ARCHITECTURES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    # Every layer sliding, a window far shorter than the generations.
    "mistral-sliding": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 8}),
    # Sliding and full layers alternating, head_dim 32 (not hidden / heads),
    # logit soft-capping and its own query scale.
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 32, "sliding_window": 8, "num_hidden_layers": 4}),
    # One fused qkv projection.
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
}
#: KV wide enough that a few hundred tokens span several 2 MiB granules per
#: layer: 8 KV heads of 256 in fp32 are 16 KiB a token, 128 tokens a granule.
WIDE = {"num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256}
#: Logits of the two caches differ by rounding only.
LOGITS = {"rtol": 1e-4, "atol": 1e-4}


@pytest.fixture(autouse=True)
def exact_float32():
    """TF32 matmuls would round the two caches' logits apart on a GPU."""
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = previous


def make_config(architecture: str, **overrides):
    config_name, model_name, extra = ARCHITECTURES[architecture]
    if not hasattr(transformers, model_name):
        pytest.skip(f"transformers {transformers.__version__} has no {model_name}")
    return getattr(transformers, config_name)(**{**COMMON, **extra, **overrides})


def make_model(architecture: str, device, **overrides):
    config = make_config(architecture, **overrides)
    torch.manual_seed(0)
    return getattr(transformers, ARCHITECTURES[architecture][1])(config).to(device).eval()


@pytest.fixture
def caches():
    """`caches(model, max_cache_len, **kwargs)`: an ExtensibleCache for the
    model (its config, device and dtype unless given), freed after the test."""
    made: list[ExtensibleCache] = []

    def make(model, max_cache_len, **kwargs):
        config = kwargs.pop("config", model.config)
        kwargs.setdefault("device", model.device)
        kwargs.setdefault("dtype", model.dtype)
        cache = ExtensibleCache(config, max_cache_len, **kwargs)
        made.append(cache)
        return cache

    yield make
    for cache in made:
        cache.free()


def prompt(length: int, device, batch: int = 1, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1, COMMON["vocab_size"], (batch, length), generator=generator).to(device)


class EachStep(LogitsProcessor):
    """Calls `action(step)` after every forward of a generation (step 0:
    after the prefill), leaving the scores alone."""

    def __init__(self, action):
        self.action = action
        self.step = 0

    def __call__(self, input_ids, scores):
        self.action(self.step)
        self.step += 1
        return scores


def greedy(model, ids, cache, new_tokens: int, attention_mask=None, each_step=None):
    """(sequences, logits of every step) of a greedy generation. Compiling is
    left to the tests that ask for it: eager DynamicCache is the reference."""
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids) if attention_mask is None else attention_mask,
        past_key_values=cache,
        max_new_tokens=new_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        disable_compile=True,
        logits_processor=LogitsProcessorList([EachStep(each_step)] if each_step else []),
    )
    return out.sequences, torch.stack(out.logits)


def load_generation_kernels(device) -> None:
    """Generate a few tokens with each architecture here, over both caches,
    exactly as the tests do (TF32 off), before the device's first leak
    baseline: CUDA loads a kernel's module at its first launch and grows the
    context in 2 MiB steps, which the leak check reads as the leak of
    whichever test crossed one (an H100 under load: 784334848 -> 786432000
    bytes in a sleep test). Registered with the harness's warm-up."""
    if torch.device(device).type != "cuda":
        return
    tf32, torch.backends.cuda.matmul.allow_tf32 = torch.backends.cuda.matmul.allow_tf32, False
    try:
        for architecture, overrides in [*((name, {}) for name in ARCHITECTURES), ("llama", WIDE)]:
            config_name, model_name, extra = ARCHITECTURES[architecture]
            if not hasattr(transformers, model_name):
                continue
            torch.manual_seed(0)
            config = getattr(transformers, config_name)(**{**COMMON, **extra, **overrides})
            model = getattr(transformers, model_name)(config).to(device).eval()
            ids = torch.ones((2, 4), dtype=torch.long, device=model.device)
            greedy(model, ids, DynamicCache(config=model.config), 2)
            cache = ExtensibleCache(model.config, 16, device=model.device, dtype=model.dtype)
            try:
                greedy(model, ids[:1], cache, 2)
            finally:
                cache.free()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


register_workload_warm_up(load_generation_kernels)


def expect_same_generation(got, expected, what: str) -> None:
    (tokens, logits), (expected_tokens, expected_logits) = got, expected
    if not torch.equal(tokens, expected_tokens):
        differ = (tokens != expected_tokens).any(0).nonzero().flatten().tolist()
        raise AssertionError(f"{what}: tokens differ from DynamicCache's at positions {differ}")
    torch.testing.assert_close(logits, expected_logits, **LOGITS, msg=lambda m: f"{what}: logits: {m}")


def addresses(cache: ExtensibleCache) -> tuple[int, ...]:
    """Where the reservation, the block table and every layer's position
    counter live: fixed for the cache's life."""
    return (
        cache.kv_cache.buffer.base,
        cache.block_table.data_ptr(),
        *(layer.cumulative_length.data_ptr() for layer in cache.layers),
    )


def tokens_per_granule(cache: ExtensibleCache) -> int:
    """Tokens of every sequence one granule of each layer holds."""
    blocks = cache.kv_cache.buffer.granularity // cache.kv_cache.segment_strides[0]
    return blocks // cache.batch_size * cache.block_size


def warm_up(model, caches) -> None:
    """Run the kernels of both caches once before any baseline is read: CUDA
    loads modules lazily and its context grows as new kernels run."""
    ids = prompt(4, model.device)
    greedy(model, ids, DynamicCache(config=model.config), 2)
    cache = caches(model, 64)
    greedy(model, ids, cache, 2)
    cache.free()


@pytest.fixture(scope="module", autouse=True)
def cuda_kernels_loaded(request):
    """Run this module's kernels once on every GPU the run tests, before the
    harness reads any test's baseline: CUDA loads kernels lazily, and NVML's
    reading of the process grows as it does, which a test would read as a
    leak (extkv.testing.checks.warm_up_kernels does so for the suites' own)."""
    if request.config.getoption("--extkv-device") not in ("all", "gpu") or not cuda_usable():
        return
    for index in range(torch.cuda.device_count()):
        device = torch.device("cuda", index)
        for architecture, overrides in [*((name, {}) for name in ARCHITECTURES), ("llama", WIDE)]:
            model = make_model(architecture, device, **overrides)
            ids = prompt(24, device, batch=3)
            mask = torch.ones_like(ids)
            mask[1:, :5] = 0
            for batch in (1, 3):
                greedy(model, ids[:batch], DynamicCache(config=model.config), 3, attention_mask=mask[:batch])
                cache = ExtensibleCache(
                    model.config, 256, device=PoisoningDriver(driver_for(device), POISON), batch_size=batch, margin=8
                )
                try:
                    greedy(model, ids[:batch], cache, 3, attention_mask=mask[:batch])
                    cache.release_physical()
                    cache.recommit()
                    check_all_equal(cache.kv_cache.buffer.segment_view(0), 0, "warm-up")
                    with torch.no_grad():
                        for piece in ids[:batch].split(12, dim=1):
                            model(input_ids=piece, past_key_values=cache, use_cache=True)
                finally:
                    cache.free()
        torch.cuda.synchronize(device)


# -- equal to DynamicCache ---------------------------------------------------------
@pytest.mark.invariant(1)
@pytest.mark.parametrize("architecture", list(ARCHITECTURES))
def test_generate_matches_dynamic_cache_while_the_cache_grows(device, architecture, caches):
    """max_cache_len far past the prompt and a margin of one block: blocks are
    committed during decode, the addresses stay, the tokens are DynamicCache's."""
    model = make_model(architecture, device)
    ids = prompt(12, device)
    expected = greedy(model, ids, DynamicCache(config=model.config), 60)
    cache = caches(model, 1024, margin=16)
    where = addresses(cache)
    committed = []
    got = greedy(model, ids, cache, 60, each_step=lambda step: committed.append(cache.kv_cache.num_committed_blocks))
    expect_same_generation(got, expected, architecture)
    assert committed[-1] > committed[0], f"no block was committed during decode: {committed}"
    assert addresses(cache) == where
    assert cache.seq_length == 12 + 59 and int(cache.get_seq_length()) == 12 + 59


@pytest.mark.invariant(1, 5)
def test_generate_beside_the_commit_ahead_worker_matches_dynamic_cache(device, caches, usage):
    """The ExtensibleKVCache under the cache grows in the background
    (extkv.ahead) while generate decodes past a granule of every layer: the
    tokens are DynamicCache's, the addresses stay, the worker made steps,
    and usage measured outside extkv equals physical_bytes."""
    model = make_model("llama", device, **WIDE)
    warm_up(model, caches)
    baseline = usage.read_outside_torch()
    cache = caches(model, 1024, margin=1)
    ids = prompt(tokens_per_granule(cache) - cache.block_size - 8, device)
    expected = greedy(model, ids, DynamicCache(config=model.config), 40)
    cache.kv_cache.commit_ahead(2, step_blocks=1)
    where = addresses(cache)
    expect_same_generation(greedy(model, ids, cache, 40), expected, "beside the commit-ahead worker")
    assert addresses(cache) == where
    assert cache.kv_cache.commit_ahead_steps > 0, "the worker made no step during generate"
    check_usage_matches(usage, baseline, [cache.kv_cache.buffer])


@pytest.mark.invariant(1)
@pytest.mark.parametrize("architecture", ["llama", "mistral-sliding", "gemma2"])
def test_batch_with_left_padding_matches_dynamic_cache(device, architecture, caches):
    """Three sequences of different lengths, left-padded, with the default
    block size and margin."""
    model = make_model(architecture, device)
    ids = prompt(14, device, batch=3)
    mask = torch.ones_like(ids)
    for row, padding in enumerate([0, 5, 9]):
        ids[row, :padding] = COMMON["pad_token_id"]
        mask[row, :padding] = 0
    expected = greedy(model, ids, DynamicCache(config=model.config), 40, attention_mask=mask)
    cache = caches(model, 256, batch_size=3)
    assert cache.margin == DEFAULT_MARGIN
    expect_same_generation(greedy(model, ids, cache, 40, attention_mask=mask), expected, f"{architecture}, batch 3")


@pytest.mark.invariant(1, 5)
def test_growth_mid_generation_maps_new_chunks_measured_outside(device, caches, usage):
    """A prompt that fills the first granule of every layer, then decode past
    it: the next granule is mapped during decode, usage measured outside
    extkv equals physical_bytes after every step, and the tokens are
    DynamicCache's."""
    model = make_model("llama", device, **WIDE)
    warm_up(model, caches)
    baseline = usage.read_outside_torch()
    cache = caches(model, 1024, margin=8)
    first = tokens_per_granule(cache) - cache.block_size  # the null block takes a block of the first granule
    ids = prompt(first - 8, device)
    expected = greedy(model, ids, DynamicCache(config=model.config), 40)
    where, physical = addresses(cache), []

    def measure(step):
        check_usage_matches(usage, baseline, [cache.kv_cache.buffer])
        physical.append(cache.physical_bytes)

    expect_same_generation(greedy(model, ids, cache, 40, each_step=measure), expected, "llama, wide KV")
    granule, layers = cache.kv_cache.buffer.granularity, len(cache.layers)
    assert physical[0] == layers * granule and physical[-1] == 2 * layers * granule, physical
    assert addresses(cache) == where


@pytest.mark.invariant(1, 3)
def test_defragment_mid_generation_keeps_every_token(device, caches):
    """Once decode has mapped a second chunk under every layer, a
    content-preserving defragment moves each layer onto one chunk, at the
    same addresses, between two steps; generation goes on as DynamicCache's."""
    model = make_model("llama", device, **WIDE)
    cache = caches(model, 1024, margin=8)
    ids = prompt(tokens_per_granule(cache) - 24, device)
    expected = greedy(model, ids, DynamicCache(config=model.config), 40)
    where, kv_cache, moved = addresses(cache), cache.kv_cache, []

    def defragment_once(step):
        sizes = kv_cache.buffer.segment_sizes
        if moved or all(readback_one_chunk_per_segment(kv_cache.buffer, sizes)):
            return
        kv_cache.commit(kv_cache.num_committed_blocks, defragment=True, preserve_contents=True)
        one_chunk = readback_one_chunk_per_segment(kv_cache.buffer, kv_cache.buffer.segment_sizes)
        assert all(one_chunk), f"layers backed by one chunk after the defragment, as the driver reads it: {one_chunk}"
        check_readback_matches_bookkeeping(kv_cache.buffer)
        moved.append(step)

    got = greedy(model, ids, cache, 40, each_step=defragment_once)
    assert moved and 0 < moved[0] < 39, f"no defragment between two decode steps: {moved}"
    expect_same_generation(got, expected, f"llama, defragmented at step {moved[0]}")
    assert addresses(cache) == where


@pytest.mark.invariant(4, 5)
def test_sleep_returns_memory_and_wake_reads_zero_then_prefill_continues(device, caches, usage):
    """Over poisoned chunks: asleep, usage measured outside extkv is back at
    its baseline and updates are refused; awake, the same blocks are mapped at
    the same addresses and read zero, the cache is empty, and a re-prefill of
    prompt and generated tokens continues as DynamicCache does from them."""
    model = make_model("llama", device)
    warm_up(model, caches)
    baseline = usage.read_outside_torch()
    driver = PoisoningDriver(driver_for(device), POISON)
    cache = caches(model, 512, device=driver, margin=16)
    ids = prompt(12, device)
    first = greedy(model, ids, cache, 30)
    expect_same_generation(first, greedy(model, ids, DynamicCache(config=model.config), 30), "before the sleep")
    awake, where = cache.physical_bytes, addresses(cache)
    check_usage_matches(usage, baseline, [cache.kv_cache.buffer])

    cache.release_physical()
    assert cache.is_asleep and cache.physical_bytes == 0
    check_usage_matches(usage, baseline, [cache.kv_cache.buffer])  # asleep: back at the baseline
    with pytest.raises(StateError, match="asleep"):
        greedy(model, first[0], cache, 4)
    with pytest.raises(StateError, match="asleep"):  # a layer past the first: its blocks are unmapped too
        cache.update(*[torch.zeros(1, 2, 1, 16, device=device)] * 2, 1)

    cache.recommit()
    assert cache.physical_bytes == awake and addresses(cache) == where
    check_usage_matches(usage, baseline, [cache.kv_cache.buffer])
    assert driver.poisoned_chunks > 0, "no poison was laid: zeroes would prove nothing"
    for segment in range(len(cache.kv_cache.buffer.segment_sizes)):
        check_all_equal(cache.kv_cache.buffer.segment_view(segment), 0, f"layer {segment} after the wake")
    assert cache.seq_length == 0 and int(cache.get_seq_length()) == 0

    sequences = first[0]
    expected = greedy(model, sequences, DynamicCache(config=model.config), 30)
    expect_same_generation(greedy(model, sequences, cache, 30), expected, "re-prefilled after the wake")

    # reset (transformers' Cache.reset): empty, and zero, without a sleep.
    cache.reset()
    assert cache.seq_length == 0 and int(cache.get_seq_length()) == 0 and addresses(cache) == where
    for segment in range(len(cache.kv_cache.buffer.segment_sizes)):
        check_all_equal(cache.kv_cache.buffer.segment_view(segment), 0, f"layer {segment} after reset()")
    expect_same_generation(greedy(model, ids, cache, 30), first, "after reset()")


def sleep_under(cache, how: str):
    """Release the memory of `cache`'s ExtensibleKVCache without the
    ExtensibleCache knowing: through a SleepController holding the
    ExtensibleKVCache, or only its reservation, or the ExtensibleKVCache's own
    release_physical(). The controller, or None."""
    if how == "release_physical":
        cache.kv_cache.release_physical()
        return None
    engine = SleepController()
    engine.register(cache.kv_cache if how == "controller" else cache.kv_cache.buffer)
    engine.sleep(level=1)
    return engine


@pytest.mark.invariant(4, 6)
@pytest.mark.parametrize("how", ["controller", "controller holding its reservation", "release_physical"])
def test_an_update_over_memory_released_under_the_cache_raises_before_touching_it(device, caches, how):
    """Its blocks released by someone else (a SleepController, or the
    ExtensibleKVCache's own release_physical()): generate raises StateError,
    as does an update of a layer past the first, before any block is read or
    written (they are unmapped: a touch would kill the process), and the
    cache's counts are as they were. A wake by the same hand maps them back."""
    model = make_model("llama", device)
    cache = caches(model, 256, margin=16)
    ids = prompt(12, device)
    first, _ = greedy(model, ids, cache, 8)
    engine = sleep_under(cache, how)
    held = (cache.seq_length, int(cache.get_seq_length()), cache.committed_bytes)
    assert cache.is_asleep
    with pytest.raises(StateError, match="asleep"):
        greedy(model, first, cache, 4)
    for refused in (lambda: cache.update(*[torch.zeros(1, 2, 1, 16, device=device)] * 2, 1),
                    cache.make_room, cache.reset):
        with pytest.raises(StateError, match="asleep"):
            refused()
    assert (cache.seq_length, int(cache.get_seq_length()), cache.committed_bytes) == held
    if engine is None:
        cache.kv_cache.recommit()
    else:
        engine.wake_up()
    assert not cache.is_asleep


def release_and_map_again(cache, how: str) -> None:
    """Drop the contents of `cache`'s ExtensibleKVCache behind its back and
    map its committed blocks again, zeroed."""
    if how == "shrink and regrow":
        committed = cache.kv_cache.num_committed_blocks
        cache.kv_cache.commit(0, shrink=True)
        cache.kv_cache.commit(committed)
        return
    engine = sleep_under(cache, how)
    if engine is None:
        cache.kv_cache.recommit()
    else:
        engine.wake_up()


@pytest.mark.invariant(4)
@pytest.mark.parametrize("how", ["controller", "release_physical", "shrink and regrow"])
def test_after_a_wake_the_cache_refuses_until_reset_then_a_re_prefill_matches_dynamic_cache(device, caches, how):
    """Someone released the ExtensibleKVCache's memory and mapped it again
    (a SleepController's sleep and wake, its own release_physical() and
    recommit(), a shrink and a regrowth): its blocks read zero, so the
    tokens the cache held are gone. Continuing the generation raises
    StateError rather than attend over zeroes; after reset() a re-prefill of
    the whole conversation generates DynamicCache's tokens. A cache that held
    no tokens when it slept takes its woken blocks as they are."""
    model = make_model("llama", device)
    cache = caches(model, 512, margin=16)
    first, _ = greedy(model, prompt(12, device), cache, 20)
    release_and_map_again(cache, how)
    conversation = torch.cat([first, prompt(5, device, seed=2)], dim=1)
    with pytest.raises(StateError, match=r"reset\(\) and re-prefill"):
        greedy(model, conversation, cache, 10)
    cache.reset()
    expected = greedy(model, conversation, DynamicCache(config=model.config), 10)
    expect_same_generation(greedy(model, conversation, cache, 10), expected, f"re-prefilled after {how}")
    cache.reset()
    release_and_map_again(cache, how)
    expect_same_generation(greedy(model, conversation, cache, 10), expected, "an empty cache slept and woken")


@pytest.mark.invariant(1, 5)
@pytest.mark.long
def test_physical_memory_follows_tokens_not_max_cache_len(device, caches, usage):
    """A decode loop of our own: the prompt in chunks, then greedy steps, into
    two caches whose max_cache_len differ fourfold and a DynamicCache. Usage
    measured outside extkv grows granule by granule with the tokens, is the
    same for both caches, and stays far below what max_cache_len would take;
    the logits are DynamicCache's."""
    model = make_model("llama", device, **WIDE)
    warm_up(model, caches)
    baseline = usage.read_outside_torch()
    short, long_ = caches(model, 1024, margin=8), caches(model, 4096, margin=8)
    dynamic = DynamicCache(config=model.config)
    chunk = tokens_per_granule(short) // 2
    ids = prompt(6 * chunk, device)
    readings = []
    with torch.no_grad():
        for start in range(0, ids.shape[1], chunk):
            piece = ids[:, start : start + chunk]
            logits = [model(input_ids=piece, past_key_values=c, use_cache=True).logits for c in (short, long_, dynamic)]
            for got in logits[:2]:
                torch.testing.assert_close(got, logits[2], **LOGITS)
            check_usage_matches(usage, baseline, [short.kv_cache.buffer, long_.kv_cache.buffer])
            readings.append((short.physical_bytes, long_.physical_bytes))
        token = logits[2][:, -1:].argmax(-1)
        for _ in range(8):
            steps = [model(input_ids=token, past_key_values=c, use_cache=True).logits for c in (short, long_, dynamic)]
            for got in steps[:2]:
                torch.testing.assert_close(got, steps[2], **LOGITS)
            token = steps[2][:, -1:].argmax(-1)
    assert all(a == b for a, b in readings), f"physical bytes depend on max_cache_len: {readings}"
    growth = [b > a for (a, _), (b, _) in pairwise(readings)]
    assert sum(growth) >= 2, f"physical bytes did not grow with the tokens: {readings}"
    # The blocks of the tokens held and the margin, in whole granules: no more.
    blocks = short.kv_cache.num_committed_blocks
    assert blocks == long_.kv_cache.num_committed_blocks <= 1 + -(-(short.seq_length + 8) // short.block_size)
    assert readings[-1][0] == short.kv_cache.physical_bytes_for(blocks)
    static = short.kv_cache.bytes_per_block // short.block_size * long_.max_cache_len
    held = f"{readings[-1][1]} bytes for {short.seq_length} of {long_.max_cache_len} tokens"
    assert readings[-1][1] * 4 < static, held
    short.free()
    long_.free()
    check_usage_matches(usage, baseline, [])  # both freed: back at the baseline


def decode_loop(forward, cache, ids, steps: int) -> torch.Tensor:
    """Logits of a prefill of `ids` and `steps` greedy steps after it, each
    step a call of `forward` (the model, or the model compiled)."""
    seen = []
    with torch.no_grad():
        logits = forward(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1]
        for _ in range(steps):
            seen.append(logits)
            logits = forward(input_ids=logits.argmax(-1, keepdim=True), past_key_values=cache, use_cache=True)
            logits = logits.logits[:, -1]
    return torch.stack([*seen, logits])


@pytest.mark.invariant(1)
@pytest.mark.long
def test_compiled_forward_reads_and_writes_committed_blocks_only(device, caches):
    """The model compiled (dynamo and AOTAutograd, without code generation)
    in a decode loop of our own, over a cache whose reservation is almost all
    unmapped and grows during decode: a compiled graph that took the
    reservation as an input would copy all of it and fault. The logits are
    those of eager DynamicCache."""
    model = make_model("llama", device)
    ids = prompt(12, device)
    expected = decode_loop(model, DynamicCache(config=model.config), ids, 30)
    cache = caches(model, 1 << 16, margin=16)
    committed = cache.kv_cache.num_committed_blocks
    got = decode_loop(torch.compile(model, backend="aot_eager"), cache, ids, 30)
    torch.testing.assert_close(got, expected, **LOGITS)
    assert cache.kv_cache.num_committed_blocks > committed + 1, "no block was committed during the compiled decode"


# -- bad use ------------------------------------------------------------------------
@pytest.mark.invariant(6)
def test_a_cache_of_fewer_layers_than_the_model_is_refused(device, caches):
    model = make_model("llama", device, num_hidden_layers=3)
    cache = caches(model, 64, config=make_config("llama", num_hidden_layers=2))
    with pytest.raises(ValueError, match=r"layer_idx 2 is not one of this cache's 2 layers"):
        greedy(model, prompt(5, device), cache, 3)


@pytest.mark.invariant(6)
def test_a_cache_of_more_layers_than_the_model_is_refused_before_its_second_step(device, caches):
    model = make_model("llama", device, num_hidden_layers=2)
    cache = caches(model, 64, config=make_config("llama", num_hidden_layers=3))
    with pytest.raises(ValueError, match=r"updated 2 of this cache's 3 layers"):
        greedy(model, prompt(5, device), cache, 3)
    assert cache.seq_length == 5, "the refused step changed the cache"


@pytest.mark.invariant(6)
@pytest.mark.parametrize(
    "mismatch, expected",
    [
        ({"num_key_value_heads": 1}, r"1 kv heads"),
        ({"head_dim": 32}, r"head_dim 32"),
        ({"batch_size": 2}, r"batch_size 2"),
        ({"dtype": torch.float64}, r"torch\.float64"),
    ],
    ids=["kv-heads", "head-dim", "batch", "dtype"],
)
def test_head_geometry_batch_or_dtype_unlike_the_model_is_refused(device, caches, mismatch, expected):
    model = make_model("llama", device)
    arguments = {key: value for key, value in mismatch.items() if key in ("batch_size", "dtype")}
    in_config = {key: value for key, value in mismatch.items() if key not in arguments}
    if in_config:
        arguments["config"] = make_config("llama", **in_config)
    cache = caches(model, 64, **arguments)
    with pytest.raises(ValueError, match=expected):
        greedy(model, prompt(5, device), cache, 3)
    assert cache.seq_length == 0 and cache.kv_cache.num_committed_blocks == 1, "the refused step changed the cache"


@pytest.mark.invariant(6)
def test_a_sequence_past_max_cache_len_is_refused_and_changes_nothing(device, caches):
    model = make_model("llama", device)
    cache = caches(model, 20, margin=4)
    with pytest.raises(ValueError, match=r"a sequence of 21 tokens \(20 cached and 1 new\) is past this cache's "
                                         r"max_cache_len 20"):
        greedy(model, prompt(10, device), cache, 20)
    assert cache.seq_length == 20 and int(cache.get_seq_length()) == 20
    fresh = caches(model, 20)
    with pytest.raises(ValueError, match=r"a sequence of 24 tokens \(0 cached and 24 new\)"):
        greedy(model, prompt(24, device), fresh, 1)
    assert fresh.seq_length == 0 and fresh.kv_cache.num_committed_blocks == 1, "the refused prefill changed the cache"


@pytest.mark.invariant(6)
def test_use_after_free_is_refused(device, caches, usage):
    model = make_model("llama", device)
    warm_up(model, caches)
    baseline = usage.read_outside_torch()
    cache = caches(model, 64)
    greedy(model, prompt(5, device), cache, 3)
    cache.free()
    assert cache.is_freed and cache.physical_bytes == 0 and cache.committed_bytes == 0
    check_usage_matches(usage, baseline, [])
    states = torch.zeros(1, 2, 1, 16, device=device)
    for call in (lambda: greedy(model, prompt(5, device), cache, 3), lambda: cache.update(states, states, 1),
                 cache.make_room, cache.release_physical, cache.recommit, cache.reset):
        with pytest.raises(StateError, match="freed"):
            call()
    cache.free()  # idempotent


@pytest.mark.invariant(6)
def test_bad_arguments_and_unsupported_operations_are_refused(device, caches):
    model = make_model("llama", device)
    config = model.config
    for arguments, expected in [
        ({"max_cache_len": 0}, r"max_cache_len must be an int >= 1 \(tokens\), got 0"),
        ({"batch_size": True}, r"batch_size must be an int >= 1 \(sequences\), got True"),
        ({"margin": -1}, r"margin must be an int >= 0 \(tokens\), got -1"),
        ({"block_size": 0}, r"block_size must be an int >= 1 \(tokens\), got 0"),
        ({"dtype": torch.int64}, r"dtype must be a floating-point torch.dtype \(the model's\), got torch.int64"),
        ({"config": {"num_hidden_layers": 2}}, r"config must be the model's transformers config"),
    ]:
        with pytest.raises(ValueError, match=expected):
            ExtensibleCache(**{"config": config, "max_cache_len": 64, "device": device, **arguments})
    cache = caches(model, 64)
    states = torch.zeros(1, 2, 1, 16, device=device)
    for layer_idx in (2, -1, True):
        with pytest.raises(ValueError, match=rf"layer_idx {layer_idx!r} is not one of this cache's 2 layers"):
            cache.update(states, states, layer_idx)
    with pytest.raises(ValueError, match=r"layer 0: key_states must be a 4-D tensor .* shape \(2, 1, 16\)"):
        cache.update(states[0], states, 0)
    with pytest.raises(ValueError, match=r"layer 0: key_states hold 1 tokens, value_states 2"):
        cache.update(states, torch.zeros(1, 2, 2, 16, device=device), 0)
    with pytest.raises(ValueError, match=r"num_tokens must be an int >= 0 \(tokens per sequence\), got -1"):
        cache.make_room(-1)
    with pytest.raises(StateError, match="recommit.*the cache is live"):
        cache.recommit()
    with pytest.raises(NotImplementedError, match="reorder its batch"):
        cache.reorder_cache(torch.zeros(1, dtype=torch.int64))
    assert cache.seq_length == 0 and cache.kv_cache.num_committed_blocks == 1


# -- CUDA graphs ----------------------------------------------------------------------
def captured_decode(model, cache, token):
    """Warm up and capture one decode step (`token`, (1, 1), the last token
    of the cache's sequence) as a CUDA graph: (graph, its input, its logits).
    The warm-up is a real step; the capture writes nothing."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.no_grad():
        warm = model(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1]
    torch.cuda.current_stream().wait_stream(stream)
    static = warm.argmax(-1, keepdim=True)
    counted = (cache.seq_length, int(cache.get_seq_length()))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        logits = model(input_ids=static, past_key_values=cache, use_cache=True).logits[:, -1]
    assert (cache.seq_length, int(cache.get_seq_length())) == counted, "the capture counted tokens it did not write"
    return graph, static, logits, warm


def replay(graph, static, logits, cache, steps: int) -> list[torch.Tensor]:
    """`steps` greedy decode steps by replaying `graph`; the logits of each."""
    seen = []
    for _ in range(steps):
        cache.make_room(1)
        graph.replay()
        seen.append(logits.clone())
        static.copy_(logits.argmax(-1, keepdim=True))
    return seen


@pytest.mark.invariant(2)
@pytest.mark.cuda_graphs
def test_decode_graph_captured_before_growth_replays_after_growth_and_wake(caches):
    """A decode step captured while the first granule of every layer is the
    only one mapped, replayed until decode has mapped the next: the logits
    are DynamicCache's. After a sleep and a wake, a re-prefill and the same
    graph go on as DynamicCache does."""
    model = make_model("llama", "cuda", **WIDE)
    cache = caches(model, 1024, margin=8)
    ids = prompt(tokens_per_granule(cache) - 32, "cuda")
    expected = greedy(model, ids, DynamicCache(config=model.config), 40)[1]
    with torch.no_grad():
        first = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1]
    graph, static, logits, warm = captured_decode(model, cache, first.argmax(-1, keepdim=True))
    mapped_at_capture = cache.physical_bytes
    got = torch.stack([first, warm, *replay(graph, static, logits, cache, 38)])
    torch.testing.assert_close(got, expected, **LOGITS)
    assert cache.physical_bytes > mapped_at_capture, "decode mapped nothing after the capture"

    tokens = torch.cat([ids, got.argmax(-1).T], dim=1)
    cache.release_physical()
    cache.recommit()
    expected = greedy(model, tokens, DynamicCache(config=model.config), 12)[1]
    with torch.no_grad():
        first = model(input_ids=tokens, past_key_values=cache, use_cache=True).logits[:, -1]
    static.copy_(first.argmax(-1, keepdim=True))
    got = torch.stack([first, *replay(graph, static, logits, cache, 11)])
    torch.testing.assert_close(got, expected, **LOGITS)


@pytest.mark.invariant(2)
@pytest.mark.cuda_graphs
@pytest.mark.long
def test_compiled_generate_replays_its_graphs_across_growth(caches):
    """generate's own torch.compile (mode reduce-overhead: CUDA graphs) over
    an ExtensibleCache that commits a new granule during decode: tokens are
    those of eager DynamicCache."""
    model = make_model("llama", "cuda", **WIDE)
    cache = caches(model, 1024, margin=8)
    ids = prompt(tokens_per_granule(cache) - 32, "cuda")
    expected = greedy(model, ids, DynamicCache(config=model.config), 40)
    physical = []
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        past_key_values=cache,
        max_new_tokens=40,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        compile_config=transformers.CompileConfig(mode="reduce-overhead"),
        logits_processor=LogitsProcessorList([EachStep(lambda step: physical.append(cache.physical_bytes))]),
    )
    expect_same_generation((out.sequences, torch.stack(out.logits)), expected, "compiled")
    assert physical[-1] > physical[0], f"no granule was mapped during the compiled decode: {physical}"
