"""The cost model's collectives (hvd_sparse/plan/network.py) against hand-computed cases."""

from __future__ import annotations

import pytest

from hvd_sparse.comm.protocol import ALLGATHER, ALLREDUCE, BROADCAST, NEIGHBOURS
from hvd_sparse.plan import Network, parse_rate

# 1 Gbit/s = 125 MB/s; 10 us a message; 1 ms of software per collective.
NET = Network(bandwidth=1e9, latency=10e-6, overhead=1e-3)


def test_ring_allreduce_moves_two_n_minus_one_over_n_of_the_tensor():
    # 4 ranks, 100 MB: 2*3 latencies + 2*3/4 * 100e6 / 125e6 s + the overhead
    assert NET.seconds(ALLREDUCE, [100_000_000] * 4) == pytest.approx(1e-3 + 6 * 10e-6 + 1.2)


def test_tree_allreduce_pays_log_latencies_and_twice_the_message():
    tree = Network(bandwidth=1e9, latency=10e-6, allreduce="tree")
    # 16 ranks: 2*log2(16) = 8 latencies; 2 * 1 MB / 125 MB/s
    assert tree.seconds(ALLREDUCE, [1_000_000] * 16) == pytest.approx(8 * 10e-6 + 0.016)


def test_auto_takes_the_tree_for_small_messages_at_scale_and_the_ring_for_large_ones():
    auto = Network(bandwidth=1e9, latency=10e-6, allreduce="auto")
    # 1024 ranks, 1 KB: ring 2*1023 latencies; tree 2*10 latencies + 2 KB at 125 MB/s
    assert auto.seconds(ALLREDUCE, [1000] * 1024) == pytest.approx(20 * 10e-6 + 2000 / 125e6)
    # 4 ranks, 100 MB: the ring moves 3/2 of the tensor, the tree twice it
    assert auto.seconds(ALLREDUCE, [100_000_000] * 4) == pytest.approx(6 * 10e-6 + 1.2)


def test_allgather_of_unequal_parts_waits_for_the_rank_receiving_most():
    # parts of 1, 2, 3 and 4 MB: rank 0 receives 9 MB -> 3 latencies + 9e6 / 125e6
    assert NET.seconds(ALLGATHER, [1_000_000, 2_000_000, 3_000_000, 4_000_000]) == pytest.approx(
        1e-3 + 3 * 10e-6 + 0.072)


def test_broadcast_and_neighbour_exchange():
    # 8 ranks: 3 tree levels, the message once
    assert NET.seconds(BROADCAST, [125_000] * 8) == pytest.approx(1e-3 + 3 * 10e-6 + 1e-3)
    # both neighbours over one port: twice the message
    assert NET.seconds(NEIGHBOURS, [125_000] * 8) == pytest.approx(1e-3 + 10e-6 + 2e-3)


def test_one_rank_costs_nothing_and_bad_input_is_refused():
    assert NET.seconds(ALLREDUCE, [10**9]) == 0.0
    with pytest.raises(ValueError, match="unknown collective"):
        NET.seconds("alltoall", [1, 1])
    with pytest.raises(ValueError, match="bandwidth must be > 0"):
        Network(bandwidth=0)
    with pytest.raises(ValueError, match="allreduce must be one of"):
        Network(bandwidth=1e9, allreduce="butterfly")


def test_rates_parse():
    assert parse_rate("25gbit") == 25e9 and parse_rate("100mbit") == 1e8 and parse_rate(3.5) == 3.5
    assert Network(parse_rate("10gbit")).describe()["bandwidth_gbit_s"] == 10.0


def test_a_calibrated_op_uses_its_own_fixed_cost_and_bandwidth():
    net = Network(bandwidth=1e9, latency=0.0, overhead=1e-3, per_op={ALLGATHER: (2e-3, 0.5e9)})
    # 2 ranks of 1 MB: the allgather at 62.5 MB/s, the allreduce at the default 125 MB/s
    assert net.seconds(ALLGATHER, [1_000_000] * 2) == pytest.approx(2e-3 + 0.016)
    assert net.seconds(ALLREDUCE, [1_000_000] * 2) == pytest.approx(1e-3 + 0.008)
