"""Every collective x dtype x op x count x placement against numpy, on real
multi-process jobs of 1 to 4 ranks.

One job per configuration runs the whole matrix (workers/matrix.py; starting
Python ranks costs far more than the calls), and each test below checks one
(configuration, collective, dtype) slice of its report, so a failure points
at exactly what broke."""

import pytest

from jobs import WORKERS, describe_all, expect_success, run_rdistrun, parse_results, run_ranks

COLLECTIVES = [
    "allreduce", "reduce", "broadcast", "allgather",
    "reduce_scatter", "gather", "scatter", "alltoall",
]
DTYPES = [
    "int8", "uint8", "int32", "uint32", "int64", "uint64",
    "float16", "float32", "float64", "bfloat16",
]
# Cases per (collective, dtype): 4 counts x ops x placements.
CASES_PER_SLICE = {
    "allreduce": 4 * 5 * 2, "reduce": 4 * 5 * 2, "reduce_scatter": 4 * 5,
    "broadcast": 4 * 2, "allgather": 4 * 2, "gather": 4, "scatter": 4, "alltoall": 4,
}

# name -> (world size, launcher, worker arguments)
CONFIGS = {
    "1rank": (1, "spawn", []),
    "2ranks": (2, "spawn", []),
    "3ranks": (3, "spawn", []),
    "4ranks-rdistrun": (4, "rdistrun", []),
    # The cross-host path (TCP) and the bandwidth algorithm at every size.
    "3ranks-tcp-ring": (
        3, "spawn",
        ["--collectives", "allreduce,reduce_scatter,allgather,broadcast",
         "--option", "transport=tcp", "--option", "algo=ring"],
    ),
}

_reports = {}


def matrix_report(config):
    """Runs the configuration's job once per session; returns every rank's report."""
    if config not in _reports:
        size, launcher, args = CONFIGS[config]
        command = [WORKERS / "matrix.py", *args]
        if launcher == "rdistrun":
            done = run_rdistrun(command, size, timeout=60)
            reports = parse_results(done.stdout)
            assert done.returncode == 0 and len(reports) == size, (
                f"rdistrun exited {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
            )
        else:
            ranks = run_ranks(command, size, timeout=60)
            reports = expect_success(ranks)
            assert len(reports) == size, describe_all(ranks)
        _reports[config] = sorted(reports, key=lambda r: r["rank"])
    return _reports[config]


def slices():
    for config, (_, _, args) in CONFIGS.items():
        chosen = COLLECTIVES
        if "--collectives" in args:
            chosen = args[args.index("--collectives") + 1].split(",")
        for collective in chosen:
            for dtype in DTYPES:
                yield pytest.param(config, collective, dtype, id=f"{config}-{collective}-{dtype}")


@pytest.mark.parametrize("config, collective, dtype", slices())
def test_collective_matches_numpy(config, collective, dtype):
    reports = matrix_report(config)
    prefix = f"{collective}/{dtype}/"
    for report in reports:
        ran = [case for case in report["cases"] if case.startswith(prefix)]
        assert len(ran) == CASES_PER_SLICE[collective], ran
        failed = {case: why for case, why in report["failures"].items() if case.startswith(prefix)}
        assert not failed, f"rank {report['rank']} of {report['size']}: " + "\n".join(
            f"{case}: {why}" for case, why in failed.items()
        )
