"""Rank agreement (extkv.ranks) between real processes: two ranks over gloo on
the host, and two ranks over NCCL with one GPU each. Every rank is a process
of its own (forked from multiprocessing's fork server, which imports torch
once and never touches CUDA), with the test process's environment, that joins
a process group through a rendezvous file, reports what it saw through a
queue, frees its cache and destroys the group; the test fails, rather than
hangs, when a rank stops answering. The single-process path and
bad input run in the test process itself."""

from __future__ import annotations

import logging
import os
import queue
import re
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from extkv import vmm
from extkv.cache import ExtensibleKVCache
from extkv.layout import FullAttentionSpec, KVCacheGroupSpec, KVCacheLayout, build_kv_cache_config
from extkv.ranks import agree_on_committable_blocks, min_over_ranks
from extkv.testing.children import fork_server
from extkv.testing.readings import InjectedReadingsDriver
from extkv.vmm import driver_for

WORLD_SIZE = 2
#: Whole-run deadline for the spawned ranks; pytest-timeout's is the backstop.
#: Nets against a hung rank only: on a busy machine two processes importing
#: torch and meeting in a rendezvous may take minutes.
RANKS_DEADLINE_S = 240
#: How long a rank waits in rendezvous or a collective before giving up.
COLLECTIVE_TIMEOUT_S = 180
PAGE = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.float16)  # 64 KiB pages
#: Explicit per-rank values for `min_over_ranks`: (value on rank 0, value on rank 1).
EXPLICIT_VALUES = [(7, 3), (0, 5), ((1 << 40) + 1, 1 << 40), (9, 9)]
#: Warmup headroom per rank as a share of the device's free memory: different
#: shares make the ranks' `committable_blocks()` differ, and both stay > 0.
HEADROOM_SHARE = (0.25, 0.5)
#: The free memory a rank's cache reads, as a share of the device's total.
FREE_SHARE = 0.5


def config_larger_than(total_bytes: int, layout: KVCacheLayout = KVCacheLayout.LBHNC):
    """A two-layer config whose capacity exceeds `total_bytes`, so that
    `committable_blocks` is bounded by free memory, never by capacity. Only
    address space is reserved; nothing is committed."""
    groups = [KVCacheGroupSpec(layer_names=["attn.0", "attn.1"], kv_cache_spec=PAGE)]
    bytes_per_block = 2 * PAGE.page_size_bytes
    return build_kv_cache_config(groups, total_bytes // bytes_per_block + 1024, layout)


def cache_reading_set_free_memory(device: torch.device) -> tuple[ExtensibleKVCache, int]:
    """A cache larger than the device, over its real driver whose free memory
    reads FREE_SHARE of the total (InjectedReadingsDriver), and that amount:
    what other processes take or free moves no rank's count."""
    real = driver_for(device)
    _, total_memory = real.memory_info()
    free_memory = int(total_memory * FREE_SHARE)
    driver = InjectedReadingsDriver(real, free=free_memory, total=total_memory)
    return ExtensibleKVCache(config_larger_than(total_memory), driver, KVCacheLayout.LBHNC), free_memory


def record_committable_blocks(kv_cache: ExtensibleKVCache) -> list[int]:
    """Make `kv_cache.committable_blocks()` record each answer in the returned
    list, so the test compares the agreement against the very value each
    rank read."""
    seen = []
    read_committable_blocks = kv_cache.committable_blocks

    def recording_committable_blocks() -> int:
        seen.append(read_committable_blocks())
        return seen[-1]

    kv_cache.committable_blocks = recording_committable_blocks
    return seen


# -- what each spawned rank runs ------------------------------------------------
def explicit_values_on_rank(rank: int, device: torch.device) -> dict:
    """`min_over_ranks` of known per-rank values, on the world and on a
    subgroup that holds rank 0 only."""
    agreed = [min_over_ranks(values[rank]) for values in EXPLICIT_VALUES]
    only_rank_0 = dist.new_group([0])
    if rank == 0:
        alone = min_over_ranks(11, group=only_rank_0)
        non_member_error = None
    else:
        alone = None
        try:
            min_over_ranks(11, group=only_rank_0)
            non_member_error = "no error"
        except ValueError as error:
            non_member_error = str(error)
    report = {"agreed": agreed, "alone": alone, "non_member_error": non_member_error}
    if device.type == "cuda":
        # NCCL reduces CUDA tensors only: an explicit CPU device is refused.
        try:
            min_over_ranks(1, device="cpu")
            report["cpu_device_error"] = "no error"
        except ValueError as error:
            report["cpu_device_error"] = str(error)
        # Keep the ranks in step: the refused call ran no collective.
        min_over_ranks(0)
    return report


def committable_blocks_on_rank(rank: int, device: torch.device) -> dict:
    """`agree_on_committable_blocks` on a cache whose headroom differs per rank;
    records the local count the agreement itself read."""
    kv_cache, free_memory = cache_reading_set_free_memory(device)
    try:
        kv_cache.reserved_headroom_bytes = int(free_memory * HEADROOM_SHARE[rank])
        seen_locally = record_committable_blocks(kv_cache)
        agreed = agree_on_committable_blocks(kv_cache)
        report = {
            "local": seen_locally,
            "agreed": agreed,
            "stored": kv_cache.warmup_committable_blocks,
            "capacity": kv_cache.capacity_blocks,
            "committed": kv_cache.num_committed_blocks,
            "physical_bytes": kv_cache.physical_bytes,
        }
    finally:
        kv_cache.free()
    report["live_reservations_after_free"] = {kind: n for kind, n in vmm.live_reservations.items() if n}
    return report


SCENARIOS = {"explicit_values": explicit_values_on_rank, "committable_blocks": committable_blocks_on_rank}


def rank_main(rank: int, backend: str, init_method: str, scenario: str, results, environment: dict[str, str]) -> None:
    """Entry point of one rank: take the test process's `environment` (the
    fork server's is the one it started with), join, run `scenario`, leave,
    report."""
    try:
        os.environ.clear()
        os.environ.update(environment)
        # Both ranks live on this host; loopback needs no routable hostname.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
        if backend == "nccl":
            assert os.environ.get("NCCL_NVLS_ENABLE") == "0", "NVLink multicast must stay off"
            device = torch.device("cuda", rank)
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=rank,
            world_size=WORLD_SIZE,
            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
            device_id=device if device.type == "cuda" else None,
        )
        try:
            report = SCENARIOS[scenario](rank, device)
        finally:
            dist.destroy_process_group()
        results.put({"rank": rank, "report": report})
    except BaseException:
        results.put({"rank": rank, "error": traceback.format_exc()})
        raise


