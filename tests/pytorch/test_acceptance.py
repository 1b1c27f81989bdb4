"""Runs the shared acceptance scripts (../shared/acceptance, beside the repository) unmodified
on the CPU, when they are present."""
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ACCEPTANCE = os.path.normpath(os.path.join(HERE, "..", "..", "..", "shared", "acceptance"))


@pytest.mark.parametrize("script", ["seed_linear_fp8.py", "seed_tutorial_layer.py"])
def test_seed_script_cpu(script):
    path = os.path.join(ACCEPTANCE, script)
    if not os.path.exists(path):
        pytest.skip(f"acceptance script not present at {path}")
    import transformer_engine
    pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(transformer_engine.__file__)))
    env = dict(os.environ, ACCEPT_DEVICE="cpu")
    env["PYTHONPATH"] = os.pathsep.join([pkg_root, ACCEPTANCE, env.get("PYTHONPATH", "")])
    p = subprocess.run([sys.executable, script], cwd=ACCEPTANCE, env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
