"""A correct program's exit: nothing mirage adds may turn a clean exit into a crash."""

from conftest import mirage


def test_a_backward_pass_right_before_exit_does_not_abort_the_process():
    """Without the fork server, so the program finalizes its interpreter as a plain `python` does.
    With `drain_at_exit` disabled, the first round ended with `terminate called without an active
    exception` and SIGABRT, in 3 runs of 3 (commit message of the change that made it reproduce the abort)."""
    for _ in range(3):
        result = mirage("run", "--no-fork-server", "--gpus-per-node", "1", "--",
                        "python", "tests/workloads/backward_then_exit.py")
        assert "terminate called" not in result.stderr
        assert result.returncode == 0, result.stderr[-2000:]
        assert "backward_done 2000.0" in result.stdout