# -- the test process's side ------------------------------------------------------
def run_ranks(tmp_path, backend: str, scenario: str) -> list[dict]:
    """Start WORLD_SIZE ranks running `scenario`; their reports, by rank.
    Fails with every rank's traceback, or with which ranks hung."""
    # Ranks are children of the fork server (extkv.testing.children): it
    # imports torch (and with it torch.distributed) once and leaves CUDA to
    # each rank, as a spawn does.
    context = fork_server()
    results = context.Queue()
    init_method = f"file://{tmp_path / f'rendezvous-{backend}-{scenario}'}"
    environment = dict(os.environ)
    ranks = [
        context.Process(target=rank_main, args=(rank, backend, init_method, scenario, results, environment), daemon=True)
        for rank in range(WORLD_SIZE)
    ]
    for process in ranks:
        process.start()
    deadline = time.monotonic() + RANKS_DEADLINE_S
    answers: dict[int, dict] = {}
    try:
        while len(answers) < WORLD_SIZE:
            try:
                answer = results.get(timeout=max(deadline - time.monotonic(), 0.1))
            except queue.Empty:
                silent = sorted(set(range(WORLD_SIZE)) - set(answers))
                pytest.fail(f"{backend} ranks {silent} gave no answer within {RANKS_DEADLINE_S} s (hung?)")
            answers[answer["rank"]] = answer
        for process in ranks:
            process.join(timeout=max(deadline - time.monotonic(), 0.1))
    finally:
        for process in ranks:
            if process.is_alive():
                process.kill()
                process.join()
    errors = [f"rank {rank}:\n{answer['error']}" for rank, answer in sorted(answers.items()) if "error" in answer]
    if errors:
        pytest.fail(f"{backend} {scenario} failed on a rank:\n" + "\n".join(errors), pytrace=False)
    exit_codes = [process.exitcode for process in ranks]
    assert exit_codes == [0] * WORLD_SIZE, f"{backend} ranks exited with {exit_codes}"
    return [answers[rank]["report"] for rank in range(WORLD_SIZE)]


