"""storage.py: remote URIs, staging folders, and Mirror transfers against a local moto S3."""

import os
import pickle
import stat
import subprocess
import sys
import time
import uuid

import pyarrow.fs as pafs
import pytest
import s3_server

from diloco_ray.errors import ConfigError
from diloco_ray.persist import storage, uris

s3_bucket = s3_server.s3_bucket  # module-scoped fixture: one moto server for this file


@pytest.fixture
def mirror(s3_bucket, tmp_path):
    """A Mirror of a fresh prefix in the moto bucket, staged in tmp_path/stage."""
    return storage.Mirror(s3_bucket.uri(f"runs/{uuid.uuid4().hex[:8]}"), local=str(tmp_path / "stage"))


def write(path, data: bytes):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def tree(root):
    """relative path -> bytes of every file under root."""
    out = {}
    for folder, _, files in os.walk(root):
        for name in files:
            full = os.path.join(folder, name)
            with open(full, "rb") as f:
                out[os.path.relpath(full, root)] = f.read()
    return out


# ----------------------------------------------------------------------------- URIs (offline)


@pytest.mark.parametrize(
    "path,expected",
    [
        ("s3://b/p", True),
        ("gs://b/p", True),
        ("gcs://b", True),
        ("S3://b/p", True),
        ("outputs/run", False),
        ("/abs/run", False),
        (None, False),
        ("", False),
        ("ftp://b/p", False),
        ("file:///tmp/x", False),
        ("s3:b/p", False),
    ],
)
def test_is_remote(path, expected):
    assert storage.is_remote(path) is expected


@pytest.mark.parametrize(
    "uri",
    [
        "outputs/run",
        "/abs/run",
        "s3://bucket",
        "s3://bucket/",
        "s3://my.bucket-1/a/b/c",
        "gs://bucket/a",
        "gcs://bucket/a",
        "s3://b/a%20b",
        "s3://b/p?region=eu-west-1&scheme=http",
        "gs://b/p?project_id=x&retry_limit_seconds=5",
    ],
)
def test_check_uri_accepts(uri):
    storage.check_uri("my_field", uri)


@pytest.mark.parametrize(
    "uri,words",
    [
        ("ftp://x", ["not allowed", "s3://bucket/path", "gs://bucket/path"]),
        ("http://host/p", ["not allowed"]),
        ("hdfs://namenode/p", ["not allowed"]),
        ("file:///tmp/run", ["not allowed", "plain path"]),
        ("s3://", ["no bucket"]),
        ("s3:///path", ["no bucket"]),
        ("gs://", ["no bucket"]),
        ("s3:bucket/p", ["not a valid URI", "s3://bucket/path"]),
        ("s3://key:secret@bucket/p", ["credentials"]),
        ("s3://bucket:9000/p", ["invalid bucket name"]),
        ("s3://bucket/p#x", ["fragment"]),
        ("s3://bucket//p", ["path segment"]),
        ("s3://bucket/a/../b", ["path segment"]),
        ("s3://bucket/a b", ["whitespace"]),
        ("s3://bucket/p?foo=1", ["'foo'", "region"]),
        ("gs://bucket/p?region=x", ["'region'", "project_id"]),
    ],
)
def test_check_uri_rejects_naming_the_field(uri, words):
    with pytest.raises(ConfigError) as info:
        storage.check_uri("my_field", uri)
    msg = str(info.value)
    assert msg.startswith("my_field: ")
    assert repr(storage.redact(uri)) in msg and "secret" not in msg  # a credential is never echoed
    for word in words:
        assert word in msg


@pytest.mark.parametrize("scheme,options", sorted(uris._QUERY_OPTIONS.items()))
def test_allowed_query_options_are_exactly_pyarrows(scheme, options):
    """The allow-list matches what pyarrow's from_uri takes (offline: s3 gets a region)."""
    values = {
        "scheme": "http",
        "allow_bucket_creation": "false",
        "allow_bucket_deletion": "false",
        "tls_verify_certificates": "true",
        "retry_limit_seconds": "5",
    }
    base = f"{scheme}://b/p?region=us-east-1" if scheme == "s3" else f"{scheme}://b/p?scheme=https"
    for key in options:
        pafs.FileSystem.from_uri(f"{base}&{key}={values.get(key, 'x')}")
    with pytest.raises(Exception, match="Unexpected query parameter"):
        pafs.FileSystem.from_uri(f"{base}&not_an_option=1")


