"""The house's shape, measured (issue 31): one decode step of the demo engine on the CPU native path enters at most
16 project files and switches between files at most 100 times (``scripts/trace_step.py``; before the engine↔KV
seam it was 25 files and 298 switches, ``docs/results/trace_step.md``). A change that sends the decode step
through more files, or back and forth between them, fails here: make the seam narrower instead."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _trace(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "trace.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, str(ROOT / "scripts" / "trace_step.py"), "--engine", str(tmp_path / "engine"),
                    "--json", str(out), *args], check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def test_one_decode_step_stays_within_sixteen_files_and_a_hundred_switches(tmp_path):
    for args in ((), ("--page-rows", "16")):  # the direct path, then the full resolver (hot cache, host fetches)
        figures = _trace(tmp_path, *args)
        assert figures["files"] <= 16, (args, figures["files_entered"])
        assert figures["file_switches"] <= 100, (args, figures["file_switches"])
