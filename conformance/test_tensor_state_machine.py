"""A Hypothesis state machine drives a real ExtensibleTensor beside a plain
Python model of what it must hold, and checks every invariant after each step."""

from __future__ import annotations

import torch
from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from extkv import ExtensibleTensor
from extkv.testing.checks import check_readback_matches_bookkeeping, check_usage_matches
from extkv.usage import UsageProbe
from extkv.vmm import driver_for


class TensorModel:
    """What the tensor must hold: committed bytes per segment and which
    granules are mapped, in plain Python."""

    def __init__(self, capacities: list[int], granule: int):
        self.capacities = capacities
        self.granule = granule
        self.offsets = [sum(capacities[:i]) for i in range(len(capacities))]
        self.contents = [bytearray() for _ in capacities]
        self.mapped: set[int] = set()

    def grow(self, sizes: list[int]) -> None:
        for i, size in enumerate(sizes):
            if size > len(self.contents[i]):
                self.mapped |= set(range(self.offsets[i] // self.granule, -(-(self.offsets[i] + size) // self.granule)))
                self.contents[i].extend(bytes(size - len(self.contents[i])))

    def release(self) -> None:
        self.contents = [bytearray() for _ in self.capacities]
        self.mapped = set()


def tensor_machine(device: torch.device, probe: UsageProbe):
    granule = driver_for(device).granularity
    capacities = [granule * 5 // 2, granule * 3 // 2, 3 * granule]

    class ExtensibleTensorMachine(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            self.baseline = probe.read_outside_torch()
            self.tensor = ExtensibleTensor(sum(capacities), device=device, segment_capacities=capacities)
            self.model = TensorModel(capacities, granule)
            self.base = self.tensor.base

        @rule(data=st.data())
        def grow(self, data):
            sizes = [
                data.draw(st.integers(len(content), capacity), label=f"size[{i}]")
                for i, (content, capacity) in enumerate(zip(self.model.contents, capacities))
            ]
            note(f"resize_segments_({sizes}, zero_new=True)")
            self.tensor.resize_segments_(sizes, zero_new=True)
            self.model.grow(sizes)

        @precondition(lambda self: any(self.model.contents))
        @rule(data=st.data(), value=st.integers(1, 255))
        def write(self, data, value):
            segment = data.draw(st.sampled_from([i for i, c in enumerate(self.model.contents) if c]), label="segment")
            length = len(self.model.contents[segment])
            start = data.draw(st.integers(0, length - 1), label="start")
            end = data.draw(st.integers(start + 1, length), label="end")
            note(f"segment_view({segment})[{start}:{end}].fill_({value})")
            self.tensor.segment_view(segment)[start:end].fill_(value)
            self.model.contents[segment][start:end] = bytes([value]) * (end - start)

        @rule()
        def release(self):
            note("release_physical()")
            self.tensor.release_physical()
            self.model.release()

        @invariant()
        def holds_everything_the_model_says(self):
            check_sizes(self)
            check_physical_bytes(self)
            check_addresses(self)
            check_contents(self)
            check_readback_matches_bookkeeping(self.tensor)
            check_usage_matches(probe, self.baseline, [self.tensor])

        def teardown(self):
            self.tensor.free()

    return ExtensibleTensorMachine


def check_sizes(machine) -> None:
    assert machine.tensor.segment_sizes == [len(c) for c in machine.model.contents]


def check_physical_bytes(machine) -> None:
    assert machine.tensor.physical_bytes == len(machine.model.mapped) * machine.model.granule


def check_addresses(machine) -> None:
    assert machine.tensor.base == machine.base
    for i, offset in enumerate(machine.model.offsets):
        view = machine.tensor.segment_view(i)
        if view.numel():
            assert view.data_ptr() == machine.base + offset


def check_contents(machine) -> None:
    for i, content in enumerate(machine.model.contents):
        expected = torch.frombuffer(bytearray(content), dtype=torch.uint8) if content else torch.empty(0, dtype=torch.uint8)
        actual = machine.tensor.segment_view(i).cpu()
        assert torch.equal(actual, expected), f"segment {i} differs from the model"


def test_tensor_state_machine(device, usage):
    run_state_machine_as_test(tensor_machine(device, usage))