@pytest.mark.parametrize(
    "uri", ["gs://b/a%20b/c/", "gcs://b", "s3://b/p/q/?region=us-east-1", "s3://b/x%2Fy?region=us-east-1"]
)
def test_filesystem_path_matches_pyarrow_offline(uri):
    fs, path = storage.filesystem(uri)
    ref_fs, ref_path = pafs.FileSystem.from_uri(uri)
    assert path == ref_path and not path.endswith("/")
    assert type(fs) is type(ref_fs)
    assert storage.filesystem(uri)[0] is fs  # cached per process


def test_gcs_needs_no_network_or_credentials(monkeypatch):
    monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
    mirror = storage.Mirror("gs://some-bucket/run")
    assert isinstance(mirror.fs, pafs.GcsFileSystem)
    assert mirror.remote(os.path.join(mirror.local, "a", "b.json")) == "gs://some-bucket/run/a/b.json"


def test_mirror_construction_is_lazy_and_picklable(monkeypatch, tmp_path):
    """Building (or unpickling) a Mirror never builds a filesystem: for S3 that is a network call."""

    def boom(*args, **kwargs):
        raise AssertionError("filesystem built")

    monkeypatch.setattr(storage, "_filesystem", boom)
    mirror = storage.Mirror("s3://bucket/run/", local=str(tmp_path))
    copy = pickle.loads(pickle.dumps(mirror))
    assert (copy.uri, copy.local) == ("s3://bucket/run", str(tmp_path))
    assert copy.remote("x") == "s3://bucket/run/x"
    with pytest.raises(AssertionError, match="filesystem built"):
        copy.exists("x")


def test_mirror_rejects_bad_and_local_uris():
    with pytest.raises(ConfigError, match="^output_dir: 'ftp://b/p' is not allowed"):
        storage.Mirror("ftp://b/p")
    with pytest.raises(ConfigError, match="^output_dir: 'outputs' is not a remote URI"):
        storage.Mirror("outputs")


# ----------------------------------------------------------------------------- staging


def test_staging_root_is_deterministic_and_distinct(monkeypatch, tmp_path):
    monkeypatch.setenv("DILOCO_RAY_STAGING", str(tmp_path / "stage"))
    root = storage.staging_root("s3://bucket/runs/exp 1".replace(" ", "%20"))
    assert os.path.dirname(root) == str(tmp_path / "stage")
    assert os.path.basename(root).startswith("s3-bucket-runs_exp_1-")
    assert not os.path.exists(root)  # not created
    # Same in a fresh process (same environment), as on another node.
    code = "from diloco_ray.persist import storage; print(storage.staging_root('s3://bucket/runs/exp%201'))"
    other = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=dict(os.environ)
    ).stdout.strip()
    assert other == root
    # Spellings of one folder share; different folders never do, even when they sanitise alike.
    assert storage.staging_root("s3://bucket/runs/exp%201/") == root
    assert storage.staging_root("gcs://bucket/a") == storage.staging_root("gs://bucket/a")
    distinct = [
        "s3://bucket/runs/exp_1",
        "s3://bucket/runs/exp%201x",
        "gs://bucket/runs/exp%201",
        "s3://bucket/runs",
        "s3://bucket",
        "s3://bucket/runs/exp%201?region=eu-west-1",
    ]
    roots = {storage.staging_root(u) for u in distinct} | {root}
    assert len(roots) == len(distinct) + 1


