"""`mirage run`: usage errors, exit codes, environment layering, signals, no leftovers."""

import getpass
import importlib.metadata
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile

import pytest

from conftest import REPO, mirage


@pytest.mark.parametrize("args, message", [
    (["--gpus-per-node", "0", "--", "python"], "--gpus-per-node 0 is out of range; use 1 to 64"),
    (["--gpus-per-node", "65", "--", "python"], "out of range"),
    (["--profile", "mi999", "--", "python"], "unknown profile 'mi999'"),
    (["--"], "no command to run"),
    ([], "no command to run"),
    (["python", "train.py"], "put `--` before the command"),
    (["--profil", "h100", "--", "python"], "did you mean --profile?"),
    (["--env", "NOEQUALS", "--", "python"], "is not KEY=VALUE"),
    (["--hang-timeout", "-5", "--", "python"], "--hang-timeout -5 must be a positive number of seconds"),
    (["--hang-timeout", "0", "--", "python"], "--hang-timeout 0 must be a positive number of seconds"),
    (["--num-nodes", "2", "--node-hostname", "gpu-{node}", "--", "hostname"], "Fix: add --isolate-nodes"),
])
def test_usage_errors_exit_2_with_one_clear_line(args, message):
    result = mirage("run", *args)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_version_names_mirage_torch_and_the_shim_build_and_the_summary_carries_them(tmp_path):
    """What a bug report needs, as `mirage --version` prints it and --summary-json records it:
    the build key is the one the session's shim was loaded from (its cache folder)."""
    import torch
    from mirage.shim import build

    version = mirage("--version")
    assert version.returncode == 0, version.stderr
    lines = version.stdout.splitlines()
    assert lines[0] == f"mirage {importlib.metadata.version('mirage')}"
    assert lines[1].startswith(f"torch {torch.__version__} (")
    key = build.library_path().parent.name.removeprefix("shim-")
    assert lines[2].startswith(f"device shim build key {key}")
    summary = tmp_path / "summary.json"
    result = mirage("run", "--quiet", "--summary-json", str(summary), "--", "python", "-c",
                    "import os, torch; torch.ones(1, device='cuda'); "
                    "print([m.split()[-1] for m in open('/proc/self/maps') if 'mirage_shim' in m][0])")
    assert result.returncode == 0, result.stderr
    recorded = json.loads(summary.read_text())["build"]
    assert recorded["torch"] == torch.__version__ and recorded["shim_build_key"] == key and recorded["shim_built"]
    assert f"shim-{key}" in result.stdout  # the library the workload loaded is the one named
    assert "(not built yet" not in mirage("--version").stdout


def test_exit_code_is_the_workloads():
    assert mirage("run", "--", "sh", "-c", "exit 7").returncode == 7
    assert mirage("run", "--", "sh", "-c", "kill -TERM $$").returncode == 128 + signal.SIGTERM
    missing = mirage("run", "--", "no-such-program-xyz")
    assert missing.returncode == 127 and "command not found" in missing.stderr


