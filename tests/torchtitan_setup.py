"""torchtitan 0.2.2 (the release built for torch 2.13) and the files its runs need, made on this
machine: the suite's torchtitan tests (tests/test_torchtitan.py) and the published-run
predictions (bench/torchtitan_published.py) share them.

torchtitan and what it needs (datasets, tokenizers, tyro, tensorboard...) are installed once into
a folder of their own (.venv-torchtitan/, ignored by git), for a workload's PYTHONPATH beside
triton's (.venv-triton/). torchtitan's test assets live in its repository, not its wheel, so a
run's own are made here: a byte-level BPE tokenizer trained with `tokenizers` on a corpus of the
Python standard library's docstrings, and that corpus as the `c4_test` dataset (JSON lines with
a `text` field).
"""

from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TORCHTITAN = ["torchtitan==0.2.2", "torchdata==0.11.0"]
DEPENDENCIES = ["datasets", "tokenizers", "tomli", "fsspec", "tyro", "einops", "tensorboard", "pillow"]
TRITON = "triton==3.9.0"  # the release paired with torch 2.13


def install_triton() -> Path:
    """A folder holding triton, installed once without dependencies (.venv-triton/): most GPU
    boxes have triton, the CPU build of torch does not install it, and the suite mostly runs without."""
    target = REPO / ".venv-triton"
    if not (target / "triton" / "__init__.py").exists():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), TRITON],
                       check=True, timeout=900)
    return target


def install_torchtitan() -> Path:
    """torchtitan and its requirements in .venv-torchtitan/ (installed once)."""
    target = REPO / ".venv-torchtitan"
    if not (target / "torchtitan" / "train.py").exists():
        pip = [sys.executable, "-m", "pip", "install", "-q", "--target", str(target)]
        # torchtitan's and torchdata's own requirements name torch, which must stay the CPU build
        subprocess.run([*pip, "--no-deps", *TORCHTITAN], check=True, timeout=900)
        subprocess.run([*pip, *DEPENDENCIES], check=True, timeout=900)
    return target


def corpus() -> list[str]:
    """Long docstrings of the standard library (the same on every machine with this Python)."""
    import argparse, asyncio, collections, email, logging, pathlib, textwrap, unittest, zipfile

    texts = set()
    for module in (argparse, asyncio, collections, email, inspect, json, logging, pathlib, re, subprocess, textwrap,
                   unittest, zipfile):
        for obj in [module, *vars(module).values()]:
            if inspect.ismodule(obj) or inspect.isclass(obj) or inspect.isfunction(obj):
                doc = inspect.getdoc(obj)
                if doc and len(doc) > 200:
                    texts.add(doc)
    return sorted(texts)


def make_assets(root: Path, torchtitan_path: Path) -> Path:
    """root/tokenizer/ (tokenizer.json, tokenizer_config.json) and root/c4_test/data.json."""
    (root / "c4_test").mkdir(parents=True)
    with open(root / "c4_test" / "data.json", "w") as f:
        for text in corpus():
            f.write(json.dumps({"text": text}) + "\n")
    train = f"""
import sys
from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
special = ["<|begin_of_text|>", "<|end_of_text|>"]
tok.train([{str(root / "c4_test" / "data.json")!r}], trainers.BpeTrainer(vocab_size=2000, special_tokens=special))
tok.save({str(root / "tokenizer" / "tokenizer.json")!r})
"""
    (root / "tokenizer").mkdir()
    subprocess.run([sys.executable, "-c", train], check=True, env={**os.environ, "PYTHONPATH": str(torchtitan_path)})
    (root / "tokenizer" / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "add_bos_token": True,
         "add_eos_token": True}))
    return root


def data_flags(assets: Path) -> list[str]:
    """torchtitan's flags that point a run at the assets (its tokenizer and dataset paths)."""
    return ["--model.hf_assets_path", str(assets / "tokenizer"), "--training.dataset", "c4_test",
            "--training.dataset_path", str(assets / "c4_test")]
