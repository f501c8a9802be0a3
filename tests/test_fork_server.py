"""The fork server (mirage/forkserver): a process handed over to it is the same program, with
the same argv, environment, working directory, `__main__`, exit status and output, and nothing
of the session outlives it. Each program checks that it really was forked from the server (its
real parent runs mirage.forkserver.server), so a silent fallback to a normal start fails."""

from __future__ import annotations

import json
import os
import signal
import textwrap
import time
from pathlib import Path

from conftest import mirage
from escapees import still_running

FORKED_CHECK = textwrap.dedent("""
    import os, sys
    def real_parent(pid):
        with open(f"/proc/{pid}/stat") as stat:
            return int(stat.read().rsplit(")", 1)[1].split()[1])
    def forked_from_server(pid=None):
        parent = real_parent(pid or os.getpid())
        with open(f"/proc/{parent}/cmdline", "rb") as cmdline:
            return b"mirage.forkserver.server" in cmdline.read()
""")


def _script(tmp_path: Path, body: str, name: str = "program.py") -> Path:
    path = tmp_path / name
    path.write_text(FORKED_CHECK + textwrap.dedent(body))
    return path


def _json_line(stdout: str, prefix: str = "") -> dict:
    for line in stdout.splitlines():
        if line.startswith(prefix + "{"):
            return json.loads(line[len(prefix):])
    raise AssertionError(f"no JSON line in {stdout!r}")


def test_a_script_sees_its_argv_env_cwd_main_and_devices(tmp_path):
    script = _script(tmp_path, """
        import json, torch
        print(json.dumps({
            "forked": forked_from_server(), "argv": sys.argv, "orig_argv": sys.orig_argv[1:],
            "name": __name__, "file": __file__, "path0": sys.path[0], "cwd": os.getcwd(),
            "user_env": os.environ.get("USER_SETTING"), "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "devices": torch.cuda.device_count(), "on_device": str(torch.ones(2, device="cuda").sum().item()),
            "ppid_is_waiters_parent": os.getppid() != real_parent(os.getpid()), "nice": os.nice(0),
        }))
    """)
    workdir = tmp_path / "work"
    workdir.mkdir()
    # Under nice(1): the program has its waiter's priority, not the server's (which is raised).
    result = mirage("run", "--gpus-per-node", "4", "--workdir", str(workdir), "--env", "USER_SETTING=yes",
                    "--env", "CUDA_VISIBLE_DEVICES=1,3", "--quiet", "--", "nice", "-n", "3", "python", str(script),
                    "a", "--b")
    assert result.returncode == 0, result.stderr
    seen = _json_line(result.stdout)
    assert seen == {
        "forked": True, "argv": [str(script), "a", "--b"], "orig_argv": [str(script), "a", "--b"],
        "name": "__main__", "file": str(script), "path0": str(tmp_path), "cwd": str(workdir),
        "user_env": "yes", "visible": "1,3", "devices": 2, "on_device": "2.0", "ppid_is_waiters_parent": True,
        "nice": min(os.nice(0) + 3, 19),
    }


def test_module_and_code_programs_run_as_the_interpreter_runs_them(tmp_path):
    """Their stacks too: what a traceback, a profiler or a memory snapshot walks starts where
    `python -m` starts it (runpy's frames), with none of the fork server's beneath."""
    (tmp_path / "probe_module.py").write_text(
        FORKED_CHECK + "import traceback\n"
        "print(__name__, sys.argv[1:], 'MIRAGE_SESSION' not in os.environ or forked_from_server())\n"
        "print([(frame.filename, frame.name) for frame in traceback.extract_stack()])\n")
    import subprocess
    import sys

    as_python_runs_it = subprocess.run([sys.executable, "-m", "probe_module", "x"], cwd=tmp_path, capture_output=True,
                                       text=True).stdout
    assert "'<frozen runpy>', '_run_module_as_main'" in as_python_runs_it
    result = mirage("run", "--workdir", str(tmp_path), "--quiet", "--", "python", "-m", "probe_module", "x")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0] == "__main__ ['x'] True"
    assert result.stdout == as_python_runs_it
    code = FORKED_CHECK + "print(sys.argv, sys.path[0] == '', forked_from_server())"
    result = mirage("run", "--quiet", "--", "python", "-u", "-c", code, "y")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "['-c', 'y'] True True"


