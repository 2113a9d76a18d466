"""Where the connector's threads go (`workers.cpus.thread_cpus`), from plain host values."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from workers.cpus import AUTO, INHERIT, Host, PlacementError, format_cpu_list, parse_cpu_list, thread_cpus

# A 2-node host of 8 CPUs a node, as vLLM's auto binding leaves it for TP 2 in a P/D
# setup: each rank's OpenMP threads on its node but for the node's last two cores (one
# kept for the engine's scheduler, one for the KV connector).
NODES = (frozenset(range(0, 8)), frozenset(range(8, 16)))
ALL = NODES[0] | NODES[1]


def host(bound: set[int], *, allowed: frozenset[int] = ALL, omp_bind: str = AUTO, omp_placed: bool = True) -> Host:
    return Host(allowed=allowed, bound=frozenset(bound), nodes=NODES, omp_bind=omp_bind, omp_placed=omp_placed)


def test_auto_takes_the_cores_vllm_kept_out_of_this_ranks_threads_on_its_own_node() -> None:
    assert thread_cpus(AUTO, host(set(range(0, 6)))).cpus == {6, 7}
    assert thread_cpus(AUTO, host(set(range(8, 14)))).cpus == {14, 15}  # rank 1: never rank 0's cores


def test_auto_with_each_openmp_thread_bound_to_one_core_counts_them_all() -> None:
    """Intel's or GNU's OpenMP preloaded bind each thread to one core: the main thread's
    core alone would leave the other threads' cores looking free."""
    assert thread_cpus(AUTO, host({0, 1, 2, 3, 4, 5})).cpus == {6, 7}


@pytest.mark.parametrize("bound, why", [
    (set(range(16)), "nothing bound: no core is left over"),
    (set(range(8)), "the whole node computes: the other node is another rank's"),
])
def test_auto_inherits_where_nothing_was_kept(bound: set[int], why: str) -> None:
    assert thread_cpus(AUTO, host(bound)).cpus is None, why


@pytest.mark.parametrize("omp_bind", ["nobind", "0-5|8-13"])
def test_auto_moves_nothing_unless_vllm_chose_the_cores_itself(omp_bind: str) -> None:
    """With cores named by hand another instance may compute on any core left out; with
    nobind nothing is bound."""
    placement = thread_cpus(AUTO, host(set(range(0, 6)), omp_bind=omp_bind))
    assert placement.cpus is None
    assert "VLLM_CPU_OMP_THREADS_BIND" in placement.reason


def test_auto_leaves_a_binding_that_openmp_was_not_told_of_alone() -> None:
    """`taskset` on the worker alone: its parent may use more CPUs, but they were not
    left for the connector, and the user's choice stands."""
    placement = thread_cpus(AUTO, host(set(range(0, 6)), omp_placed=False))
    assert placement.cpus is None
    assert "OMP_PLACES" in placement.reason


def test_a_list_is_taken_as_given_and_inherit_moves_nothing() -> None:
    assert thread_cpus(frozenset({15}), host(set(range(0, 6)))).cpus == {15}
    assert thread_cpus(INHERIT, host(set(range(0, 6)))).cpus is None


def test_a_list_outside_the_instances_cpus_is_refused_naming_both() -> None:
    with pytest.raises(PlacementError, match=r"names CPU 16-17, which this worker may not run on; name CPUs of 0-15"):
        thread_cpus(frozenset({15, 16, 17}), host(set(range(0, 6))))


@pytest.mark.parametrize("text, cpus", [("7", {7}), ("0-3,7", {0, 1, 2, 3, 7}), (" 6-7, 14 ", {6, 7, 14})])
def test_cpu_lists_parse_as_linux_writes_them(text: str, cpus: set[int]) -> None:
    assert parse_cpu_list(text) == cpus


@pytest.mark.parametrize("text", ["", "a", "3-1", "1,,2", "-1", "0-70000"])
def test_a_bad_cpu_list_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        parse_cpu_list(text)


@given(st.sets(st.integers(0, 300), min_size=1))
def test_a_cpu_list_round_trips(cpus: set[int]) -> None:
    assert parse_cpu_list(format_cpu_list(cpus)) == cpus


@given(st.data())
def test_auto_never_puts_the_threads_on_the_workers_cores_nor_off_its_nodes(data: st.DataObject) -> None:
    n = data.draw(st.integers(1, 24), label="cpus")
    cut = sorted(data.draw(st.sets(st.integers(1, n - 1), max_size=3), label="node starts")) if n > 1 else []
    edges = [0, *cut, n]
    nodes = tuple(frozenset(range(a, b)) for a, b in zip(edges, edges[1:]))
    every = frozenset(range(n))
    allowed = data.draw(st.sets(st.sampled_from(sorted(every)), min_size=1), label="allowed")
    bound = data.draw(st.sets(st.sampled_from(sorted(allowed)), min_size=1), label="bound")
    placement = thread_cpus(AUTO, Host(allowed=frozenset(allowed), bound=frozenset(bound), nodes=nodes,
                                       omp_placed=True))
    if placement.cpus is None:
        # nothing left on the worker's nodes
        assert not {c for node in nodes if node & bound for c in node} & (allowed - bound)
    else:
        assert placement.cpus and placement.cpus <= allowed - bound
        assert all(any(c in node and node & bound for node in nodes) for c in placement.cpus)
