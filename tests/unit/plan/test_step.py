"""The step's critical path (hvd_sparse/plan/step.py): a whole-model bucket waits for the end of
the backward pass; per-tensor buckets overlap their collectives with it."""

from __future__ import annotations

import pytest

from hvd_sparse.comm.protocol import ALLREDUCE
from hvd_sparse.plan import BucketTraffic, ComputeProfile, Network, SelectionCost, Transfer, step_time

# 8 Mbit/s = 1 MB/s, no latency: an allreduce of B bytes at 2 ranks takes B / 1e6 seconds.
NET = Network(bandwidth=8e6, latency=0.0)


def bucket(name: str, members: tuple[int, ...], nbytes: int, scanned: int = 0) -> BucketTraffic:
    return BucketTraffic(name, members, 1000, scanned, ((Transfer(ALLREDUCE, (nbytes,) * 2),),))


def test_one_bucket_of_the_whole_model_does_not_overlap():
    profile = ComputeProfile(forward=1.0, backward=(1.0, 1.0, 1.0), update=0.5)
    step = step_time(profile, [bucket("model", (0, 1, 2), 2_000_000)], NET)
    assert step.total == pytest.approx(1.0 + 3.0 + 2.0 + 0.5)
    assert step.exposed == pytest.approx(2.0) and step.comm == pytest.approx(2.0)


def test_per_tensor_buckets_overlap_with_the_backward_pass():
    """Tensor 2 is ready at 1 s, its 1.5 s allreduce runs to 2.5 s; tensor 1 is ready at 2 s and
    waits for the channel: 2.5 -> 4.0; tensor 0 is ready at 3 s and waits: 4.0 -> 5.5."""
    profile = ComputeProfile(forward=0.0, backward=(1.0, 1.0, 1.0))
    traffic = [bucket(f"t{i}", (i,), 1_500_000) for i in range(3)]
    step = step_time(profile, traffic, NET)
    assert step.total == pytest.approx(5.5)
    assert step.exposed == pytest.approx(2.5)   # 4.5 s of communication, 2 hidden


def test_selection_runs_in_the_hooks_and_delays_what_follows():
    """Each bucket's selection (1000 entries at 1 ms + its scan at 1 ms) lengthens the backward
    pass by 2 s and makes its collective start 2 s later."""
    profile = ComputeProfile(forward=0.0, backward=(1.0, 1.0))
    traffic = [bucket("t1", (1,), 500_000, scanned=1000), bucket("t0", (0,), 500_000, scanned=1000)]
    step = step_time(profile, traffic, NET, SelectionCost(accumulate=1e-3, scan=1e-3))
    # t1: ready 1 + 2 = 3, comm to 3.5; t0: backward done at 2, + 2 + 2 of selects = 6, comm to 6.5
    assert step.select == pytest.approx(4.0)
    assert step.total == pytest.approx(6.5)


def test_proportional_profile_spreads_the_backward_by_size():
    profile = ComputeProfile.proportional([1, 3], forward=0.1, backward=0.8, update=0.2)
    assert profile.backward == pytest.approx((0.2, 0.6))


def test_the_slowest_rank_delays_every_collective():
    """A straggler 1 s late over a 2 s backward pass: tensor 1 is ready at 1.5 s, tensor 0 at 3."""
    profile = ComputeProfile(forward=0.0, backward=(1.0, 1.0), straggler=1.0)
    traffic = [bucket("t1", (1,), 1_000_000), bucket("t0", (0,), 1_000_000)]
    step = step_time(profile, traffic, NET)
    assert step.compute == pytest.approx(3.0)
    assert step.total == pytest.approx(4.0)   # t1: 1.5 -> 2.5; t0: 3 -> 4


def test_the_command_line_prints_a_labelled_projection(capsys):
    from hvd_sparse.plan.__main__ import main

    main(["--params", "1e6", "--tensors", "4", "--world-sizes", "2", "16", "--compute-ms", "10",
          "--methods", "exdyna", "topk"])
    out = capsys.readouterr().out
    assert out.startswith("Projection (hvd_sparse.plan's cost model, not a measurement)")
    assert "N = 16" in out and "\nexdyna " in out and "\nfp16 " in out


def test_a_collective_issued_every_few_steps_counts_by_its_share():
    """A 2 s allreduce issued every 4 steps adds half a second to the mean step."""
    profile = ComputeProfile(forward=0.0, backward=(1.0,))
    every = BucketTraffic("t0", (0,), 1000, 0, ((Transfer(ALLREDUCE, (2_000_000,) * 2, "t0.v", 4),),
                                                (Transfer(ALLREDUCE, (1_000_000,) * 2),)))
    step = step_time(profile, [every], NET)
    assert step.comm == pytest.approx(1.5) and step.total == pytest.approx(2.5)


def test_the_command_line_prices_the_shared_second_moment(capsys):
    """``--second-moment-refresh K``: the methods on the Adam path, a dense allreduce every K steps
    in their mean step and bytes; a negative K is refused."""
    from hvd_sparse.plan.__main__ import main

    def sent(argv: list[str]) -> dict[str, float]:
        main(["--params", "1e6", "--tensors", "4", "--world-sizes", "8", "--compute-ms", "10",
              "--methods", "exdyna", "topk", *argv])
        lines = capsys.readouterr().out.splitlines()
        return {line.split()[0]: float(line.split()[-1]) for line in lines
                if line.split()[:1] in (["exdyna"], ["topk"], ["dense"])}

    own, shared = sent([]), sent(["--second-moment-refresh", "20"])
    assert shared["dense"] == own["dense"] == pytest.approx(4.0)   # MB a rank sends
    for name in ("exdyna", "topk"):
        assert shared[name] == pytest.approx(own[name] + 4.0 / 20, abs=1e-3)
    with pytest.raises(SystemExit):
        main(["--params", "1e6", "--compute-ms", "10", "--second-moment-refresh", "-1"])
