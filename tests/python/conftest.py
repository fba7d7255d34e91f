import getpass
import os
import sys
import tempfile

import pytest
import torch

# torch.compile's on-disk cache does not key on ATEN_CPU_CAPABILITY: a kernel compiled for AVX2 is
# reused under `ATEN_CPU_CAPABILITY=default` with headers that lack at::vec, and fails to build.
# One cache per forced capability keeps the suite runnable under every setting.
if os.environ.get("ATEN_CPU_CAPABILITY") and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(
        tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}_{os.environ['ATEN_CPU_CAPABILITY'].lower()}")

# The tests live in folders by area (ops, adapters, engines, tools); what they share is the `support` package
# next to this file. Put tests/python on sys.path whatever the import mode or the folder pytest was pointed at.
TESTS = os.path.dirname(os.path.abspath(__file__))
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)

import ropescale  # noqa: F401  (registers torch.ops.ropescale)


def _demo_folder_state() -> dict[str, tuple[int, int]]:
    """Each file in the user's default demo folder (``ropescale demo`` with no --output): (size, mtime_ns)."""
    from ropescale.cli import DEMO_OUTPUT

    if not os.path.isdir(DEMO_OUTPUT):
        return {}
    return {entry.name: (entry.stat().st_size, entry.stat().st_mtime_ns) for entry in os.scandir(DEMO_OUTPUT)}


@pytest.fixture(scope="session", autouse=True)
def tests_leave_the_users_folders_alone():
    """Tests write only into their own temporary folders: the picture README's first command made in the default
    demo folder is the user's, never rewritten by a test (issue 42: test_cli ran the demo into it)."""
    before = _demo_folder_state()
    yield
    after = _demo_folder_state()
    assert after == before, (f"a test wrote into the user's default demo folder: {before} became {after}; run the "
                             "demo with --output/--plot under tmp_path, or monkeypatch cmd_demo.DEMO_OUTPUT")


def pytest_collection_modifyitems(config, items):
    # Tests marked `cuda` skip cleanly on machines without a GPU (every CI machine).
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def one_thread():
    """One intra-op thread for the test, restored after it. Tiny models only add synchronisation with
    more, and on a busy 2-core machine two threads run several times slower than one."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


class BytesWritten:
    """Counts the bytes every non-view ATen op writes while active (``with counter: ...``), i.e. the size of
    each op's tensor outputs: ``copy_`` into a slice counts the slice, ``cat`` its whole result."""

    def __init__(self):
        self.total = 0
        self.ops = []

    def __enter__(self):
        from torch.utils import _pytree as pytree
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if not func.is_view:
                    written = sum(t.numel() * t.element_size() for t in pytree.tree_leaves(out) if torch.is_tensor(t))
                    counter.total += written
                    counter.ops.append((str(func), written))
                return out

        self.total, self.ops = 0, []
        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)


@pytest.fixture
def bytes_written():
    """A fresh :class:`BytesWritten` counter (a context manager; reusable)."""
    return BytesWritten()
