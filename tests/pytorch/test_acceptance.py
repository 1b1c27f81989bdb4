"""Runs the shared acceptance script seed_linear_fp8.py on the CPU, when it is present."""
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.normpath(os.path.join(HERE, "..", "..", "..", "shared", "acceptance", "seed_linear_fp8.py"))


@pytest.mark.skipif(not os.path.exists(SCRIPT), reason=f"acceptance script not present at {SCRIPT}")
def test_seed_linear_fp8_cpu():
    import transformer_engine
    pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(transformer_engine.__file__)))
    env = dict(os.environ, ACCEPT_DEVICE="cpu")
    env["PYTHONPATH"] = os.pathsep.join([pkg_root, os.path.dirname(SCRIPT), env.get("PYTHONPATH", "")])
    p = subprocess.run([sys.executable, os.path.basename(SCRIPT)], cwd=os.path.dirname(SCRIPT), env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
