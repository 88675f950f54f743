"""The channel as a hostile region would try it, on a real TLS socket on this machine: one
test per way in that a red team found, each showing the home refuses it in one line and
keeps serving the honest regions (its threads, memory and CPU its own)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
from channel_home import TOKENS, make_home, region, write_tokens
from tls_files import make_tls

from diloco_ray.channel import client as client_module
from diloco_ray.channel import frames
from diloco_ray.channel.client import ChannelRefused
from diloco_ray.channel.credentials import RegionTokens, read_token
from diloco_ray.channel.server import REGION_KEY, SERVICE
from diloco_ray.errors import UserInputError


@pytest.fixture
def home(tmp_path):
    server = make_home(tmp_path)
    yield server
    server.stop(0)


def raw(home, method: str, request: bytes, name: str = "eu", token=None, timeout: float = 10):
    """One call as any peer could make it: its bytes, its token, its claimed name."""
    channel = grpc.secure_channel(
        f"127.0.0.1:{home.port}",
        grpc.ssl_channel_credentials(root_certificates=home.ca),
        [("grpc.ssl_target_name_override", "localhost"), ("grpc.max_send_message_length", 64 << 20)],
    )
    secret = (token or TOKENS[name]).secret if token != "" else "nope"
    meta = (("authorization", f"Bearer {secret}"), (REGION_KEY, name))
    try:
        return channel.unary_unary(f"/{SERVICE}/{method}")(request, metadata=meta, timeout=timeout)
    finally:
        channel.close()


def refusal(home, method: str, header: dict, **kw) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as refused:
        raw(home, method, frames.encode(header), **kw)
    return refused.value


def test_one_region_s_token_cannot_join_put_or_take_as_another(home):
    with pytest.raises(ChannelRefused, match="the call claims 'us', its token says 'eu'"):
        region(home, name="us", token=TOKENS["eu"]).join()
    eu, us = region(home), region(home, name="us")
    eu.join(), us.join()
    home.expect("us", "r/us/5/0")
    eu.upload("r/us/5/0", b"from eu")
    assert eu.lines[-1].endswith("upload 'r/us/5/0' is not one the home waits for from this region; not sent")
    us.upload("r/us/5/0", b"from us")
    assert home.take("r/us/5/0", timeout_s=5) == b"from us"


def test_silence_hands_a_region_s_name_to_nobody_else_and_its_notices_wait_for_it(home):
    eu = region(home)
    eu.join()
    seq = home.notify("eu", {"job": 1})
    home.session_timeout_s = 0.0  # eu went silent
    with pytest.raises(ChannelRefused, match="its token says 'us'"):
        region(home, name="eu", token=TOKENS["us"]).join()
    eu.session = None
    assert eu.wait(after=0) == (seq, {"job": 1})  # the same agent: its session and notices back


def test_a_region_cannot_spoil_another_s_upload_between_its_chunks(home):
    eu, us = region(home), region(home, name="us")
    eu.join(), us.join()
    home.expect("us", "r/us/1/0")
    payload = os.urandom(3 << 20)
    real = us._call_once
    calls = []

    def between(method, header, **kw):
        calls.append(1)
        if len(calls) == 2:  # eu tries to restart us's upload with another size and digest
            eu.upload("r/us/1/0", b"x" * 10)
            assert "is not one the home waits for" in eu.lines[-1]
        return real(method, header, **kw)

    us._call_once = between
    us.upload("r/us/1/0", payload)
    assert home.take("r/us/1/0", timeout_s=5) == payload


def test_an_upload_nobody_asked_for_or_over_the_limit_holds_nothing(home):
    eu = region(home)
    eu.join()
    home.expect("eu", "r/eu/9/0")
    header = {"offset": 0, "digest": "0" * 64, "region": "eu", "session": eu.session}
    for key, total, code in [
        ("r/eu/9/0", 1 << 30, grpc.StatusCode.INVALID_ARGUMENT),  # 1 GB declared: over the frame limit
        ("r/eu/8/0", 100, grpc.StatusCode.NOT_FOUND),  # a key the home never asked eu for
    ]:
        with pytest.raises(grpc.RpcError) as refused:
            raw(home, "Put", frames.encode({**header, "key": key, "total": total}, b"z" * 100))
        assert refused.value.code() is code
    assert home.held_upload_bytes() == 0


def test_a_replayed_message_is_refused_by_its_key(home):
    """A reply taken once reaches no sync again: its key (the home's run, the launch, the
    fragment) is asked for once. The same bytes again under it are let go (answered as
    whole, as a resend whose last reply was lost is, and held nowhere); under the next
    launch's key before the home asks for it, refused."""
    eu = region(home)
    eu.join()
    home.expect("eu", "r/eu/4/0")
    eu.upload("r/eu/4/0", b"honest")
    assert home.take("r/eu/4/0", timeout_s=5) == b"honest"
    header = {"offset": 0, "total": 6, "digest": hashlib.sha256(b"honest").hexdigest(), "region": "eu"}
    raw(home, "Put", frames.encode({**header, "key": "r/eu/4/0", "session": eu.session}, b"honest"))
    assert home.take("r/eu/4/0", timeout_s=0.2) is None and home.held_upload_bytes() == 0
    with pytest.raises(grpc.RpcError) as refused:
        raw(home, "Put", frames.encode({**header, "key": "r/eu/5/0", "session": eu.session}, b"honest"))
    assert refused.value.code() is grpc.StatusCode.NOT_FOUND and home.held_upload_bytes() == 0
    home.expect("eu", "r/eu/5/0")
    assert home.take("r/eu/5/0", timeout_s=0.2) is None  # the replay did not wait there for the ask


