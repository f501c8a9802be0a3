"""The tools people read torch.profiler traces with, installed once into a virtual environment of
their own (.venv-trace-tools/, ignored by git): they read traces, not torch, and their pandas,
plotly and TensorBoard stay out of the environment mirage runs in.

- Holistic Trace Analysis (HTA, Meta's analyser of distributed traces). Its declared requirements
  include jupyterlab and pytest, which its analyses never import; the ones they do are listed.
- TensorBoard's profiler plugin (torch-tb-profiler), whose loader builds the views TensorBoard
  shows (overview, operators, kernels, trace) from a folder of traces.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HTA = "HolisticTraceAnalysis==0.5.0"
IMPORTED = ["pandas==3.1.1", "plotly==7.1.0", "psutil==7.2.2", "networkx==3.6.1", "pydot==4.0.1", "PyYAML==6.0.4"]
TENSORBOARD = ["tensorboard==2.21.0", "torch-tb-profiler==0.4.3"]

# Run by HTA's interpreter: the three analyses issue 39 names, over a folder of per-rank traces,
# printed as one JSON line per analysis.
ANALYSES = """
import json, sys
from hta.trace_analysis import TraceAnalysis
analysis = TraceAnalysis(trace_dir=sys.argv[1])
temporal = analysis.get_temporal_breakdown(visualize=False)
overlap = analysis.get_comm_comp_overlap(visualize=False)
kernel_types, kernels = analysis.get_gpu_kernel_breakdown(visualize=False)
print(json.dumps({
    "temporal": temporal.to_dict(orient="records"),
    "overlap": overlap.to_dict(orient="records"),
    "kernel_types": kernel_types.to_dict(orient="records"),
    "kernel_names": sorted(set(kernels["name"])),
}))
"""


# Run by the tools' interpreter: what TensorBoard's profiler plugin makes of a folder of traces
# (named *.pt.trace.json, as torch.profiler.tensorboard_trace_handler names them), per worker.
TENSORBOARD_VIEWS = """
import json, sys
from torch_tb_profiler.io.cache import Cache
from torch_tb_profiler.profiler.loader import RunLoader

if __name__ == "__main__":
    run = RunLoader("run", sys.argv[1], Cache(sys.argv[2])).load()
    print(json.dumps({worker: {"views": [view.display_name for view in profile.views],
                               "has_kernel": profile.has_kernel,
                               "kernels": [row[0] for row in profile.kernel_table["data"]["rows"]]}
                      for (worker, _span), profile in run.profiles.items()}))
"""


def install() -> Path:
    """The interpreter of .venv-trace-tools/ (made and filled once)."""
    venv = REPO / ".venv-trace-tools"
    python = venv / "bin" / "python"
    ready = [python, "-c", "import hta.trace_analysis, torch_tb_profiler"]
    if not (python.exists() and subprocess.run(ready, capture_output=True).returncode == 0):
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
        pip = [str(python), "-m", "pip", "install", "-q"]
        subprocess.run([*pip, "--no-deps", HTA], check=True, timeout=900)
        subprocess.run([*pip, *IMPORTED, *TENSORBOARD], check=True, timeout=900)
    return python


def run_tool(script: str, *args: str, env: dict[str, str] | None = None) -> dict:
    """`script` run by the tools' interpreter with `args` (and `env` added to the environment):
    the JSON of its last line of output."""
    result = subprocess.run([install(), "-c", script, *args], capture_output=True, text=True, timeout=600,
                            env={**os.environ, **(env or {})})
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def analyse(trace_dir: Path) -> dict:
    """HTA's temporal breakdown, communication/computation overlap and kernel breakdown of the
    per-rank traces in `trace_dir`. HTA rounds a trace's nanosecond timestamps inward to whole
    microseconds unless its own HTA_DISABLE_NS_ROUNDING is set (its answer to CUPTI's overlapping
    events), which shortens each kernel by up to 2 us: over a step of few-microsecond kernels that
    moves its overlap by a point, so it reads the traces at their resolution here."""
    return run_tool(ANALYSES, str(trace_dir), env={"HTA_DISABLE_NS_ROUNDING": "1"})


def tensorboard_views(trace_dir: Path, cache_dir: Path) -> dict:
    """Per worker, the views TensorBoard's profiler plugin offers for the traces in `trace_dir`,
    whether it found kernels, and its kernel table's kernel names."""
    return run_tool(TENSORBOARD_VIEWS, str(trace_dir), str(cache_dir))
