"""The channel over a real TLS socket on this machine: a region joins, waits for notices,
downloads and uploads (resuming after a break without sending a chunk twice), and every bad
peer is refused in one line at both ends while the channel goes on serving the others."""

from __future__ import annotations

import os
import threading
import time

import grpc
import pytest
from channel_home import TOKENS, make_home, region, write_tokens
from tls_files import make_tls

from diloco_ray.channel import frames
from diloco_ray.channel.client import ChannelRefused
from diloco_ray.channel.credentials import Token, read_token
from diloco_ray.channel.server import CHUNK_BYTES, REGION_KEY, SERVICE, ChannelServer
from diloco_ray.errors import UserInputError


@pytest.fixture
def home(tmp_path):
    server = make_home(tmp_path)
    yield server
    server.stop(0)


def test_a_region_joins_gets_its_config_waits_for_a_notice_and_moves_messages_both_ways(home):
    eu = region(home)
    assert eu.join() == {"config": {"region": "eu", "seed": 7}} and home.connected() == {"eu"}
    assert eu.wait(after=0, wait_s=0.2) == (0, None)  # nothing yet: the long poll times out empty
    seq = home.notify("eu", {"job": "round 0"})
    assert eu.wait(after=0) == (seq, {"job": "round 0"})
    weights = os.urandom(2 * CHUNK_BYTES + 12345)  # three chunks
    home.publish("weights/0", weights)
    assert eu.download("weights/0") == weights
    grads = os.urandom(CHUNK_BYTES + 7)
    home.expect("eu", "eu/grads/0")
    eu.upload("eu/grads/0", grads)
    assert home.take("eu/grads/0", timeout_s=5) == grads
    assert home.take("eu/grads/0", timeout_s=0.1) is None  # taken once


def test_a_download_of_a_message_that_will_never_come_ends_when_the_home_says_so(home):
    """A region waiting for weights that died with a server hears so at once (the home
    voids the key), not when its wait runs out; publishing the key later serves it."""
    eu = region(home)
    eu.join()
    threading.Timer(0.3, home.void, args=("w/7/0",)).start()
    started = time.monotonic()
    with pytest.raises(ChannelRefused, match="no message 'w/7/0' is published"):
        eu.download("w/7/0", wait_s=20.0)
    assert time.monotonic() - started < 10.0 and home.is_void("w/7/0")
    home.publish("w/7/0", b"restored")
    assert not home.is_void("w/7/0")
    assert eu.download("w/7/0", wait_s=1.0) == b"restored"


def test_a_notice_sent_while_a_region_was_away_reaches_it_after_it_reconnects(home):
    eu = region(home)
    eu.join()
    home.notify("eu", {"job": 1})
    eu.session = "stale"  # as after the home restarted its sessions: the next call joins again
    seq, notice = eu.wait(after=0)
    assert notice == {"job": 1} and any("joining again" in line for line in eu.lines)


def test_an_upload_resumed_after_a_break_sends_no_chunk_twice(home, monkeypatch):
    eu = region(home, backoff_s=(0.01, 0.01))
    eu.join()
    payload = os.urandom(3 * CHUNK_BYTES)
    sent = []
    real = eu._call_once

    def flaky(method, header, **kw):
        reply = real(method, header, **kw)
        sent.append((header["offset"], len(kw.get("payload", b""))))
        if len(sent) == 2:  # the second chunk arrived, but its reply was lost on the way back
            raise FakeBreak()
        return reply

    monkeypatch.setattr(eu, "_call_once", flaky)
    home.expect("eu", "eu/grads/1")
    eu.upload("eu/grads/1", payload)
    assert home.take("eu/grads/1", timeout_s=5) == payload
    # chunk 0, chunk 1 (reply lost), a probe that learns the home has 2 chunks, chunk 2
    assert sent == [(0, CHUNK_BYTES), (CHUNK_BYTES, CHUNK_BYTES), (-1, 0), (2 * CHUNK_BYTES, CHUNK_BYTES)]


