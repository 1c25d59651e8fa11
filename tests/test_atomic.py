"""atomic_path: the target file is either the old one or the new one, never a fragment."""

import pytest

from dspark.atomic import atomic_path


def test_replaces_on_success(tmp_path):
    f = tmp_path / "a.json"
    f.write_text("old")
    with atomic_path(f) as tmp:
        assert tmp.parent == f.parent and tmp != f
        tmp.write_text("new")
        assert f.read_text() == "old"
    assert f.read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json"]


def test_failure_keeps_old_file_and_leaves_no_temporary(tmp_path):
    f = tmp_path / "a.json"
    f.write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_path(f) as tmp:
            tmp.write_text("half")
            raise RuntimeError("killed mid-write")
    assert f.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json"]


def test_suffix_is_kept_for_writers_that_append_one(tmp_path):
    np = pytest.importorskip("numpy")
    f = tmp_path / "done.npy"
    with atomic_path(f, suffix=".npy") as tmp:
        np.save(tmp, np.arange(3))
    assert np.load(f).tolist() == [0, 1, 2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["done.npy"]
