"""Shared test set-up.

Without CUDA the Triton kernels run under the interpreter; the variable must be set before
`fusedlayers.kernels` is imported, because `triton.jit` reads it at decoration time.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# The suite tests the Hopper path's host side and the direct launcher on whatever Triton is
# installed: outside kernels/_compat.py's tested window both are off for users, so the suite
# turns them on (test_compat.py covers the window; FUSEDLAYERS_UNTESTED_TRITON=0 runs the suite
# on the fallback instead).
os.environ.setdefault("FUSEDLAYERS_UNTESTED_TRITON", "1")

HAS_CUDA = torch.cuda.is_available()

# `.ci/gpu tests` on a machine of several GPUs runs one pytest whose xdist workers spread over
# the GPUs (worker i on GPU i mod n), so that xdist balances the files' load across all of them.
_worker = os.environ.get("PYTEST_XDIST_WORKER")
if HAS_CUDA and _worker and os.environ.get("FUSEDLAYERS_SPREAD_GPUS") == "1":
    torch.cuda.set_device(int(_worker.removeprefix("gw")) % torch.cuda.device_count())


def pytest_addoption(parser):
    parser.addoption(
        "--forward-path",
        default="auto",
        choices=("auto", "portable", "sm90"),
        help="pin the attention forward kernel for the whole run (fusedlayers.kernels."
        "set_forward_path): `sm90` runs every call the Hopper kernel covers on it, whatever its "
        "length, so the GPU suite checks that kernel too",
    )
    parser.addoption(
        "--backward-path",
        default="auto",
        choices=("auto", "portable", "sm90"),
        help="pin the attention backward kernels for the whole run (fusedlayers.kernels."
        "set_backward_path): `sm90` runs every non-deterministic call the Hopper backward "
        "covers on it",
    )
    parser.addoption(
        "--sm90-bwd-block-m",
        default="default",
        choices=("default", "128"),
        help="`128`: the sm_90 backward runs d = 64 with its 128-row query steps "
        "(kernels/_flash_bwd_sm90.TILES_M128, also the default tile) for the whole run",
    )


@pytest.fixture(autouse=True, scope="session")
def _launch_signature_checks():
    """Every launch made by signature is checked against Triton's per-argument key, so the
    suite fails where a launcher's signature misses something Triton specializes on."""
    from fusedlayers.kernels._launch import set_signature_checks

    previous = set_signature_checks(True)
    yield
    set_signature_checks(previous)


@pytest.fixture(autouse=True, scope="session")
def _kernel_paths(request):
    from fusedlayers.kernels import _flash_bwd_sm90, set_backward_path, set_forward_path

    previous = set_forward_path(request.config.getoption("--forward-path"))
    previous_bwd = set_backward_path(request.config.getoption("--backward-path"))
    tiles = dict(_flash_bwd_sm90.TILES)
    if request.config.getoption("--sm90-bwd-block-m") == "128":
        _flash_bwd_sm90.TILES.update(_flash_bwd_sm90.TILES_M128)
    yield
    set_forward_path(previous)
    set_backward_path(previous_bwd)
    _flash_bwd_sm90.TILES.update(tiles)


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device():
    """The device the kernel tests run on: CUDA when present, else the Triton interpreter."""
    return "cuda" if HAS_CUDA else "cpu"


@pytest.fixture
def kernels_on_cpu(monkeypatch):
    """Send CPU tensors to the attention kernels (the modules pick the reference on CPU
    otherwise); `backend="reference"` still takes the reference."""
    import fusedlayers.attention.frontend as front_end

    original = front_end.choose_backend

    def choose(backend, q, *args, **kwargs):
        if backend == "reference":
            return original(backend, q, *args, **kwargs)
        return True, "test: kernels under TRITON_INTERPRET"

    monkeypatch.setattr(front_end, "choose_backend", choose)