def test_a_partial_upload_left_alone_is_let_go(home):
    eu = region(home)
    eu.join()
    home.expect("eu", "r/eu/2/0")
    home._uploads.stale_s = 0.2
    header = {"key": "r/eu/2/0", "offset": 0, "total": 1 << 21, "digest": "0" * 64, "region": "eu"}
    raw(home, "Put", frames.encode({**header, "session": eu.session}, b"z" * 1000))
    assert home.held_upload_bytes() == 1000
    time.sleep(0.3)
    home.expect("eu", "r/eu/3/0")
    eu.upload("r/eu/3/0", b"y")  # any later upload lets the stale one go
    assert home.held_upload_bytes() == 1  # only the whole one, not yet taken


@pytest.mark.parametrize(
    "method, fields, why",
    [
        ("Wait", {"after": 0, "wait_s": float("nan")}, "wait_s must be seconds from 0 to 30"),
        ("Wait", {"after": 1e999, "wait_s": 1}, "after must be a whole number"),
        ("Get", {"key": "w/0", "offset": "abc", "wait_s": 0}, "offset must be a whole number"),
        ("Wait", {"after": True, "wait_s": 1}, "after must be a whole number"),
        ("Put", {"key": "../x", "offset": 0, "total": 1, "digest": "0" * 64}, "key must be a key"),
        ("Get", {"key": "r/../x", "offset": 0, "wait_s": 0}, "key must be a key"),
        ("Beat", {"extra": 1}, "Beat carries no field 'extra'"),
    ],
    ids=["nan-wait", "inf-after", "text-offset", "bool-after", "bad-key", "key-up", "unknown-field"],
)
def test_every_header_field_is_typed_finite_and_in_range(home, method, fields, why):
    eu = region(home)
    eu.join()
    header = json.loads(json.dumps({"region": "eu", "session": eu.session, **fields}))
    started = time.monotonic()
    error = refusal(home, method, header)
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT and why in error.details()
    assert error.details().startswith("region 'eu' refused: malformed") and time.monotonic() - started < 5


def test_a_header_nested_deep_is_refused_in_one_line_and_no_exception_text_crosses(home):
    head = b'{"x":' + b"[" * 30000 + b"]" * 30000 + b"}"
    body = frames._PREAMBLE.pack(frames.MAGIC, frames.VERSION, len(head), 0, frames.hashlib.sha256(head).digest())
    with pytest.raises(grpc.RpcError) as error:
        raw(home, "Join", body + head)
    assert error.value.details() == "region 'eu' refused: malformed: its header is nested too deep"
    assert "Traceback" not in " ".join(home.lines) and region(home).join()  # still serving


