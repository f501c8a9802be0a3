"""A correct program's exit: nothing mirage adds may turn a clean exit into a crash."""

from conftest import mirage


def test_a_backward_pass_right_before_exit_does_not_abort_the_process():
    for _ in range(3):
        result = mirage("run", "--gpus-per-node", "1", "--", "python", "tests/workloads/backward_then_exit.py")
        assert "terminate called" not in result.stderr
        assert result.returncode == 0, result.stderr[-2000:]
        assert "backward_done 2000.0" in result.stdout
