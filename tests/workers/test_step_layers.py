"""`StepLayers`: how a block send posted during P's forward pass is launched as the step's
layers are gathered. Every launch must wait for an event recorded after the gathers of
every layer it copies (the seed's invariant, on the GPU), a send must end up launched
whole once the step gathered every layer, and the forward pass's thread must never
see a launch's error. On a GPU, tests/gpu/test_connector_nccl.py runs the same with real
events, copies and an unsafe twin; here the events are tokens of what the compute
stream had gathered when each was recorded, and an event has run once the GPU ran every
gather in it."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from workers.gpu_staging import StepLayers, layer_groups


class Stream:
    """The compute stream: which layers' gathers are enqueued on it so far, and which of
    them the GPU has run (none unless a test says so: the host runs ahead)."""

    def __init__(self) -> None:
        self.gathered: set[int] = set()
        self.ran: set[int] = set()

    def has_run(self, event: frozenset[int]) -> bool:
        return event <= self.ran


def record(stream: Stream) -> frozenset[int]:
    """An event on `stream`: it completes after every gather enqueued before it."""
    return frozenset(stream.gathered)


def step_on(num_layers: int) -> tuple[StepLayers, Stream]:
    stream = Stream()
    return StepLayers(num_layers, record=record, ran=stream.has_run), stream


class Send:
    """A block send as `IpcCommunicator` launches it: layers in order, none twice."""

    def __init__(self, fail: bool = False) -> None:
        self.launches: list[tuple[int, frozenset[int] | None]] = []
        self.launched = 0
        self.fail = fail

    def launch(self, layers: int, after: frozenset[int] | None) -> None:
        if self.fail:
            raise RuntimeError("the launch failed")
        if layers <= self.launched:
            return
        self.launches.append((layers, after))
        self.launched = layers


def gather(step: StepLayers, stream: Stream, layer: int) -> None:
    stream.gathered.add(layer)
    step.gathered(layer, stream)


def test_the_groups_halve_towards_the_last_layer() -> None:
    assert layer_groups(32) == [16, 24, 28, 30, 31, 32]
    assert layer_groups(2) == [1, 2]
    assert layer_groups(1) == [1]
    assert layer_groups(80)[-3:] == [78, 79, 80] and len(layer_groups(80)) == 8


@given(num_layers=st.integers(1, 40), data=st.data())
def test_every_launch_waits_for_the_gathers_of_the_layers_it_copies(num_layers: int, data: st.DataObject) -> None:
    """Layers gathered in any order (vLLM saves them in order, but nothing here relies on
    it), sends that start following at any point: each launch's event covers every layer
    it copies, each send is launched whole once every layer is gathered, in at most one
    launch per group."""
    order = data.draw(st.permutations(range(num_layers)))
    joins = data.draw(st.lists(st.integers(0, num_layers), min_size=1, max_size=4))  # after that many gathers
    step, stream = step_on(num_layers)
    sends: list[Send] = []
    for k in range(num_layers + 1):
        # the GPU runs the gathers in stream order, behind the host
        stream.ran.update(order[: data.draw(st.integers(len(stream.ran), k))])
        for _ in range(joins.count(k)):
            sends.append(Send())
            step.follow(sends[-1])
        if k < num_layers:
            gather(step, stream, order[k])
    groups = len(layer_groups(num_layers))
    for send in sends:
        assert send.launched == num_layers, "a send was not launched whole once every layer was gathered"
        assert len(send.launches) <= groups
        for layers, after in send.launches:
            assert after is not None and set(range(layers)) <= after, \
                f"a launch of layers [0, {layers}) waits for the gathers of {sorted(after or ())} only"


def test_a_send_that_follows_late_still_copies_each_group_behind_its_own_gathers() -> None:
    """The host runs ahead of the GPU: when the Go comes, every layer's gathers may be
    enqueued while few have run. Each group is then launched behind its own event, so
    the copy still moves as the forward pass computes, not all of it after."""
    step, stream = step_on(32)
    for layer in range(20):
        gather(step, stream, layer)
    send = Send()
    step.follow(send)
    assert [(layers, len(after or ())) for layers, after in send.launches] == [(16, 16)]
    for layer in range(20, 32):
        gather(step, stream, layer)
    late = Send()
    step.follow(late)
    for s in (send, late):
        assert [(layers, len(after or ())) for layers, after in s.launches] == [
            (16, 16), (24, 24), (28, 28), (30, 30), (31, 31), (32, 32)]


def test_a_send_that_follows_once_the_gpu_ran_the_gathers_is_one_launch() -> None:
    """Without a prefill to overlap, the send starts after the GPU ran every gather:
    one launch, not one a group (each is host time on the client's loop). Groups not run
    yet are still launched each behind its own event."""
    step, stream = step_on(32)
    for layer in range(32):
        gather(step, stream, layer)
    stream.ran.update(range(32))
    send = Send()
    step.follow(send)
    assert [(layers, len(after or ())) for layers, after in send.launches] == [(32, 32)]
    step, stream = step_on(32)
    for layer in range(32):
        gather(step, stream, layer)
    stream.ran.update(range(25))  # up to the second group's end (24), not the third's (28)
    send = Send()
    step.follow(send)
    assert [(layers, len(after or ())) for layers, after in send.launches] == [
        (24, 24), (28, 28), (30, 30), (31, 31), (32, 32)]


def test_a_step_that_missed_a_layer_never_launches_its_sends_whole() -> None:
    """Its transfers are aborted (their sends end with the communicator); no launch may
    copy the missing layer's staging, which nothing wrote."""
    step, stream = step_on(4)
    send = Send()
    step.follow(send)
    for layer in (0, 1, 3):
        gather(step, stream, layer)
    step.end()
    assert send.launched == 2
    gather(step, stream, 2)  # a late gather after the step ended launches nothing more
    assert send.launched == 2


def test_a_launch_that_fails_in_the_forward_pass_is_not_raised_into_it() -> None:
    step, stream = step_on(2)
    broken, fine = Send(fail=True), Send()
    step.follow(broken)
    step.follow(fine)
    gather(step, stream, 0)
    gather(step, stream, 1)
    assert fine.launched == 2
    with pytest.raises(RuntimeError):  # following is the poster's call: its error is its own
        step.follow(Send(fail=True))