def test_exit_codes_uncaught_errors_and_death_by_signal_pass_through(tmp_path):
    exits = _script(tmp_path, "assert forked_from_server()\nsys.exit(7)\n", "exits.py")
    assert mirage("run", "--quiet", "--", "python", str(exits)).returncode == 7
    raises = _script(tmp_path, "if 'MIRAGE_SESSION' in os.environ:\n    assert forked_from_server()\n"
                               "def fail():\n    raise ValueError('boom')\nfail()\n", "raises.py")
    import subprocess
    import sys

    as_python_prints_it = subprocess.run([sys.executable, str(raises)], capture_output=True, text=True).stderr
    assert as_python_prints_it.startswith("Traceback") and "ValueError: boom" in as_python_prints_it
    for how in ([], ["-c", f"exec(open({str(raises)!r}).read())"]):
        result = mirage("run", "--quiet", "--", "python", *(how or [str(raises)]))
        assert result.returncode == 1
        traceback = result.stderr[result.stderr.index("Traceback"):]
        if not how:  # the program's frames only, exactly as `python` prints them
            assert traceback == as_python_prints_it
        assert "/mirage/" not in traceback, traceback
    killed = _script(tmp_path, "import signal\nassert forked_from_server()\nos.kill(os.getpid(), signal.SIGTERM)\n",
                     "killed.py")
    assert mirage("run", "--quiet", "--", "python", str(killed)).returncode == 128 + signal.SIGTERM
    killed.write_text(killed.read_text().replace("SIGTERM", "SIGKILL"))
    assert mirage("run", "--quiet", "--", "python", str(killed)).returncode == 128 + signal.SIGKILL


def test_ranks_output_lines_keep_their_streams_and_labels(tmp_path):
    script = _script(tmp_path, """
        rank = os.environ["RANK"]
        print(f"out {rank} {forked_from_server()}")
        print(f"err {rank}", file=sys.stderr)
    """)
    result = mirage("run", "--nproc-per-node", "2", "--gpus-per-node", "2", "--quiet", "--", "python", str(script))
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()) == ["[0] out 0 True", "[1] out 1 True"]
    assert "[0] err 0" in result.stderr.splitlines() and "[1] err 1" in result.stderr.splitlines()


def test_multiprocessing_spawn_children_are_forked_and_report_back(tmp_path):
    script = _script(tmp_path, """
        import multiprocessing as mp
        import torch

        def child(queue):
            queue.put((forked_from_server(), torch.cuda.device_count(), __name__))

        if __name__ == "__main__":
            context = mp.get_context("spawn")
            queue = context.Queue()
            process = context.Process(target=child, args=(queue,))
            process.start()
            print(queue.get(timeout=120), forked_from_server())
            process.join()
            print("exitcode", process.exitcode)
    """)
    result = mirage("run", "--gpus-per-node", "2", "--quiet", "--", "python", str(script))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["(True, 2, '__mp_main__') True", "exitcode 0"]


