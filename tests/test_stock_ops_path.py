"""The GPU machines' code path, on CPU: with ``TF_SFCTR_CPU_KERNELS=0`` the
layer runs TF's stock ops wherever our CPU kernels would replace them (as it
does with a GPU visible). No machine here has a GPU, so the suites that train,
look ahead, checkpoint and compare against references run again that way, in
a child pytest (the choice is made when a step is traced, per process)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import tensorflow as tf

from tf_sfctr import _ops

TESTS = Path(__file__).resolve().parent
SUITES = ["test_lookahead.py", "test_numerics.py", "test_training.py", "test_vsi_pipeline.py",
          "test_shared_table.py", "test_checkpoint.py", "test_eviction_hints.py",
          "test_input_kinds.py", "test_optimizers.py", "test_loss_scale.py"]


def test_the_switch_picks_the_stock_ops(monkeypatch):
    monkeypatch.delenv(_ops.CPU_KERNELS_ENV, raising=False)
    assert _ops._use_kernel(None) is not bool(tf.config.list_logical_devices("GPU"))
    monkeypatch.setenv(_ops.CPU_KERNELS_ENV, "0")
    assert _ops._use_kernel(None) is False
    assert _ops._use_kernel(True) is True  # an explicit choice wins


@pytest.mark.skipif(os.environ.get(_ops.CPU_KERNELS_ENV) == "0",
                    reason="already running on the stock-op path")
def test_suites_pass_on_the_stock_op_path():
    env = dict(os.environ, **{_ops.CPU_KERNELS_ENV: "0"})
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
         *[str(TESTS / s) for s in SUITES]],
        cwd=TESTS.parent, env=env, capture_output=True, text=True, timeout=1800)
    tail = "\n".join(result.stdout.splitlines()[-30:])
    assert result.returncode == 0, f"stock-op path failed:\n{tail}\n{result.stderr[-2000:]}"
    assert " passed" in tail