def test_nan_waits_and_stalled_calls_leave_a_real_region_s_beat_on_time(home):
    eu = region(home)
    eu.join()
    stop = threading.Event()

    def stalled_request():  # a call that sends its headers and never its body
        stop.wait(30)
        yield b""

    channel = grpc.secure_channel(
        f"127.0.0.1:{home.port}",
        grpc.ssl_channel_credentials(root_certificates=home.ca),
        [("grpc.ssl_target_name_override", "localhost")],
    )
    calls = [
        channel.stream_unary(f"/{SERVICE}/Beat").future(stalled_request(), metadata=(("authorization", "Bearer x"),))
        for _ in range(40)
    ]
    nan = {"region": "eu", "session": eu.session, "after": 0, "wait_s": float("nan")}
    for _ in range(33):
        refusal(home, "Wait", nan)
    started = time.monotonic()
    assert eu.beat(timeout_s=5) and time.monotonic() - started < 1.0
    assert all(c.exception(timeout=10).code() is grpc.StatusCode.UNAUTHENTICATED for c in calls)
    stop.set()
    channel.close()


def test_a_flood_of_refusals_is_logged_once_per_interval(home):
    for _ in range(50):
        with pytest.raises(grpc.RpcError):
            raw(home, "Beat", frames.encode({}), token="")
    lines = [line for line in home.lines if "wrong or missing token" in line]
    assert len(lines) == 1, lines


HOME_SCRIPT = """
import ctypes, signal, sys
# SIGUSR1 asks the home to hand what the allocator keeps back to the system, then say so, so
# that the test reads what the home holds rather than what malloc has not yet returned. It is
# blocked before gRPC starts its threads (they inherit the mask) and taken by sigwait in the
# main thread: a handler over a sleep waits out the sleep when the kernel hands the signal to
# one of gRPC's threads, and a signal sent before the handler was set would kill the home.
signal.pthread_sigmask(signal.SIG_BLOCK, {{signal.SIGUSR1}})
sys.path.insert(0, {here!r})
from diloco_ray.channel.credentials import RegionTokens
from diloco_ray.channel.server import ChannelServer
server = ChannelServer(regions=["eu", "us"], tokens=RegionTokens({tokens!r}, ["eu", "us"]),
    cert=open({cert!r}, "rb").read(), key=open({key!r}, "rb").read(), host="127.0.0.1", log=lambda line: None)
print(server.start(), flush=True)
server.expect("eu", "r/eu/1/0")
while True:
    signal.sigwait({{signal.SIGUSR1}})
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    print("trimmed", flush=True)
"""