def test_environment_layers_and_identity_cannot_be_overridden(tmp_path):
    script = ("import os; print(os.environ.get('FOO'), os.environ['MIRAGE_NUM_GPUS'], "
              "os.environ['MIRAGE_SESSION'] != 'x', os.environ['PYTHONPATH'].endswith('caller'), "
              "os.getcwd(), os.environ.get('KEEP_ME'))")
    env = dict(os.environ, PYTHONPATH="caller", KEEP_ME="yes")
    result = mirage("run", "--gpus-per-node", "3", "--env", "FOO=bar", "--env", "MIRAGE_SESSION=x",
                    "--workdir", str(tmp_path), "--", "python", "-c", script, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["bar", "3", "True", "True", str(tmp_path), "yes"]
    assert "--env MIRAGE_SESSION ignored" in result.stderr
    cleared = mirage("run", "--clear-env-vars", "--", "python", "-c", script, env=env)
    assert cleared.stdout.split()[-1] == "None"


def test_a_second_run_finds_what_the_first_compiled_in_inductors_cache_in_the_users_temp_dir():
    """On a real box torch.compile's cache (<temp dir>/torchinductor_<user>) outlives a run and the
    next run of the same program reads its graph from it; the session's own scratch temp dir,
    which mirage removes, is still the program's temp dir. (A graph of its own each time the test
    runs: a constant no earlier run compiled.)"""
    script = ("import json, tempfile, torch\n"
              "from torch._dynamo.utils import counters\n"
              "from torch._inductor.runtime.cache_dir_utils import cache_dir\n"
              "x = torch.randn(64, device='cuda')\n"
              f"scaled = lambda t: t.sin().relu() * {secrets.randbelow(10**9) + 2}\n"
              "torch.testing.assert_close(torch.compile(scaled)(x), scaled(x))\n"
              "print(json.dumps({'cache': cache_dir(), 'temp': tempfile.gettempdir(),\n"
              "                  'hit': counters['inductor']['fxgraph_cache_hit']}))\n")
    first, second = (mirage("run", "--quiet", "--", "python", "-c", script) for _ in range(2))
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    first, second = json.loads(first.stdout), json.loads(second.stdout)
    users = os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")
    assert first["cache"] == second["cache"] == users
    assert (first["hit"], second["hit"]) == (0, 1)
    assert tempfile.gettempdir() != first["temp"] != second["temp"]  # each session's scratch


def test_triton_kernels_are_interpreted_unless_the_caller_says_otherwise():
    script = "import os; print(os.environ.get('TRITON_INTERPRET'))"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    assert mirage("run", "--", "python", "-c", script, env=env).stdout.strip() == "1"
    assert mirage("run", "--", "python", "-c", script, env=dict(env, TRITON_INTERPRET="0")).stdout.strip() == "0"
    assert mirage("run", "--env", "TRITON_INTERPRET=0", "--", "python", "-c", script, env=env).stdout.strip() == "0"


def test_session_id_on_stderr_and_stdout_is_the_workloads():
    result = mirage("run", "--", "python", "-c", "print('hello')")
    assert result.stdout == "hello\n"
    assert "mirage: session " in result.stderr


def test_stdin_reaches_a_single_process_job():
    result = mirage("run", "--", "python", "-c", "import sys; print(sys.stdin.read().upper())", input="abc")
    assert result.stdout.strip() == "ABC"


def test_children_of_the_workload_get_the_emulated_devices():
    script = ("import subprocess, sys; subprocess.run([sys.executable, '-c', "
              "'import torch; print(torch.cuda.device_count(), torch.randn(2, device=\"cuda:1\").device)'])")
    result = mirage("run", "--gpus-per-node", "2", "--", "python", "-c", script)
    assert result.stdout.strip() == "2 cuda:1", result.stderr


def _start(script: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "mirage", "run", "--", "python", "-c", script],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _session_leftovers(session: str) -> list[str]:
    out = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True).stdout
    pids = []
    for line in out.splitlines():
        pid = line.split()[0]
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if f"MIRAGE_SESSION={session}".encode() in f.read():
                    pids.append(line)
        except OSError:
            pass
    return pids


IGNORES_SIGINT = (
    "import signal, subprocess, sys, time\n"
    "signal.signal(signal.SIGINT, lambda *a: print('got SIGINT', flush=True))\n"
    "signal.signal(signal.SIGUSR1, lambda *a: print('got SIGUSR1', flush=True))\n"
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
    "print('ready', flush=True)\n"
    "while True: time.sleep(0.1)\n"
)


def _narrated(proc: subprocess.Popen, text: str, seen: list[str]) -> None:
    """Reads mirage's stderr (into `seen`) up to the line containing `text`: mirage's handler has
    then counted the signal, so the next one cannot merge with it."""
    for line in proc.stderr:
        seen.append(line)
        if text in line:
            return
    raise AssertionError(f"mirage never said {text!r}:\n{''.join(seen)}")


