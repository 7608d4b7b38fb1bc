"""lnstrain's Triton kernels run in Triton's CPU interpreter, so the suite checks their numbers without a GPU.

The interpreter must be chosen before the kernels are defined (``TRITON_INTERPRET=1`` when Python starts),
so this runs a share of the interpreter tests in a fresh pytest: the SwiGLU kernels against the eager ops,
the gradient add against torch's add (bitwise), and the rotary kernel's smallest fp16 case against the eager
rotation (bitwise). The whole set (every rotary shape, compiled blocks running the kernels; a few minutes on
two cores) is run by hand:

    TRITON_INTERPRET=1 python -m pytest tests/model/test_rotary_kernel.py tests/model/test_swiglu_kernel.py \\
        tests/model/test_compiled_kernels.py tests/training/test_accumulation_kernel.py

Skipped without Triton (it is in the test extra on Linux x86_64; CUDA builds of torch bring their own).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lnstrain.model.triton_common import triton

ROOT = Path(__file__).resolve().parents[2]
SHARE = ["tests/model/test_swiglu_kernel.py", "tests/training/test_accumulation_kernel.py",
         "tests/model/test_rotary_kernel.py", "-k", "not test_kernel_is_bitwise_the_eager_rotation or (fp16 and 2-1-64)"]


@pytest.mark.slow
@pytest.mark.skipif(triton is None, reason="needs Triton (pip install 'lnstrain[test]' on Linux x86_64)")
def test_the_kernels_agree_with_torch_in_tritons_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *SHARE], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    summary = done.stdout.strip().splitlines()[-1]
    passed = int(summary.split(" passed")[0].split()[-1])
    assert passed >= 45 and "failed" not in summary, summary  # the share ran, not skipped
