"""The channel's tests' home: a ChannelServer on this machine's loopback with two regions,
each with a token of its own (the ``home`` fixture is in conftest.py), and a region's
client for it."""

from __future__ import annotations

import os

from tls_files import make_tls

from diloco_ray.channel.client import ChannelClient
from diloco_ray.channel.credentials import RegionTokens, Token
from diloco_ray.channel.server import CHUNK_BYTES, ChannelServer

TOKENS = {"eu": Token("eu-s3cret-token-0123", "$TEST"), "us": Token("us-s3cret-token-4567", "$TEST")}


def write_tokens(folder, tokens=TOKENS) -> str:
    """The home's tokens file: one line per region's token, its owner's alone."""
    path = os.path.join(str(folder), "tokens")
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        f.write("".join(f"{name} {token.secret}\n" for name, token in tokens.items()))
    return path


def make_home(tmp_path):
    tls = make_tls(str(tmp_path))
    lines: list[str] = []
    server = ChannelServer(
        regions=["eu", "us"],
        tokens=RegionTokens(write_tokens(tmp_path), ["eu", "us"]),
        cert=open(tls["home.pem"], "rb").read(),
        key=open(tls["home.key"], "rb").read(),
        host="127.0.0.1",
        max_frame_bytes=4 * CHUNK_BYTES,
        join_info=lambda region: {"config": {"region": region, "seed": 7}},
        log=lines.append,
    )
    server.start()
    server.lines, server.ca = lines, open(tls["ca.pem"], "rb").read()
    return server


def region(home, name="eu", token=None, **kwargs) -> ChannelClient:
    lines: list[str] = []
    client = ChannelClient(
        f"127.0.0.1:{home.port}",
        name,
        token or TOKENS[name],
        home.ca,
        server_name="localhost",
        log=lines.append,
        **kwargs,
    )
    client.lines = lines
    return client
