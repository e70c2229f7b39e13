"""Shared fixtures: every op test runs on the CPU and, where CUDA is present, on the GPU.

fp32 exactness is compared against code we do not own only with IEEE fp32 dots: the
environment variable and cuDNN flag are set here, before any kernel module is imported.
"""

import os
from pathlib import Path

os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")
# One intra-op thread per test process (and, through the environment, per subprocess the tests
# start), unless the caller chose: the tiny models' matmuls are microseconds, so a second thread
# gains nothing on an idle 2-core machine (a 256-token MoE generate test: 15 s either way), while
# with the second core taken (another job, or the other xdist worker of .ci/run's `-n 2`) torch's
# two threads made the same tests 10x slower (268 s).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

torch.backends.cudnn.allow_tf32 = False
torch.backends.cuda.matmul.allow_tf32 = False

# tests/interpret/ runs the Triton kernels under TRITON_INTERPRET=1, in a pytest process of its
# own (.ci/run's second command); a normal test run must not import it.
collect_ignore = [] if os.environ.get("TRITON_INTERPRET") == "1" else ["interpret"]

HAS_CUDA = torch.cuda.is_available()
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")]),
]


@pytest.fixture(params=DEVICES)
def device(request):
    return torch.device(request.param)


@pytest.fixture(autouse=True)
def _hf_reference_kernels():
    """Hugging Face layers run their PyTorch reference path in every test: transformers binds
    them to fla-core where it is installed (the GPU machine), and fla's kernels would then run
    on CPU tensors too (``ssm_spec.hf.kernels``)."""
    from ssm_spec.hf.kernels import hf_reference_kernels

    with hf_reference_kernels():
        yield


#: The Hugging Face path's tests live under tests/hf/; every one is marked ``hf``, so ``.ci/run``
#: runs them again on a second transformers release (``pytest -m hf``).
HF_TESTS = Path(__file__).resolve().parent / "hf"


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.resolve().is_relative_to(HF_TESTS):
            item.add_marker(pytest.mark.hf)