class FakeBreak(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "link down"


def test_a_wrong_token_is_refused_in_one_line_at_both_ends(home):
    intruder = region(home, token=Token("guess-guess-guess-guess", "$X"))
    with pytest.raises(ChannelRefused, match=r"^a caller claiming 'eu' refused: wrong or missing token$"):
        intruder.join()
    assert [line for line in home.lines if "refused" in line] == [
        next(line for line in home.lines if line.startswith("channel: a caller claiming 'eu' refused: wrong or"))
    ]
    secrets = [t.secret for t in TOKENS.values()] + ["guess"]
    assert all(secret not in line for secret in secrets for line in home.lines + intruder.lines)


def test_a_region_name_already_connected_is_refused_but_its_own_agent_may_reconnect(home):
    first = region(home)
    first.join()
    second = region(home)  # another agent process claiming the same region
    with pytest.raises(ChannelRefused, match=r"^region 'eu' refused: region 'eu' is already connected$"):
        second.join()
    first.session = None
    first.join()  # the same agent, after a broken link: it takes its session back
    assert home.connected() == {"eu"}


def test_a_region_claiming_another_name_than_its_token_s_is_refused(home):
    with pytest.raises(ChannelRefused, match="^region 'eu' refused: the call claims 'mars', its token says 'eu'$"):
        region(home, name="mars", token=TOKENS["eu"]).join()


@pytest.mark.parametrize(
    "request_bytes, why",
    [
        (b"garbage", "truncated"),
        (frames.encode({"instance": "x"})[:-2], "truncated"),
        (b"NOPE" + frames.encode({"instance": "x"})[4:], "malformed: not a diloco-ray channel frame"),
        (frames.encode({"instance": "x"}, b"z" * (4 * CHUNK_BYTES + 1)), "oversized"),
    ],
    ids=["garbage", "truncated", "malformed", "oversized"],
)
def test_a_malformed_truncated_or_oversized_message_is_refused_and_the_channel_goes_on(home, request_bytes, why):
    channel = grpc.secure_channel(
        f"127.0.0.1:{home.port}",
        grpc.ssl_channel_credentials(root_certificates=home.ca),
        [("grpc.ssl_target_name_override", "localhost"), ("grpc.max_send_message_length", 64 << 20)],
    )
    meta = (("authorization", f"Bearer {TOKENS['us'].secret}"), (REGION_KEY, "us"))
    with pytest.raises(grpc.RpcError) as refused:
        channel.unary_unary(f"/{SERVICE}/Join")(request_bytes, metadata=meta, timeout=10)
    assert refused.value.details().startswith(f"region 'us' refused: {why}")
    assert any(line.startswith(f"channel: region 'us' refused: {why}") for line in home.lines)
    channel.close()
    eu = region(home)  # everyone else is still served
    assert eu.join()["config"]["region"] == "eu"


def test_many_regions_at_once(home):
    results = {}

    def run(name):
        client = region(home, name=name)
        client.join()
        payload = name.encode() * 1000
        home.expect(name, f"{name}/g")
        client.upload(f"{name}/g", payload)
        results[name] = home.take(f"{name}/g", timeout_s=5) == payload

    threads = [threading.Thread(target=run, args=(n,)) for n in ("eu", "us")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {"eu": True, "us": True} and home.connected() == {"eu", "us"}


def test_the_token_comes_from_a_file_or_a_variable_and_never_shows(tmp_path, monkeypatch):
    path = tmp_path / "token"
    path.write_text("abc123abc123abc123\n")
    path.chmod(0o600)
    token = read_token(token_file=str(path))
    assert token.secret == "abc123abc123abc123" and "abc123" not in repr(token) and token.matches("abc123abc123abc123")
    monkeypatch.setenv("MY_TOKEN", "xyz" * 6)
    assert read_token(token_env="MY_TOKEN").secret == "xyz" * 6
    monkeypatch.delenv("DILOCO_CHANNEL_TOKEN", raising=False)
    with pytest.raises(UserInputError, match="set the environment variable DILOCO_CHANNEL_TOKEN"):
        read_token()
    (tmp_path / "empty").write_text("")
    (tmp_path / "empty").chmod(0o600)
    with pytest.raises(UserInputError, match="is empty"):
        read_token(token_file=str(tmp_path / "empty"))
    monkeypatch.setenv("MY_TOKEN", "short")
    with pytest.raises(UserInputError, match="at least 16 characters"):
        read_token(token_env="MY_TOKEN")


def test_the_home_checks_its_channel_files_and_token_before_ray_starts(tmp_path, monkeypatch):
    from conftest import tiny_config

    from diloco_ray.driver import preflight

    tls = make_tls(str(tmp_path))
    fields = dict(
        regions=[{"name": "eu", "replicas": 2}],
        channel_tls_cert=tls["home.pem"],
        channel_tls_key="nope.key",
        channel_tokens_file=write_tokens(tmp_path, {"eu": TOKENS["eu"]}),
    )
    with pytest.raises(UserInputError, match="^channel_tls_key nope.key: No such file or directory$"):
        preflight.check_channel(tiny_config(tmp_path / "run", **fields).sections().channel)
    fields["channel_tls_key"] = tls["home.key"]
    preflight.check_channel(tiny_config(tmp_path / "run", **fields).sections().channel)
    fields["channel_tokens_file"] = write_tokens(tmp_path, TOKENS)  # us is not one of this run's regions
    with pytest.raises(UserInputError, match=r"line 2: 'us' is not one of regions \(eu\)"):
        preflight.check_channel(tiny_config(tmp_path / "run", **fields).sections().channel)


def test_a_region_is_ready_once_it_says_so_and_counts_its_bytes_both_ways(home):
    eu = region(home)
    eu.join()
    assert home.connected() == {"eu"} and home.connected(ready=True) == set()  # its replicas are starting
    eu.ready = True
    assert eu.beat(timeout_s=5)
    assert home.connected(ready=True) == {"eu"}
    home.publish("w/0", b"x" * 1000)
    before = home.traffic("eu")
    eu.download("w/0")
    home.expect("eu", "r/0")
    eu.upload("r/0", b"y" * 500)
    up, down = (now - then for now, then in zip(home.traffic("eu"), before))
    assert 500 < up < 1000 and 1000 < down < 1500  # the frames: payload and a small header each
    assert home.traffic("us") == (0, 0)


def test_a_new_agent_for_a_region_does_not_get_the_old_one_s_notices(home):
    old = region(home)
    old.join()
    home.notify("eu", {"job": "for the old agent"})
    home.session_timeout_s = 0.0  # the old agent went silent
    new = region(home)
    new.join()
    _, notice = new.wait(after=0, wait_s=0.2)
    assert notice is None


def test_an_upload_the_home_gave_up_on_is_dropped_when_it_arrives(home):
    eu = region(home)
    eu.join()
    home.expect("eu", "r/late")
    home.discard("r/late")
    eu.upload("r/late", b"z" * 10)
    assert home.take("r/late", timeout_s=0.2) is None


def test_a_home_restarted_on_its_port_is_rejoined_and_its_notices_are_taken(home):
    eu = region(home, backoff_s=(0.05, 0.2))
    eu.join()
    seq = home.notify("eu", {"job": "before"})
    assert eu.wait(after=0) == (seq, {"job": "before"})
    home.stop(0)
    again = ChannelServer(
        regions=["eu"], tokens=home.tokens, cert=home._cert, key=home._key, host="127.0.0.1", port=home.port, log=print
    )
    again.start()
    try:
        later = again.notify("eu", {"job": "after"})
        assert eu.wait(after=seq) == (later, {"job": "after"})  # rejoined, and numbered past what it had
        assert any("joining again" in line for line in eu.lines)
    finally:
        again.stop(0)


def test_a_home_that_stays_down_is_retried_at_the_longest_pause_with_one_line(home):
    from diloco_ray.channel.client import ChannelDown

    eu = region(home, backoff_s=(0.05, 0.1))
    eu.join()
    home.stop(0)  # the link goes and stays down
    with pytest.raises(ChannelDown, match="unreachable"):
        eu.download("w/1/0", give_up_after_s=1.5)
    growing = [line for line in eu.lines if "retrying in" in line]
    at_longest = [line for line in eu.lines if "retrying every 0.1s" in line]
    # Several tries at the longest pause (0.1 s for 1.5 s), but the log says so once.
    assert len(growing) == 1 and len(at_longest) == 1, eu.lines
