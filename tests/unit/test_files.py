"""files.py: writes under fixed names never go through a link planted at the name; appends and
locks refuse it with one line naming the file, replaces put a new file in place of the link."""

import errno
import os
import stat
import threading

import pytest

from diloco_ray import files
from diloco_ray.errors import ConfigError


@pytest.fixture
def victim(tmp_path):
    """A file a planted link points at; the tests check it is never written."""
    path = tmp_path / "victim.txt"
    path.write_text("the victim's own text\n")
    os.chmod(path, 0o644)
    return path


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def plant(link, target):
    link.symlink_to(target)
    return link


def assert_refused(raised, path):
    message = str(raised.value)
    assert "\n" not in message and f"'{path}'" in message, message


# ----------------------------------------------------------------------------- appends and locks


def test_open_append_creates_and_appends(tmp_path, umask_022):
    path = tmp_path / "metrics.jsonl"
    with files.open_append(str(path), buffering=1) as f:
        f.write("one\n")
    with files.open_append(str(path)) as f:
        f.write("two\n")
    assert path.read_text() == "one\ntwo\n"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o644  # as open(path, "a") would make it


@pytest.mark.parametrize("opener", [files.open_append, files.open_lock])
def test_a_link_at_an_appended_or_locked_name_is_refused_in_one_line(tmp_path, victim, opener):
    link = plant(tmp_path / "metrics.jsonl", victim)
    with pytest.raises(ConfigError, match="symbolic link") as raised:
        opener(str(link))
    assert_refused(raised, link)
    assert victim.read_text() == "the victim's own text\n"


@pytest.mark.parametrize("opener", [files.open_append, files.open_lock])
def test_a_dangling_link_creates_nothing_where_it_points(tmp_path, opener):
    link = plant(tmp_path / ".diloco-ray.lock", tmp_path / "created-by-the-run")
    with pytest.raises(ConfigError):
        opener(str(link))
    assert not (tmp_path / "created-by-the-run").exists()


def test_a_fifo_at_the_name_is_refused_without_waiting_for_a_reader(tmp_path):
    fifo = tmp_path / "metrics.jsonl"
    os.mkfifo(fifo)
    outcome = []

    def attempt():
        try:
            files.open_append(str(fifo))
        except ConfigError as e:
            outcome.append(str(e))

    thread = threading.Thread(target=attempt, daemon=True)
    thread.start()
    thread.join(10)
    assert len(outcome) == 1 and "not a regular file" in outcome[0]


def test_open_lock_reads_what_it_wrote_and_a_missing_one_is_not_created(tmp_path):
    path = tmp_path / ".diloco-ray.lock"
    with pytest.raises(FileNotFoundError):
        files.open_lock(str(path), create=False)
    assert not path.exists()
    with files.open_lock(str(path)) as f:
        f.write("pid 1 on host")
    with files.open_lock(str(path), create=False) as f:
        assert f.read() == "pid 1 on host"


# ----------------------------------------------------------------------------- replaces


def test_write_atomic_keeps_the_mode_open_would_give_or_the_one_asked(tmp_path, umask_022):
    path = tmp_path / "config.yaml"
    files.write_atomic(str(path), "a: 1\n")
    assert path.read_text() == "a: 1\n" and stat.S_IMODE(os.stat(path).st_mode) == 0o644
    files.write_atomic(str(path), b"b: 2\n", mode=0o600)
    assert path.read_bytes() == b"b: 2\n" and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert os.listdir(tmp_path) == ["config.yaml"]


def test_write_atomic_replaces_a_link_and_never_writes_through_it(tmp_path, victim):
    link = plant(tmp_path / "config.yaml", victim)
    files.write_atomic(str(link), "mine\n")
    assert not link.is_symlink() and link.read_text() == "mine\n"
    assert victim.read_text() == "the victim's own text\n"


def test_a_failed_replace_leaves_no_temp_file_and_names_the_target(tmp_path):
    path = tmp_path / "results.jsonl"
    path.write_text("old\n")
    with pytest.raises(OSError) as raised:
        with files.replacing(str(path)) as f:
            f.write(b"half")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # a write to an open file names none
    assert raised.value.errno == errno.ENOSPC and raised.value.filename == str(path)
    assert os.listdir(tmp_path) == ["results.jsonl"] and path.read_text() == "old\n"


def test_open_fresh_replaces_a_link_with_a_new_file(tmp_path, victim):
    link = plant(tmp_path / "trial.log", victim)
    with files.open_fresh(str(link)) as f:
        f.write("console\n")
    assert not link.is_symlink() and link.read_text() == "console\n"
    assert victim.read_text() == "the victim's own text\n"


def test_save_figure_replaces_a_link_with_the_figure(tmp_path, victim):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    link = plant(tmp_path / "report.png", victim)
    files.save_figure(fig, str(link), dpi=50)
    plt.close(fig)
    assert not link.is_symlink() and link.read_bytes().startswith(b"\x89PNG")
    assert victim.read_text() == "the victim's own text\n"


# ----------------------------------------------------------------------------- folders


def test_replace_folder_puts_a_whole_new_folder_in_place(tmp_path):
    final = tmp_path / "final"
    final.mkdir()
    (final / "stale.txt").write_text("old")
    files.replace_folder(str(final), lambda tmp: open(os.path.join(tmp, "model.safetensors"), "w").close())
    assert os.listdir(final) == ["model.safetensors"]
    assert os.listdir(tmp_path) == ["final"]


def test_replace_folder_removes_a_link_and_never_writes_through_it(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("theirs")
    final = plant(tmp_path / "final", elsewhere)
    files.replace_folder(str(final), lambda tmp: open(os.path.join(tmp, "config.json"), "w").close())
    assert not final.is_symlink() and os.listdir(final) == ["config.json"]
    assert os.listdir(elsewhere) == ["keep.txt"]


def test_a_failed_folder_write_leaves_nothing_and_old_leftovers_go(tmp_path):
    crashed = tmp_path / ".final.0123abcd.tmp"  # what a killed writer left
    crashed.mkdir()
    (tmp_path / ".final.mine.tmp").mkdir()  # not a name replace_folder makes: left alone

    def fail(tmp):
        open(os.path.join(tmp, "half"), "w").close()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(OSError):
        files.replace_folder(str(tmp_path / "final"), fail)
    assert sorted(os.listdir(tmp_path)) == [".final.mine.tmp"]


def test_leftovers_finds_only_the_temp_names_of_that_name(tmp_path):
    for name in [".final.0123abcd.tmp", ".final_merged.89abcdef.tmp", ".final.xyz.tmp", "final.tmp", "final"]:
        (tmp_path / name).mkdir()
    assert files.leftovers(str(tmp_path), "final") == [str(tmp_path / ".final.0123abcd.tmp")]
    assert files.leftovers(str(tmp_path / "missing"), "final") == []
