"""The Python examples, run as their docstrings say: through rdistrun with
four ranks. Each example asserts its own results."""

import pytest

from jobs import REPO, run_rdistrun

EXAMPLES = REPO / "examples" / "python"


@pytest.mark.parametrize(
    "example, expected_line",
    [
        ("allreduce_broadcast.py", "average[:3] = [1.5 2.5 3.5], settings = [0.05, 0.9, 1234.0]"),
        ("point_to_point.py", "[rank 3] rank 3: non-blocking recv got 4 chunks"),
        ("data_parallel_sgd.py", "matches single-process training"),
        # rdist-trace on the four ranks' timelines names the slow one.
        ("straggler.py", "straggler: rank 2"),
    ],
)
def test_example_runs_on_four_ranks(example, expected_line):
    done = run_rdistrun([EXAMPLES / example], 4, timeout=60)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    assert expected_line in done.stdout, done.stdout


def test_every_example_is_tested():
    tested = {"allreduce_broadcast.py", "point_to_point.py", "data_parallel_sgd.py",
              "straggler.py"}
    assert {p.name for p in EXAMPLES.glob("*.py")} == tested
