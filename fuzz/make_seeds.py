#!/usr/bin/env python3
"""Writes the rewriter target's seed corpus (corpus/rewriter): HTTP/2 client streams after the
preface, as gRPC clients send them. The first byte of each seed chooses the read size."""
import os, struct

def frame(kind, flags, stream, payload):
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload

def string(s, huffman=False):
    assert len(s) < 127
    return bytes([len(s)]) + s

def literal(name, value, first=0x40):
    return bytes([first]) + string(name) + string(value)

def request(authority, path=b"/csi.v1.Identity/GetPluginInfo"):
    return (bytes([0x83, 0x86]) + literal(b":path", path) + literal(b":authority", authority)
            + literal(b"content-type", b"application/grpc") + literal(b"te", b"trailers"))

settings = frame(0x4, 0, 0, struct.pack(">HI", 3, 100) + struct.pack(">HI", 1, 4096))
data = frame(0x0, 0x1, 1, b"\0\0\0\0\0")
seeds = {
    "socket-path": settings + frame(0x1, 0x4, 1, request(b"/run/csi/csi.sock")) + data,
    "localhost": settings + frame(0x1, 0x5, 1, request(b"localhost")),
    "percent-encoded": settings + frame(0x1, 0x4, 1, request(b"%2Frun%2Fcsi.sock")) + data,
    "second-request-indexed": settings + frame(0x1, 0x4, 1, request(b"/tmp/a.sock")) + data
        + frame(0x1, 0x5, 3, bytes([0x83, 0x86, 0xc1, 0xc0, 0xbf, 0xbe])),
    "padding-priority": frame(0x1, 0x8 | 0x20 | 0x1 | 0x4, 5,
        bytes([3]) + bytes([0, 0, 0, 0, 16]) + request(b"/tmp/b.sock") + b"\0\0\0"),
    "continuation": frame(0x1, 0x1, 7, request(b"/tmp/c.sock")[:10])
        + frame(0x9, 0x4, 7, request(b"/tmp/c.sock")[10:]),
    "size-update": frame(0x1, 0x5, 1, bytes([0x3f, 0xe1, 0x1f]) + request(b"x")),
    "ping-window": settings + frame(0x6, 0, 0, b"12345678") + frame(0x8, 0, 0, struct.pack(">I", 1000))
        + frame(0x1, 0x5, 1, request(b"/s")),
    "never-indexed-and-plain": frame(0x1, 0x5, 1, bytes([0x83, 0x86]) + literal(b":authority", b"/x", 0x10)
        + literal(b"x-a", b"b", 0x00) + literal(b":path", b"/p")),
    "big-entry-refs": frame(0x1, 0x5, 1, bytes([0x83, 0x86, 0x84, 0x40, 6]) + b"x-bomb" + bytes([0x7f, 0xa1, 0x1e]) + b"a" * 4000)
        + frame(0x1, 0x5, 3, bytes([0x83, 0x86, 0x84]) + bytes([0xbe]) * 50),
    "rst-goaway": frame(0x1, 0x4, 1, request(b"/s")) + frame(0x3, 0, 1, struct.pack(">I", 8))
        + frame(0x7, 0, 0, struct.pack(">II", 1, 0)),
}
out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus", "rewriter")
os.makedirs(out, exist_ok=True)
for i, (name, body) in enumerate(sorted(seeds.items())):
    for split in (0, 3):
        with open(os.path.join(out, f"{name}-{split}"), "wb") as f:
            f.write(bytes([split]) + body)
