"""GPU-only checks (tests/gpu_checks.py), each in a fresh process without TRITON_INTERPRET so
the kernels are compiled for the device. Skipped without CUDA: CI has no GPU; the CPU
twins of these paths are tested in test_kernels.py, and `python tests/gpu_checks.py
--device cpu` runs these same functions under the interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpu_checks import CHECKS


def gpu_env() -> dict[str, str]:
    """This process's environment with the GPUs conftest hid and without the interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    visible = env.pop("KVSESSION_VISIBLE_GPUS", "<all>")
    if visible == "<all>":
        env.pop("CUDA_VISIBLE_DEVICES", None)
    else:
        env["CUDA_VISIBLE_DEVICES"] = visible
    return env


def have_cuda() -> bool:
    if not Path("/dev/nvidiactl").exists():  # no NVIDIA driver: skip the torch probe
        return False
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
                           env=gpu_env(), capture_output=True, text=True, timeout=120)
    return probe.stdout.strip() == "True"


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not have_cuda(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("name", list(CHECKS))
def test_on_gpu(name):
    script = Path(__file__).with_name("gpu_checks.py")
    proc = subprocess.run([sys.executable, str(script), name], env=gpu_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"ok {name}" in proc.stdout