def test_interrupt_ladder_forwards_then_terminates_and_leaves_nothing():
    proc = _start(IGNORES_SIGINT)
    seen: list[str] = []
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGUSR1)
    assert proc.stdout.readline().strip() == "got SIGUSR1"
    proc.send_signal(signal.SIGINT)
    assert proc.stdout.readline().strip() == "got SIGINT"  # forwarded, and ignored
    _narrated(proc, "received SIGINT: forwarding it to the workload", seen)
    assert proc.poll() is None
    proc.send_signal(signal.SIGINT)  # second: SIGTERM
    code = proc.wait(timeout=30)
    stderr = "".join(seen) + proc.stderr.read()
    assert code == 128 + signal.SIGTERM
    assert "forwarding SIGUSR1" in stderr
    assert "received SIGINT: forwarding it to the workload" in stderr
    assert "received SIGINT again: terminating the workload" in stderr
    session = stderr.split("mirage: session ")[1].split()[0]
    assert _session_leftovers(session) == []


def test_third_signal_kills_outright():
    proc = _start("import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                  "signal.signal(signal.SIGINT, signal.SIG_IGN)\nprint('ready', flush=True)\ntime.sleep(600)")
    assert proc.stdout.readline().strip() == "ready"
    seen: list[str] = []
    for said in ("received SIGTERM: forwarding", "received SIGTERM again", "a third time: killing the workload"):
        proc.send_signal(signal.SIGTERM)
        _narrated(proc, said, seen)
    assert proc.wait(timeout=30) == 128 + signal.SIGKILL


@pytest.mark.parametrize("streams", ["2>/dev/null", "2>&1"], ids=["stdout", "stdout-and-stderr"])
def test_a_reader_that_goes_away_ends_the_job_as_a_broken_pipe_ends_a_pipeline(tmp_path, streams):
    chatty = "import time\nfor i in range(100000):\n    print('line', i, flush=True)\n    time.sleep(0.001)\n"
    (tmp_path / "chatty.py").write_text(chatty)
    (tmp_path / "xdg").mkdir()
    runtime = tmp_path / "xdg" / "mirage"  # where the run keeps its session directory
    command = (f"{sys.executable} -m mirage run --nproc-per-node 2 --gpus-per-node 2 -- python {tmp_path}/chatty.py "
               f"{streams} | head -1; exit ${{PIPESTATUS[0]}}")
    result = subprocess.run(["bash", "-c", command], cwd=REPO, capture_output=True, text=True, timeout=120,
                            env=dict(os.environ, XDG_RUNTIME_DIR=str(tmp_path / "xdg")))
    assert result.returncode == 128 + signal.SIGPIPE, result.stderr
    assert len(result.stdout.splitlines()) == 1
    assert list(runtime.iterdir()) == []  # the session's directory was removed: teardown ran
    leftovers = subprocess.run(["pgrep", "-f", f"{tmp_path}/chatty.py"], capture_output=True, text=True).stdout
    assert leftovers == ""


def test_a_runtime_directory_deeper_than_a_unix_socket_path_allows_still_runs_a_job(tmp_path):
    """The session's sockets (its service's, its fork server's) live in its directory under
    $XDG_RUNTIME_DIR, and AF_UNIX paths hold 107 bytes: a deep runtime directory (a CI runner's,
    a test's tmp_path) is reached through /proc/self/fd (mirage/unix_sockets.py). The ranks must
    attach, be forked from the server and all-reduce; the directory is left empty."""
    runtime = tmp_path / ("r" * 120)
    runtime.mkdir()
    program = ("import os, torch, torch.distributed as dist\n"
               "torch.cuda.set_device(int(os.environ['LOCAL_RANK']))\n"
               "dist.init_process_group('nccl')\n"
               "value = torch.ones(1, device='cuda') * (dist.get_rank() + 1)\n"
               "dist.all_reduce(value)\n"
               "print('sum', value.item(), 'forked', 'MIRAGE_FORK_SERVER' in os.environ)\n"
               "dist.destroy_process_group()\n")
    result = mirage("run", "--quiet", "--nproc-per-node", "2", "--gpus-per-node", "2", "--", "python", "-c", program,
                    env=dict(os.environ, XDG_RUNTIME_DIR=str(runtime)))
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()) == ["[0] sum 3.0 forked True", "[1] sum 3.0 forked True"]
    assert list((runtime / "mirage").iterdir()) == []