def test_staging_base_defaults_to_the_users_cache_folder(monkeypatch, tmp_path):
    """Not a fixed name in the shared temp folder: $XDG_CACHE_HOME, else ~/.cache."""
    import tempfile

    monkeypatch.delenv("DILOCO_RAY_STAGING", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    root = storage.staging_root("gs://b/p")
    assert os.path.dirname(root) == str(tmp_path / "xdg" / "diloco-ray" / "staging")
    assert storage.Mirror("gs://b/p").local == root
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    base = storage.staging_base()
    assert base == str(tmp_path / "home" / ".cache" / "diloco-ray" / "staging")
    assert base != os.path.join(tempfile.gettempdir(), "diloco-ray-staging")


def test_a_fresh_staging_base_is_created_private(monkeypatch, tmp_path):
    monkeypatch.setenv("DILOCO_RAY_STAGING", str(tmp_path / "fresh" / "stage"))
    storage.staging_root("s3://b/run")
    assert stat.S_IMODE(os.stat(tmp_path / "fresh" / "stage").st_mode) == 0o700


def test_a_staging_base_removed_while_the_process_runs_is_made_private_again(monkeypatch, tmp_path):
    import shutil

    base = tmp_path / "stage"
    monkeypatch.setenv("DILOCO_RAY_STAGING", str(base))
    root = storage.staging_root("s3://b/run")
    shutil.rmtree(base)  # a cleaned cache: the check is cached, the folder is not
    assert storage.staging_root("s3://b/run") == root
    assert stat.S_IMODE(os.stat(base).st_mode) == 0o700


def test_a_staging_base_others_can_reach_is_refused(monkeypatch, tmp_path):
    base = tmp_path / "stage"
    base.mkdir(mode=0o755)
    os.chmod(base, 0o755)  # whatever the umask
    monkeypatch.setenv("DILOCO_RAY_STAGING", str(base))
    with pytest.raises(ConfigError) as err:
        storage.staging_root("s3://b/run")
    message = str(err.value)
    assert "\n" not in message and f"'{base}'" in message and "mode 0755" in message
    assert "DILOCO_RAY_STAGING" in message and "0700" in message
    assert stat.S_IMODE(os.stat(base).st_mode) == 0o755  # refused, not changed behind the user's back


def test_a_staging_base_owned_by_another_user_is_refused(monkeypatch, tmp_path):
    if os.getuid() != 0:
        pytest.skip("giving a folder to another user (chown) needs root")
    base = tmp_path / "stage"
    base.mkdir(mode=0o700)
    os.chown(base, 65534, 65534)  # nobody: created first by someone else
    monkeypatch.setenv("DILOCO_RAY_STAGING", str(base))
    with pytest.raises(ConfigError) as err:
        storage.Mirror("s3://b/run")
    message = str(err.value)
    assert "\n" not in message and f"'{base}'" in message and "owned by uid 65534" in message
    assert "DILOCO_RAY_STAGING" in message


def test_a_staging_base_that_is_a_link_is_refused(monkeypatch, tmp_path):
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    (tmp_path / "stage").symlink_to(tmp_path / "elsewhere")
    monkeypatch.setenv("DILOCO_RAY_STAGING", str(tmp_path / "stage"))
    with pytest.raises(ConfigError, match="symbolic link"):
        storage.staging_root("s3://b/run")


def test_for_output_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("DILOCO_RAY_STAGING", str(tmp_path))
    monkeypatch.setattr(storage, "_MIRRORS", {})
    assert storage.for_output_dir("outputs/run") is None
    mirror = storage.for_output_dir("gs://b/run")
    assert mirror is storage.for_output_dir("gs://b/run/") is storage.for_output_dir("gcs://b/run")
    assert mirror.local == storage.staging_root("gs://b/run")
    assert storage.for_output_dir("gs://b/other") is not mirror


def test_remote_maps_local_paths_and_refuses_outside(tmp_path):
    local = str(tmp_path / "stage")
    mirror = storage.Mirror("s3://b/run?region=eu-west-1", local=local)
    assert mirror.remote(local) == "s3://b/run?region=eu-west-1"
    assert mirror.remote(os.path.join(local, "ckpt", "a b.json")) == "s3://b/run/ckpt/a%20b.json?region=eu-west-1"
    assert mirror.remote("ckpt/x") == "s3://b/run/ckpt/x?region=eu-west-1"
    assert mirror.remote("s3://b/run/ckpt/x") == "s3://b/run/ckpt/x?region=eu-west-1"
    for bad in [
        "../x",
        str(tmp_path / "stage2" / "x"),
        "/etc/passwd",
        os.path.join(local, "..", "y"),
        "s3://b/running/x",
        "s3://other/run/x",
    ]:
        with pytest.raises(ValueError):
            mirror.remote(bad)


# ----------------------------------------------------------------------------- transfers (moto)


def test_upload_download_round_trip(s3_bucket, mirror, tmp_path):
    files = {
        "config.yaml": b"lr: 0.1\n",
        "empty.txt": b"",
        "ckpt/round-00000001/weights.safetensors": os.urandom((8 << 20) + 123),  # > one chunk
        "ckpt/round-00000001/manifest.json": b'{"files": []}',
        "ckpt/round-00000001/deep/er/x.gz": b"not gzip at all",  # pyarrow's "detect" would gzip it
        "logs/a b.txt": b"space",
    }
    for rel, data in files.items():
        write(os.path.join(mirror.local, rel), data)
    sent = mirror.upload(mirror.local)
    assert sent == sum(len(d) for d in files.values())
    prefix = mirror.uri.split("/", 3)[3] + "/"
    assert s3_bucket.keys(prefix) == sorted(prefix + r for r in files)
    assert (
        s3_bucket.client.get_object(Bucket=s3_bucket.bucket, Key=prefix + "ckpt/round-00000001/deep/er/x.gz")[
            "Body"
        ].read()
        == b"not gzip at all"
    )

    other = storage.Mirror(mirror.uri, local=str(tmp_path / "elsewhere"))
    assert other.download("ckpt") is True
    assert tree(other.local) == {os.path.join(*k.split("/")): v for k, v in files.items() if k.startswith("ckpt/")}
    assert other.download(os.path.join(other.local, "config.yaml")) is True
    assert other.download(".") is True
    assert tree(other.local) == {os.path.join(*k.split("/")): v for k, v in files.items()}

    # Overwrites, and a single file uploads alone.
    write(os.path.join(mirror.local, "config.yaml"), b"lr: 0.2\n")
    assert mirror.upload("config.yaml") == len(b"lr: 0.2\n")
    assert other.download("config.yaml") and tree(other.local)["config.yaml"] == b"lr: 0.2\n"
    with pytest.raises(FileNotFoundError):
        mirror.upload("nope")


def test_folder_upload_is_sorted_and_last_files_go_last(monkeypatch, mirror):
    for rel in ["ckpt/b.bin", "ckpt/a.bin", "ckpt/sub/c.bin", "ckpt/manifest.json", "meta.json"]:
        write(os.path.join(mirror.local, rel), rel.encode())
    order = []
    real = storage.put_file

    def recording(fs, local, remote):
        order.append(os.path.relpath(local, mirror.local).replace(os.sep, "/"))
        return real(fs, local, remote)

    monkeypatch.setattr(storage, "put_file", recording)
    mirror.upload("ckpt")
    assert order == ["ckpt/a.bin", "ckpt/b.bin", "ckpt/manifest.json", "ckpt/sub/c.bin"]
    order.clear()
    mirror.upload_files([os.path.join(mirror.local, "ckpt")], last=["ckpt/manifest.json", "meta.json"])
    assert order == ["ckpt/a.bin", "ckpt/b.bin", "ckpt/sub/c.bin", "ckpt/manifest.json", "meta.json"]
    assert mirror.read_bytes("ckpt/manifest.json") == b"ckpt/manifest.json"


def test_download_missing_returns_false_and_leaves_nothing(mirror):
    assert mirror.download("ckpt/round-00000009/manifest.json") is False
    assert mirror.download("ckpt") is False
    assert not os.path.exists(mirror.local)


def test_interrupted_download_keeps_old_file_and_no_partial(monkeypatch, mirror):
    mirror.write_bytes("big.bin", b"new" * 1000)
    write(os.path.join(mirror.local, "big.bin"), b"old")
    real_fs = mirror.fs

    class Breaking:
        """Delegates to the real filesystem; its input streams fail after the first read."""

        def __getattr__(self, name):
            return getattr(real_fs, name)

        def open_input_stream(self, path, **kwargs):
            stream = real_fs.open_input_stream(path, **kwargs)
            calls = []

            class Stream:
                def __enter__(self):
                    return self

                def __exit__(self, *exc):
                    stream.close()

                def read(self, n=None):
                    calls.append(n)
                    if len(calls) > 1:
                        raise OSError("connection reset")
                    return stream.read(10)

            return Stream()

    monkeypatch.setattr(storage.Mirror, "fs", property(lambda self: Breaking()))
    with pytest.raises(OSError, match="connection reset"):
        mirror.download("big.bin")
    assert os.listdir(mirror.local) == ["big.bin"]  # no .part file left behind
    with open(os.path.join(mirror.local, "big.bin"), "rb") as f:
        assert f.read() == b"old"


def test_a_download_is_held_to_the_size_listed(mirror):
    write(os.path.join(mirror.local, "f.bin"), b"x" * 100)
    mirror.upload("f.bin")
    os.remove(os.path.join(mirror.local, "f.bin"))
    assert mirror.sizes("") == {"f.bin": 100}
    with pytest.raises(OSError, match="holds 100 bytes, not the 50 listed"):
        mirror.download("f.bin", size=50)  # grew since the listing: refused before the transfer
    # Replaced between the size check and the read: the transfer stops past the size.
    with pytest.raises(OSError, match="more than 10 bytes"):
        uris.get_file(mirror.fs, mirror.paths.remote_path("f.bin"), os.path.join(mirror.local, "f.bin"), 10)
    assert os.listdir(mirror.local) == []  # neither left a file, partial or whole
    assert mirror.download("f.bin", size=100) and tree(mirror.local) == {"f.bin": b"x" * 100}


def test_remote_only_operations(s3_bucket, mirror):
    before = time.time()
    assert mirror.read_bytes("a/x.json") is None and mirror.mtime("a/x.json") is None
    assert not mirror.exists("a/x.json") and not mirror.exists("a")
    assert mirror.listdir("a") == [] and mirror.listdir(".") == []
    mirror.write_bytes("a/x.json", b"{}")
    mirror.write_bytes("a/b/y.bin", b"\x00\x01")
    mirror.write_bytes("z.txt", b"z")
    assert not os.path.exists(mirror.local)  # remote only
    assert mirror.read_bytes("a/x.json") == b"{}"
    assert mirror.exists("a/x.json") and mirror.exists("a") and mirror.exists("a/b")
    assert mirror.listdir(".") == ["a", "z.txt"]
    assert mirror.listdir(os.path.join(mirror.local, "a")) == ["b", "x.json"]
    assert mirror.listdir("z.txt") == []
    assert before - 2 <= mirror.mtime("a/x.json") <= time.time() + 2  # S3 keeps whole seconds
    assert mirror.mtime("a") is None  # folders have none

    mirror.delete("a/x.json")
    assert not mirror.exists("a/x.json") and mirror.read_bytes("a/x.json") is None
    mirror.delete("a")  # recursive
    assert not mirror.exists("a/b/y.bin") and mirror.listdir("a") == []
    mirror.delete("never/was")  # missing is fine
    assert mirror.read_bytes("z.txt") == b"z"
    prefix = mirror.uri.split("/", 3)[3] + "/"
    assert [k for k in s3_bucket.keys(prefix) if not k.endswith("/")] == [prefix + "z.txt"]


def test_delete_of_a_whole_bucket_mirror_empties_but_keeps_the_bucket(s3_bucket, tmp_path):
    s3_bucket.client.create_bucket(Bucket="whole")
    mirror = storage.Mirror("s3://whole", local=str(tmp_path))
    mirror.write_bytes("a/b", b"1")
    mirror.delete(".")
    assert s3_bucket.client.list_objects_v2(Bucket="whole").get("KeyCount") == 0
    mirror.check_writable()  # the bucket is still there


def test_check_writable(s3_bucket, mirror, tmp_path):
    mirror.check_writable()
    prefix = mirror.uri.split("/", 3)[3] + "/"
    assert not [k for k in s3_bucket.keys(prefix) if "probe" in k]

    missing = storage.Mirror("s3://no-such-bucket/run", local=str(tmp_path))
    with pytest.raises(ConfigError) as info:
        missing.check_writable()
    msg = str(info.value)
    assert msg.startswith("output_dir: bucket 'no-such-bucket' does not exist or is not reachable at ")
    assert s3_bucket.endpoint in msg and "NO_SUCH_BUCKET" in msg
    # The same failure during a run's upload is also a ConfigError; other failures are not.
    write(os.path.join(missing.local, "f"), b"x")
    with pytest.raises(ConfigError, match="^output_dir: bucket 'no-such-bucket'"):
        missing.upload("f")
    assert missing.read_bytes("f") is None and missing.listdir(".") == []
