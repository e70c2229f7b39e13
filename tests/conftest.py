"""Shared fixtures: every op test runs on the CPU and, where CUDA is present, on the GPU.

fp32 exactness is compared against code we do not own only with IEEE fp32 dots: the
environment variable and cuDNN flag are set here, before any kernel module is imported.
"""

import os

os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.backends.cudnn.allow_tf32 = False
torch.backends.cuda.matmul.allow_tf32 = False

# tests/interpret/ runs the Triton kernels under TRITON_INTERPRET=1 in its own process
# (tests/test_triton_interpret.py starts it); a normal session must not import it.
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


#: The files whose tests exercise the Hugging Face path; marked ``hf``, so ``.ci/run`` runs them
#: again on a second transformers release (``pytest -m hf``).
HF_TEST_FILES = {"test_hf_rollback.py", "test_hf_generate.py", "test_hf_graphs.py", "test_hf_model_classes.py",
                 "test_fast_mode_hf.py", "test_cli_generate.py", "test_device_map.py", "test_demo_model.py",
                 "test_mtp.py"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in HF_TEST_FILES:
            item.add_marker(pytest.mark.hf)


def pytest_collection_finish(session):
    """Start the Triton interpreter's process (tests/test_triton_interpret.py) right after
    collection when its test is selected, so it runs beside the rest of the suite."""
    for item in session.items:
        if item.name == "test_triton_kernels_under_interpreter":
            item.module.start_interpreter_suite()
            break


def pytest_sessionfinish(session):
    for item in getattr(session, "items", []):
        if item.name == "test_triton_kernels_under_interpreter":
            item.module.stop_interpreter_suite()  # only if the session ended before its test
            break