def held_mb(proc: subprocess.Popen) -> float:
    """The home's resident memory once the allocator has returned what it keeps."""
    proc.send_signal(signal.SIGUSR1)
    assert proc.stdout.readline().strip() == "trimmed"
    with open(f"/proc/{proc.pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def attack_the_home(channel, session: str) -> None:
    """24 unauthenticated 30 MB bodies at once, then 30 authenticated uploads that declare 1 GB."""
    body = b"z" * (30 << 20)
    futures = [
        channel.unary_unary(f"/{SERVICE}/Put").future(body, metadata=(("authorization", "Bearer x"),))
        for _ in range(24)
    ]
    for f in futures:
        assert f.exception(timeout=60) is not None
    header = {"key": "r/eu/1/0", "offset": 0, "digest": "0" * 64, "region": "eu", "session": session}
    for i in range(30):
        request = frames.encode({**header, "key": f"r/eu/1/{i % 2}", "total": 1 << 30}, b"z" * (1 << 20))
        with pytest.raises(grpc.RpcError):
            channel.unary_unary(f"/{SERVICE}/Put")(
                request, metadata=(("authorization", f"Bearer {TOKENS['eu'].secret}"),), timeout=10
            )


def test_unauthenticated_bodies_and_declared_gigabytes_leave_the_home_s_memory_alone(tmp_path):
    tls = make_tls(str(tmp_path))
    script = HOME_SCRIPT.format(
        here=os.path.dirname(__file__),
        tokens=write_tokens(tmp_path),
        cert=tls["home.pem"],
        key=tls["home.key"],
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        channel = grpc.secure_channel(
            f"127.0.0.1:{port}",
            grpc.ssl_channel_credentials(root_certificates=open(tls["ca.pem"], "rb").read()),
            [("grpc.ssl_target_name_override", "localhost"), ("grpc.max_send_message_length", 64 << 20)],
        )
        eu = region(type("Home", (), {"port": port, "ca": open(tls["ca.pem"], "rb").read()})())
        eu.join()
        before = held_mb(proc)
        grown = []
        for _ in range(3):
            attack_the_home(channel, eu.session)
            grown.append(held_mb(proc) - before)
        # Nothing of the bodies or of the declared uploads is kept once their calls are
        # refused, and a second and a third attack add nothing.
        assert max(grown) <= 32, f"the home holds {max(grown):.0f} MB more after the attacks: {grown}"
        channel.close()
    finally:
        proc.kill()


def test_a_secret_file_others_can_read_or_a_link_is_refused_with_the_fix(tmp_path):
    path = tmp_path / "token"
    path.write_text("eu-s3cret-token-0123\n")
    path.chmod(0o644)
    with pytest.raises(UserInputError, match=f"can be read by others .* chmod 600 {path}"):
        read_token(token_file=str(path))
    path.chmod(0o600)
    link = tmp_path / "link"
    link.symlink_to(path)
    with pytest.raises(UserInputError, match="is a symbolic link"):
        read_token(token_file=str(link))
    with pytest.raises(UserInputError, match="is a symbolic link"):
        RegionTokens(str(link), ["eu"])


def test_a_token_is_revoked_or_rotated_while_the_channel_runs(home, tmp_path):
    eu = region(home)
    eu.join()
    new = TOKENS["eu"].__class__("eu-rotated-token-9876", "$NEW")
    lines = f"eu {TOKENS['eu'].secret}\neu {new.secret}\nus {TOKENS['us'].secret}\n"
    path = home.tokens.path
    with open(path, "w") as f:  # both while the agent moves to the new one
        f.write(lines)
    assert eu.beat(timeout_s=5)
    with open(path, "w") as f:  # the old one revoked
        f.write(f"eu {new.secret}\nus {TOKENS['us'].secret}\n")
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 1))
    with pytest.raises(ChannelRefused, match="wrong or missing token"):
        eu.wait(after=0, wait_s=0.1)
    rotated = region(home, token=new)
    rotated.session = eu.session  # the same agent, its token replaced
    assert rotated.wait(after=0, wait_s=0.1) == (0, None)


@pytest.mark.parametrize(
    "case, why",
    [("other CA", "not signed by --ca-cert"), ("host", "not for the name dialled"), ("expired", "has expired")],
)
def test_a_certificate_the_region_refuses_is_one_line_and_the_agent_stops_soon(tmp_path, monkeypatch, case, why):
    from diloco_ray.channel.server import ChannelServer

    monkeypatch.setattr(client_module, "TLS_GIVE_UP_S", 1.0)
    os.makedirs(tmp_path / "home")
    tls = make_tls(str(tmp_path / "home"), expired=case == "expired")
    other = make_tls(str(tmp_path)) if case == "other CA" else tls
    server = ChannelServer(
        regions=["eu"],
        tokens=RegionTokens(write_tokens(tmp_path, {"eu": TOKENS["eu"]}), ["eu"]),
        cert=open(tls["home.pem"], "rb").read(),
        key=open(tls["home.key"], "rb").read(),
        host="127.0.0.1",
    )
    port = server.start()
    try:
        lines: list[str] = []
        eu = client_module.ChannelClient(
            f"127.0.0.1:{port}",
            "eu",
            TOKENS["eu"],
            open(other["ca.pem"], "rb").read(),
            server_name="elsewhere" if case == "host" else "localhost",
            backoff_s=(0.1, 0.2),
            log=lines.append,
        )
        started = time.monotonic()
        with pytest.raises(ChannelRefused, match=why):
            eu.join(give_up_after_s=900)
        assert time.monotonic() - started < 10
        assert len(lines) == 1 and why in lines[0] and "UNAVAILABLE" not in lines[0], lines
    finally:
        server.stop(0)
