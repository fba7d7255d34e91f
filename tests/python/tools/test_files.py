"""ropescale.files: outputs written whole or not at all, with the umask's mode, and checked before the work (issue 55).

The unwritable-folder cases monkeypatch ``os.access`` (as ropescale.files sees it) rather than chmod a folder: the
suite runs as root in CI, where a chmod-ed folder is still writable and ``os.access`` says so.
"""

import os

import pytest

from ropescale import files


@pytest.fixture(params=[0o022, 0o077], ids=["umask022", "umask077"])
def umask(request):
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


def listing(folder):
    return sorted(p.name for p in folder.iterdir())


def test_umask_reads_the_process_umask_without_changing_it(umask):
    assert files.umask() == umask
    assert files.umask() == umask


def test_atomic_file_appears_whole_with_the_umasks_mode(tmp_path, umask):
    dst = tmp_path / "out.txt"
    with files.atomic_file(dst) as part:
        part.write_text("whole")
        assert part.parent == tmp_path and part != dst and not dst.exists()
    assert dst.read_text() == "whole" and listing(tmp_path) == ["out.txt"]
    assert dst.stat().st_mode & 0o777 == 0o666 & ~umask  # not tempfile's 0600


def test_atomic_directory_appears_whole_with_the_umasks_mode(tmp_path, umask):
    dst = tmp_path / "model"
    with files.atomic_directory(dst) as part:
        (part / "config.json").write_text("{}")
        assert part.parent == tmp_path and not dst.exists()
    assert listing(tmp_path) == ["model"] and listing(dst) == ["config.json"]
    assert dst.stat().st_mode & 0o777 == 0o777 & ~umask  # not tempfile's 0700


@pytest.mark.parametrize("error", [KeyboardInterrupt, OSError])
def test_an_interrupted_atomic_file_leaves_nothing_and_keeps_the_old_file(tmp_path, error):
    with pytest.raises(error):
        with files.atomic_file(tmp_path / "new.txt") as part:
            part.write_text("half")
            raise error()
    assert listing(tmp_path) == []
    (tmp_path / "old.txt").write_text("keep me")
    with pytest.raises(error):
        with files.atomic_file(tmp_path / "old.txt") as part:
            part.write_text("half")
            raise error()
    assert listing(tmp_path) == ["old.txt"] and (tmp_path / "old.txt").read_text() == "keep me"


@pytest.mark.parametrize("error", [KeyboardInterrupt, OSError])
def test_an_interrupted_atomic_directory_leaves_nothing(tmp_path, error):
    with pytest.raises(error):
        with files.atomic_directory(tmp_path / "model") as part:
            (part / "sub").mkdir()
            (part / "sub" / "weights.bin").write_bytes(b"\0" * 10)
            raise error()
    assert listing(tmp_path) == []


def test_atomic_file_without_overwrite_never_replaces_a_file(tmp_path):
    dst = tmp_path / "out.txt"
    dst.write_text("keep me")
    with pytest.raises(FileExistsError, match="never overwrites"):
        with files.atomic_file(dst, overwrite=False):
            pytest.fail("the block ran for an existing destination")
    dst.unlink()
    with pytest.raises(FileExistsError):  # made while the temporary was being written
        with files.atomic_file(dst, overwrite=False) as part:
            part.write_text("new")
            dst.write_text("keep me")
    assert listing(tmp_path) == ["out.txt"] and dst.read_text() == "keep me"


def test_atomic_directory_refuses_an_existing_destination(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "keep").write_text("keep me")
    with pytest.raises(FileExistsError, match="already exists"):
        with files.atomic_directory(tmp_path / "model"):
            pytest.fail("the block ran for an existing destination")
    (tmp_path / "empty").mkdir()  # an empty folder too (rename(2) would replace it)
    with pytest.raises(FileExistsError):
        with files.atomic_directory(tmp_path / "empty"):
            pass
    with pytest.raises(FileExistsError, match="appeared while it was being written"):
        with files.atomic_directory(tmp_path / "late") as part:
            (part / "a").write_text("new")
            (tmp_path / "late").mkdir()
    assert listing(tmp_path) == ["empty", "late", "model"] and listing(tmp_path / "late") == []
    assert listing(tmp_path / "model") == ["keep"]


@pytest.fixture
def unwritable(monkeypatch):
    """Makes ``folder`` unwritable as ropescale.files sees it (os.access), whoever runs the suite."""
    refused = set()
    access = os.access

    def fake_access(path, mode, *args, **kwargs):
        if os.path.abspath(path) in refused and mode & os.W_OK:
            return False
        return access(path, mode, *args, **kwargs)

    monkeypatch.setattr(files.os, "access", fake_access)
    return lambda folder: refused.add(os.path.abspath(folder)) or folder


def test_check_new_path(tmp_path, unwritable):
    assert files.check_new_path(tmp_path / "new", "DST") == tmp_path / "new"
    (tmp_path / "exists").write_text("")
    (tmp_path / "a_file").write_text("")
    for path, message in ((tmp_path / "exists", "DST: .* already exists"),
                          (tmp_path / "missing" / "new", "DST: the folder .*missing does not exist"),
                          (tmp_path / "a_file" / "new", "DST: .*a_file is not a folder"),
                          (unwritable(tmp_path / "locked") / "new", "DST: the folder .*locked is not writable")):
        if path.parent.name == "locked":
            path.parent.mkdir()
        with pytest.raises(ValueError, match=message):
            files.check_new_path(path, "DST")


def test_check_writable_file(tmp_path, unwritable):
    (tmp_path / "old.txt").write_text("")
    assert files.check_writable_file(tmp_path / "old.txt", "--plot") == tmp_path / "old.txt"  # replaced: allowed
    assert files.check_writable_file(tmp_path / "new.txt", "--plot") == tmp_path / "new.txt"
    (tmp_path / "a_file").write_text("")
    (tmp_path / "locked").mkdir()
    unwritable(tmp_path / "locked")
    (tmp_path / "readonly.txt").write_text("")
    unwritable(tmp_path / "readonly.txt")
    for path, message in ((tmp_path, "--plot: .* is a folder, not a file"),
                          (tmp_path / "missing" / "x.png", "--plot: the folder .*missing does not exist"),
                          (tmp_path / "a_file" / "x.png", "--plot: .*a_file is not a folder"),
                          (tmp_path / "locked" / "x.png", "--plot: the folder .*locked is not writable"),
                          (tmp_path / "readonly.txt", "--plot: .*readonly.txt is not writable")):
        with pytest.raises(ValueError, match=message):
            files.check_writable_file(path, "--plot")


def test_check_writable_directory(tmp_path, unwritable):
    assert files.check_writable_directory(tmp_path, "--cache-dir") == tmp_path
    deep = tmp_path / "a" / "b" / "c"
    assert files.check_writable_directory(deep, "--cache-dir") == deep and not (tmp_path / "a").exists()
    (tmp_path / "a_file").write_text("")
    (tmp_path / "locked").mkdir()
    unwritable(tmp_path / "locked")
    for path, message in ((tmp_path / "a_file", "--cache-dir: .*a_file is a file, not a folder"),
                          (tmp_path / "a_file" / "x" / "y", "--cache-dir: .*a_file is a file, so .* cannot be made"),
                          (tmp_path / "locked", "--cache-dir: the folder .*locked is not writable"),
                          (tmp_path / "locked" / "new", "--cache-dir: the folder .*locked is not writable")):
        with pytest.raises(ValueError, match=message):
            files.check_writable_directory(path, "--cache-dir")
