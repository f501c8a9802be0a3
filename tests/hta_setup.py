"""Holistic Trace Analysis (HTA, Meta's analyser of distributed PyTorch traces), installed once
into a virtual environment of its own (.venv-hta/, ignored by git): it reads traces, not torch,
and its pandas and plotly stay out of the environment mirage runs in. Its declared requirements
include jupyterlab and pytest, which its analyses never import; the ones they do are listed here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HTA = "HolisticTraceAnalysis==0.5.0"
IMPORTED = ["pandas==3.1.1", "plotly==7.1.0", "psutil==7.2.2", "networkx==3.6.1", "pydot==4.0.1", "PyYAML==6.0.4"]

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


def install_hta() -> Path:
    """The interpreter of .venv-hta/ (made and filled once)."""
    venv = REPO / ".venv-hta"
    python = venv / "bin" / "python"
    if not (python.exists() and subprocess.run([python, "-c", "import hta.trace_analysis"],
                                               capture_output=True).returncode == 0):
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
        pip = [str(python), "-m", "pip", "install", "-q"]
        subprocess.run([*pip, "--no-deps", HTA], check=True, timeout=900)
        subprocess.run([*pip, *IMPORTED], check=True, timeout=900)
    return python


def analyse(trace_dir: Path) -> dict:
    """HTA's temporal breakdown, communication/computation overlap and kernel breakdown of the
    per-rank traces in `trace_dir`."""
    result = subprocess.run([install_hta(), "-c", ANALYSES, str(trace_dir)], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])