def check_explicit_values(reports: list[dict], backend: str) -> None:
    expected = [min(values) for values in EXPLICIT_VALUES]
    for rank, report in enumerate(reports):
        assert report["agreed"] == expected, f"rank {rank}"
    assert reports[0]["alone"] == 11
    assert "rank 1 is not a member" in reports[1]["non_member_error"]
    if backend == "nccl":
        for report in reports:
            assert "reduces CUDA tensors only" in report["cpu_device_error"]


def check_committable_blocks(reports: list[dict]) -> None:
    locals_ = []
    for rank, report in enumerate(reports):
        assert len(report["local"]) == 1, f"rank {rank} read committable_blocks() {len(report['local'])} times"
        locals_.append(report["local"][0])
        assert report["committed"] == 0 and report["physical_bytes"] == 0, "agreement must commit nothing"
        assert report["live_reservations_after_free"] == {}, f"rank {rank} leaked a reservation"
    assert all(value > 0 for value in locals_), f"local counts {locals_} must be > 0 to discriminate"
    assert all(value < report["capacity"] for value, report in zip(locals_, reports)), "capacity bound them"
    # The larger headroom leaves fewer blocks: the ranks really disagreed.
    assert locals_[1] < locals_[0], f"local counts {locals_}"
    for rank, report in enumerate(reports):
        assert report["agreed"] == min(locals_), f"rank {rank}: agreed {report['agreed']}, locals {locals_}"
        assert report["stored"] == report["agreed"], f"rank {rank} stored {report['stored']}"


@pytest.mark.invariant(6)
@pytest.mark.timeout(300)
@pytest.mark.long
def test_gloo_min_over_ranks_of_explicit_values(tmp_path):
    check_explicit_values(run_ranks(tmp_path, "gloo", "explicit_values"), "gloo")


@pytest.mark.invariant(5)
@pytest.mark.timeout(300)
def test_gloo_ranks_agree_on_committable_blocks(tmp_path):
    check_committable_blocks(run_ranks(tmp_path, "gloo", "committable_blocks"))


@pytest.fixture
def nccl_environment(monkeypatch):
    """Ranks take the test process's environment: NVLink multicast stays off."""
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")


@pytest.mark.invariant(6)
@pytest.mark.multi_gpu(2)
@pytest.mark.timeout(300)
def test_nccl_min_over_ranks_of_explicit_values(tmp_path, nccl_environment):
    check_explicit_values(run_ranks(tmp_path, "nccl", "explicit_values"), "nccl")


@pytest.mark.invariant(5)
@pytest.mark.multi_gpu(2)
@pytest.mark.timeout(300)
def test_nccl_ranks_agree_on_committable_blocks(tmp_path, nccl_environment):
    check_committable_blocks(run_ranks(tmp_path, "nccl", "committable_blocks"))


# -- one process, no process group ----------------------------------------------
@pytest.mark.invariant(6)
def test_single_rank_min_is_the_value():
    assert not dist.is_initialized()
    for value in (0, 1, 12345, (1 << 63) - 1):
        assert min_over_ranks(value) == value


@pytest.mark.invariant(5)
def test_single_rank_agrees_with_itself(device, caplog):
    assert not dist.is_initialized()
    kv_cache, _ = cache_reading_set_free_memory(device)
    try:
        seen_locally = record_committable_blocks(kv_cache)
        with caplog.at_level(logging.INFO, logger="extkv.ranks"):
            agreed = agree_on_committable_blocks(kv_cache)
        assert seen_locally == [agreed] and agreed > 0
        assert kv_cache.warmup_committable_blocks == agreed
        assert kv_cache.num_committed_blocks == 0 and kv_cache.physical_bytes == 0
        assert f"{agreed} KV cache blocks committable" in caplog.text
    finally:
        kv_cache.free()


@pytest.mark.invariant(6)
@pytest.mark.parametrize("value", [-1, -(1 << 40), 1.0, 2.5, True, False, "3", None, 1 << 63], ids=repr)
def test_min_over_ranks_rejects_bad_values(value):
    with pytest.raises(ValueError, match=re.escape(f"got {value!r}")):
        min_over_ranks(value)


@pytest.mark.invariant(6)
@pytest.mark.parametrize("not_a_cache", [None, 5, "cache"], ids=repr)
def test_agree_rejects_what_is_not_a_cache(not_a_cache):
    with pytest.raises(ValueError, match=re.escape(f"kv_cache must be an ExtensibleKVCache, got {not_a_cache!r}")):
        agree_on_committable_blocks(not_a_cache)