def test_sigkill_of_the_waiter_kills_the_program_and_nothing_outlives_the_session(tmp_path):
    pids = tmp_path / "pids.json"
    script = _script(tmp_path, f"""
        import json, subprocess, time
        assert forked_from_server()
        # the waiter: the process its parent started, with the same command line in /proc
        def cmdline(pid):
            return open(f"/proc/{{pid}}/cmdline", "rb").read().rstrip(b"\\0")
        waiter = next(int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()
                      and cmdline(p) == cmdline("self") and real_parent(int(p)) == os.getppid())
        # a straggler in a session of its own, itself handed over
        straggler = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
        # and one that hides from mirage's MIRAGE_SESSION search: an empty environment, a session of its own
        hidden = subprocess.Popen(["/usr/bin/sleep", "600"], env={{}}, start_new_session=True)
        def started(pid):
            return open(f"/proc/{{pid}}/stat").read().rsplit(")", 1)[1].split()[19]
        with open({str(pids)!r} + ".partial", "w") as out:
            json.dump({{"rank": os.getpid(), "waiter": waiter, "session": os.environ["MIRAGE_SESSION"],
                       "started": [(pid, started(pid)) for pid in (os.getpid(), straggler.pid, hidden.pid)]}}, out)
        os.rename({str(pids)!r} + ".partial", {str(pids)!r})
        time.sleep(600)
    """)
    import subprocess
    import sys

    run = subprocess.Popen([sys.executable, "-m", "mirage", "run", "--quiet", "--", "python", str(script)],
                           cwd=Path(__file__).resolve().parent.parent, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        for _ in range(600):
            if pids.exists() or run.poll() is not None:
                break
            time.sleep(0.1)
        assert pids.exists(), run.communicate(timeout=60)
        seen = json.loads(pids.read_text())
        os.kill(seen["waiter"], signal.SIGKILL)
        assert run.wait(timeout=120) == 128 + signal.SIGKILL, run.communicate()
        assert not Path(f"/proc/{seen['rank']}").exists() or "Z" in Path(f"/proc/{seen['rank']}/stat").read_text().split()[2]
        assert still_running([(pid, started) for pid, started in seen["started"]]) == []  # tests/escapees.py
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()


def test_a_lost_fork_server_ends_its_waiters_and_their_programs_with_the_reason(tmp_path):
    """The server reports how each child ends; killed by itself (the run and its service alive),
    it can report nothing more, so each waiter kills its child after a grace (in which a child
    that saw the whole session end stops by itself: test_session.py) and says why."""
    started = tmp_path / "started"
    script = _script(tmp_path, f"""
        import time
        assert forked_from_server()
        open({str(started)!r}, "w").write(str(real_parent(os.getpid())))  # getppid() gives the waiter's parent
        time.sleep(600)
    """)
    import subprocess
    import sys

    run = subprocess.Popen([sys.executable, "-m", "mirage", "run", "--quiet", "--", "python", str(script)],
                           cwd=Path(__file__).resolve().parent.parent, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)
    try:
        for _ in range(600):
            if started.exists() and started.read_text() or run.poll() is not None:
                break
            time.sleep(0.1)
        assert started.exists(), run.communicate(timeout=60)
        os.kill(int(started.read_text()), signal.SIGKILL)  # the server (or its twin) that forked the program
        _, stderr = run.communicate(timeout=120)
        assert run.returncode == 1, stderr
        assert "the fork server ended before process" in stderr and "--no-fork-server" in stderr, stderr
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()


def test_no_fork_server_starts_processes_on_their_own(tmp_path):
    script = _script(tmp_path, "print(forked_from_server(), os.environ.get('MIRAGE_FORK_SERVER'))\n")
    result = mirage("run", "--no-fork-server", "--quiet", "--", "python", str(script))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False None"


def test_more_ranks_than_memory_is_refused_before_start_with_the_estimate():
    """4096 ranks (64 nodes x 64) need about 128 GiB by the estimate's figures."""
    result = mirage("run", "--num-nodes", "64", "--nproc-per-node", "64", "--gpus-per-node", "64", "--",
                    "python", "-c", "pass")
    assert result.returncode == 2
    assert "cannot hold 4096 processes" in result.stderr and "4096 x" in result.stderr
    assert "GiB is available" in result.stderr and "Fix: fewer nodes or ranks" in result.stderr
    assert "session" not in result.stderr  # refused before any session came up
    result = mirage("run", "--no-fork-server", "--num-nodes", "64", "--nproc-per-node", "64", "--gpus-per-node", "64",
                    "--", "python", "-c", "pass")
    assert result.returncode == 2 and "drop --no-fork-server" in result.stderr


def test_the_end_of_a_program_keeps_what_the_interpreter_does_at_exit(tmp_path):
    """A handed-over program ends without tearing down every module (fork's shared pages would
    be copied), but what a program sees of the interpreter's end still happens."""
    out = tmp_path / "left-open.txt"
    script = _script(tmp_path, f"""
        import atexit, threading, time
        assert forked_from_server()
        left_open = open({str(out)!r}, "w")
        left_open.write("flushed at exit")  # never closed, never flushed by the program
        def late():
            time.sleep(0.5)
            print("non-daemon thread finished", flush=True)
        threading.Thread(target=late).start()
        atexit.register(lambda: print("atexit ran"))
        sys.exit("a message exit")
    """)
    result = mirage("run", "--quiet", "--", "python", str(script))
    assert result.returncode == 1
    assert result.stdout.splitlines() == ["non-daemon thread finished", "atexit ran"]
    assert "a message exit" in result.stderr.splitlines()
    assert out.read_text() == "flushed at exit"
