"""Multi-process jobs beyond the collective matrix: non-blocking requests,
groups, split, other bootstraps, running without numpy, and failures that
must reach every rank promptly (mismatch, timeout, crash, abort)."""

import pytest

import rdist
from jobs import WORKERS, describe_all, expect_success, run_ranks

SCENARIOS = WORKERS / "scenarios.py"


def test_nonblocking_requests_and_every_i_call():
    results = expect_success(run_ranks([SCENARIOS, "nonblocking"], 3))
    assert all(r["ok"] for r in results)


@pytest.mark.parametrize("world_size", [2, 4])
def test_group_send_recv_swap(world_size):
    results = expect_success(run_ranks([SCENARIOS, "group_swap"], world_size))
    assert all(r["ok"] for r in results)


def test_split_by_parity_ordered_by_key():
    results = expect_success(run_ranks([SCENARIOS, "split"], 4))
    for result in results:
        rank = result["rank"]
        members = [r for r in range(4) if r % 2 == rank % 2]
        assert result["sub_size"] == 2
        assert result["total"] == sum(members)
        # key = -rank: the highest old rank comes first.
        assert result["order"] == sorted(members, reverse=True)
        assert result["sub_rank"] == sorted(members, reverse=True).index(rank)


def test_unique_id_bootstrap_hosted_by_this_process():
    # This (non-rank) process creates the id and hosts the rendezvous.
    uid = rdist.unique_id()
    results = expect_success(run_ranks([SCENARIOS, "unique_id", uid.hex()], 3))
    assert [r["total"] for r in results] == [6, 6, 6]
    assert [r["size"] for r in results] == [3, 3, 3]


def test_file_rendezvous(tmp_path):
    results = expect_success(run_ranks([SCENARIOS, "file_init", tmp_path / "rendezvous"], 2))
    assert [r["total"] for r in results] == [3, 3]


def test_works_without_numpy():
    results = expect_success(run_ranks([SCENARIOS, "numpy_free"], 2))
    for result in results:
        assert result["numpy_loaded"] is False
        assert result["values"] == [1.0, 3.0]  # [0 + 1, 1.5 + 1.5]
        assert result["raw"] == "rdist!"
        assert result["halves"] == [0x4000] * 4  # float16 1.0 + 1.0 = 2.0
        assert result["gathered"] == [0, 3]


def test_mismatched_collectives_raise_mismatch_on_both_ranks():
    results = expect_success(run_ranks([SCENARIOS, "mismatch"], 2))
    for result in results:
        assert result["error"] == "MismatchError", result
        assert result["code"] == rdist.Result.MISMATCH
        assert "allreduce" in result["message"] and "broadcast" in result["message"], result
        assert result["elapsed"] < 5, result


def test_timeout_raises_the_timeout_error_naming_the_missing_rank():
    results = expect_success(run_ranks([SCENARIOS, "timeout"], 3, timeout=30))
    waiting = [r for r in results if not r.get("absent")]
    assert len(waiting) == 2
    for result in waiting:
        assert result["error"] == "CommTimeoutError" and result["builtin_timeout"], result
        # Its own timeout, or (when a rank further up the chain timed out a
        # moment earlier and said so) that rank's, with its own state added.
        assert "timed out after 0.6 s" in result["message"], result
        assert "waiting for rank" in result["message"], result
        assert 0.5 <= result["elapsed"] < 3, result
    # The rank that waits on the absent one directly names it either way. (A
    # rank further up the chain names the live rank it was waiting on.)
    by_rank = {r["rank"]: r for r in waiting}
    assert "waiting for rank 2" in by_rank[1]["message"], waiting


def test_a_crashed_rank_gives_peer_lost_on_the_others_quickly():
    ranks = run_ranks([SCENARIOS, "crash"], 3, timeout=30)
    assert ranks[1].returncode == 7, describe_all(ranks)
    for survivor in (ranks[0], ranks[2]):
        assert survivor.returncode == 0, describe_all(ranks)
        result = survivor.result
        assert result["error"] == "PeerLostError", result
        assert "rank 1" in result["message"], result
        assert result["elapsed"] < 5, result  # timeout_ms is 30 s: detected, not timed out
        assert result["failed"] == [1], result


def test_abort_from_another_thread_releases_both_ranks():
    results = expect_success(run_ranks([SCENARIOS, "abort"], 2))
    for result in results:
        assert result["error"] == "AbortedError", result
        assert result["after"] == "AbortedError", result  # aborted stays aborted
        assert result["elapsed"] < 3, result
    assert "rank 0 aborted" in results[1]["message"], results[1]


@pytest.mark.parametrize("victim", [0, 2])
def test_the_survivors_shrink_the_default_communicator_and_go_on(victim):
    ranks = run_ranks([SCENARIOS, "shrink", victim], 4, timeout=60)
    assert ranks[victim].returncode == 7, describe_all(ranks)
    survivors = [r for r in range(4) if r != victim]
    for new_rank, old_rank in enumerate(survivors):
        assert ranks[old_rank].returncode == 0, describe_all(ranks)
        result = ranks[old_rank].result
        assert result["rank"] == old_rank, result
        assert result["new_rank"] == new_rank and result["size"] == 3, result
        assert result["default"] is True, result
        assert result["sum"] == sum(r + 1 for r in survivors), result
        assert result["took"] < 5, result
