#!/usr/bin/python3
"""An independent client of the orca-relay wire protocol.

Written from docs/PROTOCOL.md alone, on a WebSocket library nobody in this project wrote
(Python's `websockets`, Debian's python3-websockets): placement, the control socket and its
hello, invites, a phone and its data leg, text, binary and fragmented messages, pings, every
documented close code and HTTP refusal, limits, keepalive, and a drain. It reads nothing of the
relay's sources: what it knows is the document (whose tables it also checks against what it
pins below, so that a changed code, status or limit fails here until both agree).

Run by tests/independent_client.rs with one argument, a JSON object: `doc` (the path of
docs/PROTOCOL.md), `key` (the self-hosted HS256 key of the relays), `relays` (by name: `ws` and
`http` addresses, `pid`, and the `env` each was started with). Prints one line per scenario
and, at the end, what the library reported for each close path; exits 1 on any failure.
"""

import asyncio
import base64
import contextvars
import hashlib
import hmac
import json
import os
import re
import secrets
import signal
import sys
import time
import traceback

try:
    import websockets
    from websockets.client import ClientConnection
    from websockets.exceptions import ConnectionClosed, InvalidStatusCode
    from websockets.frames import Opcode
    from websockets.http11 import Response
    from websockets.uri import parse_uri
except ImportError as error:  # never skipped: the suite installs it
    print(
        f"independent_client: Python's websockets is missing ({error}); "
        "install Debian's python3-websockets (scripts/test does)",
        file=sys.stderr,
    )
    sys.exit(2)

# What docs/PROTOCOL.md states, pinned. A change on either side fails the run.
KIB = 1024
MIB = 1024 * 1024
CONTROL_LIMIT = 1 * MIB
LEG_LIMIT = 8 * MIB
FIRST_FRAME_LIMIT = 4 * KIB
FIRST_FRAME_S = 2.0
UPGRADE_S = 5.0
PING_S = 15.0
WEDGE_S = 10.0
ATTACH_MS = 10_000
INVITE_TTL_MS = 10 * 60 * 1000
INVITE_ATTEMPTS = 5
INVITES_OUTSTANDING = 8
INVITE_BURST = 8
PHONES_PER_HOST = 8
RETRY_AFTER = "2"
# A close is reported within this of its cause (its deadline, the refused frame): the relay
# ends the connection as soon as the library has answered its close. (It used to keep it 1 s
# longer whatever the client did: a 2 s deadline was reported at 3 s.)
PROMPT = 0.9
CLOSE_CODES = {
    1000: "normal",
    1002: "protocol error",
    1009: "message too big",
    4401: "BAD_OUTER_CREDENTIAL",
    4404: "HOST_OFFLINE",
    4408: "PEER_DROPPED",
    4409: "WRONG_CELL",
    4429: "LIMIT_EXCEEDED",
    4503: "DRAINING",
}
# Codes the document names that this client cannot provoke from outside: 1012 needs the cell
# to crash in the middle of a read or write of this very connection (tests/crash_store.rs).
DOCUMENTED_ONLY = {1012: "service restart"}
UPGRADE_STATUSES = {400, 401, 404, 408, 414, 431, 426, 503}
ASSIGN_STATUSES = {200, 400, 401, 403, 413, 503}
# The timings table: (row start, value).
TIMINGS = [
    ("upgrade request complete", "5 s"),
    ("first frame after the upgrade", "2 s"),
    ("first frame size", "4 KiB"),
    ("ping interval", "15 s"),
    ("silence before a control is closed 4408", "75 s"),
    ("data leg attach after `conn-open`", "10 s"),
    ("invite lifetime / attempts", "10 min / 5"),
    ("invites outstanding per desktop / `invite-create` rate", "8 / 8 at once, then 1 a second"),
    ("phones per desktop", "8"),
    ("wedge: receiver not draining", "10 s"),
    ("close frame → TCP dropped when the client does not answer", "1 s at most"),
]
# Close reasons the document names.
REASONS = {
    "silent control": "silent: nothing heard (answer pings)",
    "replaced": "replaced by a newer control",
    "peer left": "peer left",
    "host left": "host left",
    "leg silent": "silent",
    "wedged": "wedged",
    "first frame too large": "first_frame_too_large",
    "frame too large": "frame_too_large",
    "message too large": "message_too_large",
}

FAILURES = []  # (scenario, what)
SCENARIO = contextvars.ContextVar("scenario", default="document")
SEEN_CODES = set()
SEEN_UPGRADE_STATUSES = set()
SEEN_ASSIGN_STATUSES = set()
REPORTED = {}  # close path -> what the library reported


def fail(what):
    FAILURES.append((SCENARIO.get(), what))


def check(condition, what):
    if not condition:
        fail(what)
    return condition


def eq(got, want, what):
    return check(got == want, f"{what}: got {got!r}, want {want!r}")


MEASURED = []  # (what, value, low, high)


def between(value, low, high, what):
    MEASURED.append((what, value, low, high))
    return check(low <= value <= high, f"{what}: {value:.3f} not in [{low:.3f}, {high:.3f}]")


# ------------------------------------------------------------------------------------------
# Tokens (the document's claims table), hosts, HTTP.


def b64url(raw):
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def token(key, user, host, **overrides):
    claims = {
        "sub": user,
        "relayHostId": host,
        "purpose": "host-control",
        "aud": "orca-relay",
        "exp": int(time.time()) + 600,
    }
    claims.update(overrides)
    claims = {k: v for k, v in claims.items() if v is not None}
    alg = claims.pop("_alg", "HS256")
    header = b64url(json.dumps({"alg": alg, "typ": "JWT"}).encode())
    body = b64url(json.dumps(claims).encode())
    signing = f"{header}.{body}".encode()
    if alg == "none":
        return f"{header}.{body}."
    signature = hmac.new(key.encode(), signing, hashlib.sha256).digest()
    return f"{header}.{body}.{b64url(signature)}"


def new_host():
    # 16 characters from [A-Za-z0-9_-].
    return "py" + secrets.token_hex(7)


async def http(address, raw, timeout=10.0):
    """Sends raw request bytes; returns (status, headers, body) of the answer, or None when the
    connection ends without one."""
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(raw)
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()
    return parse_response(data)


def parse_response(data):
    if b"\r\n\r\n" not in data:
        return None
    head, body = data.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = {}
    for line in lines[1:]:
        name, value = line.split(":", 1)
        headers[name.strip().lower()] = value.strip()
    return status, headers, body


async def post(address, path, body, bearer=None):
    auth = f"Authorization: Bearer {bearer}\r\n" if bearer else ""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = (
        f"POST {path} HTTP/1.1\r\nHost: {address}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(raw)}\r\n{auth}Connection: close\r\n\r\n"
    ).encode() + raw
    return await http(address, request)


async def assign(relay, tok, host, what, reconnect=None):
    body = {"v": 1, "relayHostId": host}
    if reconnect is not None:
        body["reconnect"] = reconnect
    status, headers, answer = await post(relay["http"], "/v1/assign", body, tok)
    SEEN_ASSIGN_STATUSES.add(status)
    if not eq(status, 200, f"{what}: POST /v1/assign ({answer!r})"):
        raise RuntimeError(f"{what}: not placed")
    placed = json.loads(answer)
    eq(placed.get("v"), 1, f"{what}: assign v")
    check(isinstance(placed.get("assignmentEpoch"), int), f"{what}: assignmentEpoch {placed}")
    check(str(placed.get("cellUrl", "")).startswith("ws"), f"{what}: cellUrl {placed}")
    return placed["cellUrl"].rstrip("/"), placed["assignmentEpoch"]


# ------------------------------------------------------------------------------------------
# The library's high-level client, and its sans-I/O layer for what must be seen frame by frame.


async def connect(url, headers=None, **kwargs):
    kwargs.setdefault("max_size", None)
    kwargs.setdefault("ping_interval", None)
    kwargs.setdefault("close_timeout", 10)
    return await websockets.connect(url, extra_headers=headers or {}, **kwargs)


async def refused(url, headers=None):
    """The HTTP status (and headers) a refused upgrade reports through the library."""
    try:
        ws = await connect(url, headers)
    except InvalidStatusCode as error:
        SEEN_UPGRADE_STATUSES.add(error.status_code)
        return error.status_code, error.headers
    await ws.close()
    return 101, {}


async def closed(ws, path=None, timeout=30.0):
    """Reads (and drops) messages until the connection ends; returns what the library reports:
    (code received, reason received, code sent, when)."""
    try:
        while True:
            await asyncio.wait_for(ws.recv(), timeout)
    except asyncio.TimeoutError:
        fail(f"{path}: not closed within {timeout} s")
        return None, None, None, time.monotonic()
    except ConnectionClosed as error:
        at = time.monotonic()
        rcvd = (error.rcvd.code, error.rcvd.reason) if error.rcvd else (None, None)
        sent = error.sent.code if error.sent else None
        if rcvd[0] in CLOSE_CODES:
            SEEN_CODES.add(rcvd[0])
        if path:
            REPORTED.setdefault(
                path,
                f"{type(error).__name__}: received {rcvd[0]} {rcvd[1]!r}, sent {sent}, "
                f"close_code {ws.close_code}",
            )
        return rcvd[0], rcvd[1], sent, at


async def expect_close(ws, code, path, reason=None, timeout=30.0):
    got_code, got_reason, sent, at = await closed(ws, path, timeout)
    eq(got_code, code, f"{path}: close code")
    if reason is not None:
        eq(got_reason, reason, f"{path}: close reason")
    return at


class Frames:
    """One connection driven through the library's sans-I/O layer: every frame as it came. It
    is read in the background from the start (as any client reads), so a sender on the other
    side is never held up by this one's test code."""

    @classmethod
    async def open(cls, url, headers=None):
        self = cls()
        uri = parse_uri(url)
        self.conn = ClientConnection(uri, max_size=None)
        self.reader, self.writer = await asyncio.open_connection(uri.host, uri.port)
        request = self.conn.connect()
        for name, value in (headers or {}).items():
            request.headers[name] = value
        self.conn.send_request(request)
        self.response, self.eof = None, False
        self.answered = asyncio.Event()
        self.ended = asyncio.Event()
        self.queue = asyncio.Queue()
        self.flush()
        self.task = asyncio.create_task(self.run())
        await asyncio.wait_for(self.answered.wait(), 10)
        return self

    def flush(self):
        for data in self.conn.data_to_send():
            if data:
                self.writer.write(data)
            elif self.writer.can_write_eof():
                self.writer.write_eof()

    async def run(self):
        try:
            while not self.eof:
                data = await self.reader.read(1 << 20)
                if data:
                    self.conn.receive_data(data)
                else:
                    self.eof = True
                    self.conn.receive_eof()
                for event in self.conn.events_received():
                    if isinstance(event, Response):
                        self.response = event
                        self.answered.set()
                    else:
                        self.queue.put_nowait(event)
                self.flush()
        except (ConnectionError, OSError):
            self.eof = True
        finally:
            self.answered.set()
            self.ended.set()
            self.queue.put_nowait(None)

    async def frame(self, timeout=20.0):
        """The next frame; `None` once the connection has ended."""
        frame = await asyncio.wait_for(self.queue.get(), timeout)
        if frame is None:
            self.queue.put_nowait(None)
        return frame

    async def data_frames(self, count, timeout=20.0):
        """The next `count` frames, all data frames (a ping or pong here fails the check)."""
        got = []
        while len(got) < count:
            frame = await self.frame(timeout)
            if frame is None:
                fail(f"frame-level client: the connection ended after {len(got)} frames")
                break
            check(
                frame.opcode in (Opcode.TEXT, Opcode.BINARY, Opcode.CONT),
                f"frame-level client: a {frame.opcode.name} frame was forwarded",
            )
            got.append(frame)
        return got

    async def send(self, method, *args):
        getattr(self.conn, method)(*args)
        self.flush()
        await self.writer.drain()

    def close(self):
        self.writer.close()


# ------------------------------------------------------------------------------------------
# A desktop (its control socket read in the background) and phones.


class Desktop:
    @classmethod
    async def start(cls, ctx, relay, what, ping_interval=None, answer_pings=True):
        self = cls()
        self.ctx, self.relay, self.what = ctx, relay, what
        self.host = new_host()
        self.user = f"user-{self.host}"
        self.token = token(ctx["key"], self.user, self.host)
        self.cell, self.epoch = await assign(relay, self.token, self.host, what)
        self.ws = await connect(
            self.cell + "/v1/host/control",
            {"Authorization": f"Bearer {self.token}"},
            ping_interval=ping_interval,
        )
        await self.ws.send(
            json.dumps(
                {
                    "type": "host-hello",
                    "v": 1,
                    "relayHostId": self.host,
                    "assignmentEpoch": self.epoch,
                }
            )
        )
        ack = json.loads(await asyncio.wait_for(self.ws.recv(), 10))
        eq(ack.get("type"), "host-hello-ack", f"{what}: hello answer {ack}")
        eq(ack.get("v"), 1, f"{what}: ack v")
        self.generation = ack["generation"]
        check(isinstance(self.generation, int) and self.generation >= 1, f"{what}: generation")
        self.answer_pings = answer_pings
        self.pings = []
        self.inbox = asyncio.Queue()
        self.ended = asyncio.get_running_loop().create_future()
        self.task = asyncio.create_task(self.read())
        return self

    async def read(self):
        try:
            async for message in self.ws:
                if isinstance(message, str):
                    value = json.loads(message)
                    if value.get("type") == "ping":
                        self.pings.append((time.monotonic(), value))
                        if self.answer_pings:
                            await self.ws.send(json.dumps({"type": "pong", "t": value["t"]}))
                        continue
                    await self.inbox.put(value)
                else:
                    await self.inbox.put(message)
        except ConnectionClosed:
            pass
        finally:
            if not self.ended.done():
                self.ended.set_result(time.monotonic())

    async def next(self, kind, timeout=20.0):
        value = await asyncio.wait_for(self.inbox.get(), timeout)
        if not eq(value.get("type"), kind, f"{self.what}: control message"):
            raise RuntimeError(f"{self.what}: expected {kind}, got {value}")
        return value

    async def send(self, value):
        await self.ws.send(json.dumps(value))

    async def invite(self, req_id="r"):
        await self.send({"type": "invite-create", "reqId": req_id})
        created = await self.next("invite-created")
        eq(created["reqId"], req_id, f"{self.what}: reqId echoed")
        return created["inviteToken"]

    async def close_report(self, path, timeout=30.0):
        """Waits for the control's end; returns what the library reported."""
        await asyncio.wait_for(asyncio.shield(self.ended), timeout)
        rcvd, sent = self.ws.close_rcvd, self.ws.close_sent
        code = rcvd.code if rcvd else None
        if code in CLOSE_CODES:
            SEEN_CODES.add(code)
        REPORTED.setdefault(
            path,
            f"received {code} {rcvd.reason if rcvd else None!r}, sent "
            f"{sent.code if sent else None}, close_code {self.ws.close_code}",
        )
        return code, (rcvd.reason if rcvd else None), self.ended.result()


async def phone(desktop, invite, frames=False):
    """A phone with `invite`; returns it once relay-auth is sent (not yet attached)."""
    url = f"{desktop.cell}/v1/connect/{desktop.host}"
    auth = json.dumps({"type": "relay-auth", "v": 1, "credential": invite})
    if frames:
        ws = await Frames.open(url)
        await ws.send("send_text", auth.encode())
    else:
        ws = await connect(url)
        await ws.send(auth)
    return ws


async def data_leg(desktop, open_, frames=False, generation=None):
    url = f"{desktop.cell}/v1/host/data/{open_['connId']}"
    auth = json.dumps(
        {
            "type": "host-data-auth",
            "v": 1,
            "connTicket": open_["connTicket"],
            "generation": desktop.generation if generation is None else generation,
        }
    )
    if frames:
        ws = await Frames.open(url)
        await ws.send("send_text", auth.encode())
    else:
        ws = await connect(url)
        await ws.send(auth)
    return ws


async def splice(desktop, phone_frames=False, leg_frames=False, invite=None):
    invite = invite or await desktop.invite()
    p = await phone(desktop, invite, phone_frames)
    open_ = await desktop.next("conn-open")
    eq(open_["attachDeadlineMs"], ATTACH_MS, "conn-open attachDeadlineMs")
    leg = await data_leg(desktop, open_, leg_frames)
    if phone_frames:
        hello = await p.frame()
        eq(json.loads(hello.data), {"type": "relay-hello", "ok": True}, "relay-hello")
    else:
        eq(json.loads(await asyncio.wait_for(p.recv(), 20)), {"type": "relay-hello", "ok": True}, "relay-hello")
    return p, leg


def masked_header(opcode, length, fin=True, rsv1=False):
    first = (0x80 if fin else 0) | (0x40 if rsv1 else 0) | opcode
    if length < 126:
        head = bytes([first, 0x80 | length])
    elif length < 1 << 16:
        head = bytes([first, 0x80 | 126]) + length.to_bytes(2, "big")
    else:
        head = bytes([first, 0x80 | 127]) + length.to_bytes(8, "big")
    return head + b"\x00\x00\x00\x00"


def raw_write(ws, data):
    """Bytes the library would never send, written under it (the relay must refuse them)."""
    ws.transport.write(data)


# ------------------------------------------------------------------------------------------
# Scenarios on the relay with the documented timings.


async def placement_and_tokens(ctx, relay):
    key, http_addr = ctx["key"], relay["http"]
    host = new_host()
    good = token(key, "u-tokens", host)
    cell, epoch = await assign(relay, good, host, "placement")
    # The self-hosted key and no issuer configured: `iss` is not checked, present or not.
    await assign(relay, token(key, "u-tokens", host, iss="https://anyone.example"), host, "iss present")
    for what, tok, reason in [
        ("no token", None, "token_missing"),
        ("another key", token("not-the-relays-key-0123456789abcdef", "u", host), "token_bad_signature"),
        ("expired", token(key, "u", host, exp=int(time.time()) - 120), "token_expired"),
        ("wrong audience", token(key, "u", host, aud="someone-else"), "token_wrong_audience"),
        ("wrong purpose", token(key, "u", host, purpose="phone"), "token_wrong_purpose"),
        ("alg none", token(key, "u", host, _alg="none"), None),
        ("not a token", "x.y.z", None),
    ]:
        status, _, body = await post(http_addr, "/v1/assign", {"v": 1, "relayHostId": host}, tok)
        SEEN_ASSIGN_STATUSES.add(status)
        eq(status, 401, f"assign {what}")
        answer = json.loads(body)
        eq(answer.get("error"), "unauthorized", f"assign {what} body")
        if reason:
            eq(answer.get("reason"), reason, f"assign {what} reason")
        # The cell's control upgrade refuses the same token with the same body.
        auth = f"Authorization: Bearer {tok}\r\n" if tok else ""
        answer_cell = await http(relay["ws"], upgrade_request("/v1/host/control", auth))
        SEEN_UPGRADE_STATUSES.add(answer_cell[0])
        eq(answer_cell[0], 401, f"control upgrade {what}")
        eq(json.loads(answer_cell[2]), answer, f"control upgrade {what}: body as the director's")
    for what, body, status, error in [
        ("v 2", {"v": 2, "relayHostId": host}, 400, "bad_request"),
        ("malformed", b"{not json", 400, "bad_request"),
        ("another host", {"v": 1, "relayHostId": new_host()}, 403, "relay_host_id_mismatch"),
        ("over 4 KiB", {"v": 1, "relayHostId": host, "pad": "x" * (4 * KIB)}, 413, None),
    ]:
        got, _, answer = await post(http_addr, "/v1/assign", body, good)
        SEEN_ASSIGN_STATUSES.add(got)
        eq(got, status, f"assign {what}")
        if error:
            eq(json.loads(answer).get("error"), error, f"assign {what} body")
    # Exactly 4 KiB is accepted.
    body = {"v": 1, "relayHostId": host, "pad": ""}
    body["pad"] = "x" * (4 * KIB - len(json.dumps(body).encode()))
    eq(len(json.dumps(body).encode()), 4 * KIB, "a 4 KiB body")
    got, _, answer = await post(http_addr, "/v1/assign", body, good)
    eq(got, 200, f"assign with a body of exactly 4 KiB ({answer!r})")


def upgrade_request(path, extra="", key="dGhlIHNhbXBsZSBub25jZQ==", version="13", method="GET",
                    proto="HTTP/1.1", host="Host: relay\r\n"):
    return (
        f"{method} {path} {proto}\r\n{host}Upgrade: websocket\r\nConnection: Upgrade\r\n"
        f"Sec-WebSocket-Version: {version}\r\nSec-WebSocket-Key: {key}\r\n{extra}\r\n"
    ).encode()


async def http_refusals(ctx, relay):
    ws_addr = relay["ws"]
    phone_path = f"/v1/connect/{new_host()}"
    cases = [
        ("malformed head", b"GET\r\n\r\n", 400),
        ("not GET", upgrade_request(phone_path, method="POST"), 400),
        ("HTTP/1.0", upgrade_request(phone_path, proto="HTTP/1.0"), 400),
        ("no Host", upgrade_request(phone_path, host=""), 400),
        ("two Hosts", upgrade_request(phone_path, host="Host: a\r\nHost: b\r\n"), 400),
        ("bad key", upgrade_request(phone_path, key="short"), 400),
        ("no key", upgrade_request(phone_path).replace(b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n", b""), 400),
        ("unknown path", upgrade_request("/v1/nowhere"), 404),
        ("version 12", upgrade_request(phone_path, version="12"), 426),
        ("plain GET", f"GET {phone_path} HTTP/1.1\r\nHost: relay\r\n\r\n".encode(), 426),
        ("request line over 8 KiB", f"GET /{'a' * (8 * KIB)} HTTP/1.1\r\n".encode(), 414),
        ("head over 8 KiB", upgrade_request(phone_path, "X-Pad: " + "a" * (8 * KIB) + "\r\n"), 431),
        ("control without token", upgrade_request("/v1/host/control"), 401),
        ("bearer in another case", upgrade_request("/v1/host/control", "Authorization: bEaReR x.y.z\r\n"), 401),
    ]
    for what, raw, status in cases:
        answer = await http(ws_addr, raw)
        if not check(answer is not None, f"{what}: no answer before the connection closed"):
            continue
        got, headers, body = answer
        SEEN_UPGRADE_STATUSES.add(got)
        eq(got, status, f"upgrade refusal {what}")
        check(json.loads(body).get("error"), f"{what}: a JSON error body ({body!r})")
        check("retry-after" not in headers, f"{what}: no Retry-After")
        if status == 426:
            eq(headers.get("sec-websocket-version"), "13", f"{what}: Sec-WebSocket-Version")
    # The library reports the same refusals as it should.
    status, headers = await refused(relay_url(relay, "/v1/nowhere"))
    eq(status, 404, "library: unknown path")
    status, _ = await refused(relay_url(relay, "/v1/host/control"))
    eq(status, 401, "library: control without token")
    REPORTED.setdefault("refused upgrade", "InvalidStatusCode with status_code and headers (no body)")
    # A head started and not finished within 5 s: 408, at 5 s.
    host, port = ws_addr.rsplit(":", 1)
    started = time.monotonic()
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"GET /v1/connect/x HTTP/1.1\r\nHost: relay\r\n")
    data = await asyncio.wait_for(reader.read(), UPGRADE_S + 5)
    took = time.monotonic() - started
    writer.close()
    answer = parse_response(data)
    if check(answer is not None, "408: no answer"):
        SEEN_UPGRADE_STATUSES.add(answer[0])
        eq(answer[0], 408, "a head not finished in 5 s")
        between(took, UPGRADE_S, UPGRADE_S + 1.0, "408 after")


def relay_url(relay, path):
    return f"ws://{relay['ws']}{path}"


async def control_refusals(ctx, relay):
    key = ctx["key"]
    host = new_host()
    tok = token(key, f"user-{host}", host)
    cell, epoch = await assign(relay, tok, host, "control refusals")
    auth = {"Authorization": f"Bearer {tok}"}
    url = cell + "/v1/host/control"
    hello = {"type": "host-hello", "v": 1, "relayHostId": host, "assignmentEpoch": epoch}
    for what, first, code in [
        ("hello for another host", dict(hello, relayHostId=new_host()), 4401),
        ("hello v 2", dict(hello, v=2), 4401),
        ("hello at a wrong epoch", dict(hello, assignmentEpoch=epoch + 1), 4409),
        ("malformed first frame", "{not json", 4401),
        ("unknown first type", {"type": "invite-create", "reqId": 1}, 4401),
        ("binary first frame", b"\x00\x01", 4401),
    ]:
        ws = await connect(url, auth)
        await ws.send(json.dumps(first) if isinstance(first, dict) else first)
        started = time.monotonic()
        at = await expect_close(ws, code, f"control: {what}")
        check(at - started < PROMPT, f"control: {what} reported {at - started:.3f} s after")
    # No hello within 2 s (counted from the upgrade, which comes after `started`).
    started = time.monotonic()
    ws = await connect(url, auth)
    at = await expect_close(ws, 4401, "control: no hello within 2 s")
    between(at - started, FIRST_FRAME_S, FIRST_FRAME_S + PROMPT, "control: hello deadline closed at")
    # The control's first frame over 1 MiB.
    ws = await connect(url, auth)
    await send_until_refused(ws, b"\x00" * (CONTROL_LIMIT + 1))
    await expect_close(ws, 1009, "control: first frame over 1 MiB", REASONS["message too large"])


async def control_steady_state(ctx, relay):
    desktop = await Desktop.start(ctx, relay, "steady control")
    # Unknown types, malformed JSON and binary messages are ignored once authenticated.
    await desktop.send({"type": "no-such-type"})
    await desktop.ws.send("{not json")
    await desktop.ws.send(b"\x00" * CONTROL_LIMIT)  # exactly the limit: ignored, not closed
    # reqId is any JSON value, echoed.
    req = {"any": ["json", 1, None]}
    await desktop.send({"type": "invite-create", "reqId": req})
    created = await desktop.next("invite-created")
    eq(created["reqId"], req, "reqId echoed")
    invite = created["inviteToken"]
    check(re.fullmatch(r"[A-Za-z0-9_-]{43}", invite) is not None, f"invite token {invite!r}")
    between(created["expiresAt"] - time.time() * 1000, INVITE_TTL_MS - 5000, INVITE_TTL_MS + 5000, "invite expiresAt - now (ms)")
    eq(created["maxAttempts"], INVITE_ATTEMPTS, "maxAttempts")
    # A WebSocket ping on the control is answered by the relay.
    pong = await desktop.ws.ping(b"control")
    await asyncio.wait_for(pong, 5)
    # The relay's JSON pings every 15 s, answered with pong echoing t.
    deadline = time.monotonic() + 2 * PING_S + 5
    while len(desktop.pings) < 2 and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    if check(len(desktop.pings) >= 2, f"two JSON pings within {2 * PING_S + 5} s"):
        (t1, p1), (t2, p2) = desktop.pings[:2]
        between(t2 - t1, PING_S - 0.5, PING_S + 1.0, "ping interval (s)")
        check(isinstance(p1.get("t"), int), f"ping t {p1}")
    # Still served: an invite.
    await desktop.invite("after pings")
    # A control frame over 1 MiB: 1009.
    await send_until_refused(desktop.ws, b"\x00" * (CONTROL_LIMIT + 1))
    code, reason, _ = await desktop.close_report("control: frame over 1 MiB")
    eq((code, reason), (1009, REASONS["message too large"]), "control frame over 1 MiB")


async def invites(ctx, relay):
    desktop = await Desktop.start(ctx, relay, "invites")
    # A burst of 8, then one a second.
    tokens = []
    for n in range(INVITE_BURST):
        await desktop.send({"type": "invite-create", "reqId": n})
    for n in range(INVITE_BURST):
        created = await desktop.next("invite-created")
        eq(created["reqId"], n, "burst reqId")
        tokens.append(created["inviteToken"])
    await desktop.send({"type": "invite-create", "reqId": "ninth"})
    refused_ = await desktop.next("invite-refused")
    eq((refused_["reqId"], refused_["reason"]), ("ninth", "rate_limited"), "the ninth at once")
    wait = refused_["retryAfterMs"]
    between(wait, 1, 1000, "retryAfterMs")
    await asyncio.sleep(wait / 1000 + 0.05)
    ninth = await desktop.invite("ninth again")
    # At most 8 outstanding: the ninth replaced the oldest, which admits no phone now.
    old = await phone(desktop, tokens[0])
    await expect_close(old, 4401, "phone: a replaced invite")
    # An invite admits at most 5 connection attempts (the desktop never attaches these).
    phones = []
    opened = None
    for n in range(INVITE_ATTEMPTS):
        phones.append(await phone(desktop, ninth))
        await desktop.next("conn-open")
        opened = opened or time.monotonic()
    sixth = await phone(desktop, ninth)
    await expect_close(sixth, 4401, "phone: a sixth attempt")
    # No data leg within attachDeadlineMs (10 s): each waiting phone is closed 4404.
    for n, p in enumerate(phones):
        at = await expect_close(p, 4404, "phone: no data leg in time", timeout=ATTACH_MS / 1000 + 10)
        if n == 0:
            between(at - opened, ATTACH_MS / 1000 - 0.5, ATTACH_MS / 1000 + 1.5, "4404 after conn-open")
    await desktop.ws.close()


async def phone_refusals(ctx, relay):
    desktop = await Desktop.start(ctx, relay, "phone refusals")
    base = f"{desktop.cell}/v1/connect/"
    # No live control for that host on this cell.
    p = await connect(base + new_host())
    await p.send(json.dumps({"type": "relay-auth", "v": 1, "credential": "x" * 43}))
    await expect_close(p, 4404, "phone: host offline")
    for what, first, code, reason in [
        ("not an invite", json.dumps({"type": "relay-auth", "v": 1, "credential": "nope"}), 4401, None),
        ("malformed relay-auth", "{", 4401, None),
        ("relay-auth v 2", json.dumps({"type": "relay-auth", "v": 2, "credential": "x"}), 4401, None),
        ("binary first frame", b"{}", 4401, None),
        # 4 KiB with the header: 8 bytes (2, a 16-bit length, the mask) and 4088 of payload.
        ("first frame over 4 KiB", "x" * (FIRST_FRAME_LIMIT - 8 + 1), 1009, REASONS["first frame too large"]),
    ]:
        p = await connect(base + desktop.host)
        await p.send(first)
        await expect_close(p, code, f"phone: {what}", reason)
    # Exactly 4 KiB (header included) is read: a bad credential, not a size.
    p = await connect(base + desktop.host)
    pad = "x" * (FIRST_FRAME_LIMIT - 8 - len(json.dumps({"type": "relay-auth", "v": 1, "credential": ""})))
    await p.send(json.dumps({"type": "relay-auth", "v": 1, "credential": pad}))
    await expect_close(p, 4401, "phone: a 4 KiB first frame")
    # Pings are answered before the first frame, but never move its 2 s deadline.
    started = time.monotonic()
    p = await connect(base + desktop.host)

    async def keep_pinging():
        while True:
            await asyncio.wait_for(await p.ping(), 5)
            await asyncio.sleep(0.3)

    pinger = asyncio.create_task(keep_pinging())
    at = await expect_close(p, 4401, "phone: no first frame within 2 s")
    pinger.cancel()
    between(at - started, FIRST_FRAME_S, FIRST_FRAME_S + PROMPT, "phone first-frame deadline at")
    # A phone that closes before its first frame: its own code comes back.
    p = await connect(base + desktop.host)
    await p.close(4000, "changed my mind")
    eq(p.close_code, 4000, "pending phone: the relay's answer to its close")
    REPORTED.setdefault("client closes (any leg)", f"close_code {p.close_code} (the relay echoes the code)")
    await desktop.ws.close()


async def data_leg_refusals(ctx, relay):
    desktop = await Desktop.start(ctx, relay, "data leg refusals")
    invite = await desktop.invite()
    p = await phone(desktop, invite)
    open_ = await desktop.next("conn-open")
    for what, change in [
        ("a wrong ticket", {"connTicket": "x" * 43}),
        ("a wrong generation", {"generation": desktop.generation + 1}),
    ]:
        leg = await data_leg(desktop, dict(open_, **change), generation=change.get("generation"))
        await expect_close(leg, 4401, f"data leg: {what}")
    leg = await data_leg(desktop, dict(open_, connId="no-such-conn"))
    await expect_close(leg, 4401, "data leg: an unknown connId")
    started = time.monotonic()
    late = await connect(f"{desktop.cell}/v1/host/data/{open_['connId']}")
    at = await expect_close(late, 4401, "data leg: no first frame within 2 s")
    between(at - started, FIRST_FRAME_S, FIRST_FRAME_S + PROMPT, "data leg first-frame deadline at")
    # The right leg still attaches (the refusals used no attempt of the phone's).
    leg = await data_leg(desktop, open_)
    eq(json.loads(await asyncio.wait_for(p.recv(), 10)), {"type": "relay-hello", "ok": True}, "relay-hello after refusals")
    await p.close()
    await expect_close(leg, 4408, "data leg: its phone left", REASONS["peer left"])
    await desktop.ws.close()


def payload(size, seed):
    return bytes((n * 31 + seed) & 0xFF for n in range(min(size, 4096))) * (size // 4096 + 1)


async def traffic(ctx, relay):
    desktop = await Desktop.start(ctx, relay, "traffic")
    # Phone (the library's client) → data leg seen frame by frame.
    p, leg = await splice(desktop, leg_frames=True)
    sizes = [0, 1, 125, 126, 65535, 65536, MIB, LEG_LIMIT]
    for n, size in enumerate(sizes):
        data = payload(size, n)[:size]
        await p.send(data)
        text = ("é" * (size // 2 + 1))[: min(size, 100_000)]
        await p.send(text)
        frames = await leg.data_frames(2, 30)
        if len(frames) == 2:
            eq((frames[0].opcode, frames[0].fin, frames[0].data == data), (Opcode.BINARY, True, True), f"phone→host binary {size} B")
            eq((frames[1].opcode, frames[1].fin, frames[1].data.decode()), (Opcode.TEXT, True, text), f"phone→host text {size} B")
    # Fragmented: the boundaries arrive as they were sent (the library ends with an empty
    # final continuation).
    chunks = ["{\"part\":", "1,", "\"é\":", "\"x\"}"]
    await p.send(chunks)
    frames = await leg.data_frames(len(chunks) + 1)
    eq(
        [(f.opcode, f.fin, f.data) for f in frames],
        [(Opcode.TEXT, False, chunks[0].encode())]
        + [(Opcode.CONT, False, c.encode()) for c in chunks[1:]]
        + [(Opcode.CONT, True, b"")],
        "phone→host fragments",
    )
    # A WebSocket ping from the phone is answered by the relay and not forwarded (the data leg
    # would see it among its data frames).
    pong = await p.ping(b"phone-ping")
    await asyncio.wait_for(pong, 5)
    await p.send(b"after the ping")
    frames = await leg.data_frames(1)
    eq([f.data for f in frames], [b"after the ping"], "the frame after a ping")
    # Data leg (frame by frame) → phone: text, binary, and fragments the library reassembles.
    for n, size in enumerate(sizes):
        data = payload(size, n + 7)[:size]
        await leg.send("send_binary", data)
        got = await asyncio.wait_for(p.recv(), 30)
        eq((type(got), got == data), (bytes, True), f"host→phone binary {size} B")
    await leg.send("send_text", "moi".encode(), False)
    await leg.send("send_continuation", " ".encode(), False)
    await leg.send("send_continuation", "hei".encode(), True)
    eq(await asyncio.wait_for(p.recv(), 10), "moi hei", "host→phone fragments reassembled")
    # The leg's ping is answered by the relay.
    await leg.send("send_ping", b"leg")
    pong = await leg.frame()
    eq((pong.opcode, pong.data) if pong else None, (Opcode.PONG, b"leg"), "the data leg's pong")
    # Fragment boundaries host → phone, seen by a frame-level phone.
    p2, leg2 = await splice(desktop, phone_frames=True)
    await leg2.send(["a", "bc", "def"])
    frames = await p2.data_frames(4)
    eq(
        [(f.opcode, f.fin, f.data) for f in frames],
        [(Opcode.TEXT, False, b"a"), (Opcode.CONT, False, b"bc"), (Opcode.CONT, False, b"def"), (Opcode.CONT, True, b"")],
        "host→phone fragments",
    )
    # Closes a client starts come back with its own code; the other side hears 4408.
    await p.close(1000, "done")
    eq(p.close_code, 1000, "phone: the relay's answer to its 1000")
    frame = await leg.frame()
    while frame is not None and frame.opcode != Opcode.CLOSE:
        frame = await leg.frame()
    close = frame and websockets.frames.Close.parse(frame.data)
    eq((close.code, close.reason) if close else None, (4408, REASONS["peer left"]), "data leg after its phone left")
    SEEN_CODES.add(4408)
    await leg2.close(4000, "bye")
    eq(leg2.close_code, 4000, "data leg: the relay's answer to its 4000")
    frame = await p2.frame()
    while frame is not None and frame.opcode != Opcode.CLOSE:
        frame = await p2.frame()
    close = frame and websockets.frames.Close.parse(frame.data)
    eq(close.code if close else None, 4408, "phone after its data leg left")
    await desktop.ws.close(1000)
    code, _, _ = await desktop.close_report("control: the desktop closes 1000")
    eq(code, 1000, "control: the relay's answer to its 1000")
    SEEN_CODES.add(1000)


async def leg_limits(ctx, relay):
    desktop = await Desktop.start(ctx, relay, "leg limits")
    # One frame over 8 MiB: 1009 frame_too_large; its peer 4408.
    p, leg = await splice(desktop)
    await send_until_refused(p, b"\x00" * (LEG_LIMIT + 1))
    await expect_close(p, 1009, "phone: a frame over 8 MiB", REASONS["frame too large"])
    await expect_close(leg, 4408, "data leg: its phone sent too much", REASONS["peer left"])
    # The limit is per message: 12 MiB in 1 MiB fragments is 1009 message_too_large; the peer,
    # in the middle of the message, is closed 4408 between two fragments.
    # The library's legacy client echoes that 4408; its sans-I/O core (the newer clients')
    # refuses a close inside a message and answers 1002.
    for frames in (False, True):
        p, leg = await splice(desktop, leg_frames=frames)
        await send_until_refused(p, [b"\x01" * MIB for _ in range(12)])
        await expect_close(p, 1009, "phone: a message over 8 MiB in fragments", REASONS["message too large"])
        if not frames:
            code, reason, sent, _ = await closed(leg, "data leg: its phone left mid-message")
            eq((code, reason), (4408, REASONS["peer left"]), "data leg: its phone left mid-message")
            continue
        # (The sans-I/O core fails on that close before it passes it on as a frame: what it
        # received and sent is in its state.) The relay ends the connection on that answer.
        while leg.conn.close_sent is None and not leg.ended.is_set():
            await asyncio.sleep(0.01)
        started = time.monotonic()
        await asyncio.wait_for(leg.ended.wait(), 5)
        rcvd, sent = leg.conn.close_rcvd, leg.conn.close_sent
        eq(rcvd.code if rcvd else None, 4408, "frame-level data leg: the close")
        eq(sent.code if sent else None, 1002, "frame-level data leg: its answer")
        if rcvd and sent:
            SEEN_CODES.add(rcvd.code)
            REPORTED["data leg (sans-I/O core): its phone left mid-message"] = (
                f"received {rcvd.code} {rcvd.reason!r}, sent {sent.code} {sent.reason!r}"
            )
        check(time.monotonic() - started < PROMPT, "the relay kept the leg after its 1002 answer")
    # A frame no client may send (RSV1 without an extension): 1002, its peer 4408.
    p, leg = await splice(desktop)
    raw_write(p, masked_header(0x2, 0, rsv1=True))
    await expect_close(p, 1002, "phone: a frame with RSV1 set")
    await expect_close(leg, 4408, "data leg: its phone broke a rule")
    # The control is held to the same rules.
    raw_write(desktop.ws, masked_header(0x1, 0, rsv1=True))
    code, _, _ = await desktop.close_report("control: a frame with RSV1 set")
    eq(code, 1002, "control: a frame with RSV1 set")


async def phones_per_host(ctx, relay):
    desktop = await Desktop.start(ctx, relay, "phones per host")
    pairs = []
    invite = None
    for n in range(PHONES_PER_HOST):
        if n % INVITE_ATTEMPTS == 0:
            invite = await desktop.invite(f"i{n}")
        pairs.append(await splice(desktop, invite=invite))
    ninth = await phone(desktop, await desktop.invite("ninth"))
    await expect_close(ninth, 4429, "phone: a ninth phone")
    # The desktop's control leaves: each pair is closed 4408 "host left".
    await desktop.ws.close()
    for p, leg in pairs[:2]:
        await expect_close(p, 4408, "phone: its desktop's control left", REASONS["host left"])
        await expect_close(leg, 4408, "data leg: its control left", REASONS["host left"])


async def replaced_control(ctx, relay):
    first = await Desktop.start(ctx, relay, "replaced control")
    # The same desktop again (a second hello): the first control is closed 4408.
    second = await connect(
        first.cell + "/v1/host/control", {"Authorization": f"Bearer {first.token}"}
    )
    _, epoch = await assign(relay, first.token, first.host, "replacement")
    await second.send(json.dumps({"type": "host-hello", "v": 1, "relayHostId": first.host, "assignmentEpoch": epoch}))
    ack = json.loads(await asyncio.wait_for(second.recv(), 10))
    eq((ack["type"], ack["generation"]), ("host-hello-ack", first.generation + 1), "the newer control's ack")
    code, reason, _ = await first.close_report("control: replaced by a newer one")
    eq((code, reason), (4408, REASONS["replaced"]), "the older control")
    await second.close()


# ------------------------------------------------------------------------------------------
# Scenarios on the relay with short timings.


def env_ms(relay, name):
    return int(relay["env"][name]) / 1000


async def keepalive(ctx, relay):
    silence = env_ms(relay, "ORCA_RELAY_SILENCE_MS")
    # A desktop that never answers the JSON pings and sends nothing: 4408 "silent".
    quiet = await Desktop.start(ctx, relay, "silent control", answer_pings=False)
    started = time.monotonic()
    code, reason, at = await quiet.close_report("control: silent (no pong)", timeout=silence + 10)
    eq((code, reason), (4408, REASONS["silent control"]), "a silent control")
    between(at - started, silence - 0.1, silence + PROMPT, "silent control closed after")
    # One that never answers JSON pings but sends WebSocket pings (the library's keepalive)
    # lives on: any frame counts as life.
    alive = await Desktop.start(ctx, relay, "keepalive by WebSocket pings", ping_interval=silence / 4, answer_pings=False)
    await asyncio.sleep(silence * 2.5)
    check(not alive.ended.done(), "a control sending WebSocket pings was closed")
    await alive.invite("still here")
    await alive.ws.close()


async def splice_liveness(ctx, relay):
    idle = env_ms(relay, "ORCA_RELAY_SPLICE_IDLE_MS")
    desktop = await Desktop.start(ctx, relay, "splice liveness", ping_interval=1.0)
    # An idle pair whose ends answer pings (the library does) survives the idle window.
    p, leg = await splice(desktop)
    await asyncio.sleep(idle * 2.5)
    await p.send("still here")
    eq(await asyncio.wait_for(leg.recv(), 5), "still here", "an idle pair after two idle windows")
    # A phone that reads nothing (so answers no ping) is silent: 4408 "silent", its data leg
    # 4408 "peer left".
    p.transport.pause_reading()
    started = time.monotonic()
    at = await expect_close(leg, 4408, "data leg: its phone went silent", REASONS["peer left"], timeout=idle + 10)
    between(at - started, idle / 2, idle + 1.5, "silent phone's peer closed after")
    p.transport.resume_reading()
    await expect_close(p, 4408, "phone: silent (answered no ping)", REASONS["leg silent"])
    await desktop.ws.close()


async def wedge(ctx, relay):
    wedge_s = WEDGE_S
    desktop = await Desktop.start(ctx, relay, "wedge")
    p, leg = await splice(desktop)
    p.transport.pause_reading()  # the phone stops draining its socket
    started = time.monotonic()
    sender = asyncio.create_task(send_until_closed(leg, MIB))
    at = await expect_close(leg, 4429, "data leg: its phone stopped reading", REASONS["wedged"], timeout=wedge_s + 20)
    sender.cancel()
    between(at - started, wedge_s, wedge_s + 10, "wedged after (s)")
    # The phone that stopped reading is dropped without a close frame.
    p.transport.resume_reading()
    code, _, _, _ = await closed(p, "phone: stopped reading (dropped)")
    check(code in (None, 1006), f"the stalled phone got close code {code}")
    await desktop.ws.close()


async def send_until_refused(ws, message):
    """Sends `message`; the relay may close the connection before the library has sent all of
    it (it refuses from the header), which the library reports as a send on a closing
    connection."""
    try:
        await ws.send(message)
    except (ConnectionClosed, websockets.exceptions.InvalidState):
        pass


async def send_until_closed(ws, size):
    data = b"\x02" * size
    try:
        while True:
            await ws.send(data)
    except ConnectionClosed:
        pass


# ------------------------------------------------------------------------------------------
# The connection cap, and a drain.


async def capacity(ctx, relay):
    # ORCA_RELAY_CONNECTION_CAP=2: the control takes one unit. Two phones are upgraded (a
    # phone holds no unit before its first frame); the first one's relay-auth takes the
    # second unit, the other's comes to a full cell.
    desktop = await Desktop.start(ctx, relay, "capacity")
    invite = await desktop.invite()
    url = f"{desktop.cell}/v1/connect/{desktop.host}"
    first, second = await connect(url), await connect(url)
    auth = json.dumps({"type": "relay-auth", "v": 1, "credential": invite})
    await first.send(auth)
    await desktop.next("conn-open")
    await second.send(auth)
    await expect_close(second, 4429, "phone: the cell at its cap when its first frame came")
    # A phone or data leg upgraded while the cell is full is refused at the upgrade.
    status, headers = await refused(url)
    eq((status, headers.get("Retry-After")), (503, RETRY_AFTER), "a phone upgrade at the connection cap")
    other = new_host()
    tok = token(ctx["key"], f"user-{other}", other)
    cell, _ = await assign(relay, tok, other, "capacity: another desktop")
    status, headers = await refused(cell + "/v1/host/control", {"Authorization": f"Bearer {tok}"})
    eq((status, headers.get("Retry-After")), (503, RETRY_AFTER), "a control at the connection cap")
    await first.close()
    await desktop.ws.close()


async def drain(ctx, relay):
    grace = env_ms(relay, "ORCA_RELAY_DRAIN_GRACE_MS")
    stays = await Desktop.start(ctx, relay, "drain: stays")
    p, leg = await splice(stays)
    moves = await Desktop.start(ctx, relay, "drain: moves")
    pending_phone = await connect(f"{stays.cell}/v1/connect/{stays.host}")
    os.kill(relay["pid"], signal.SIGTERM)
    started = time.monotonic()
    for desktop in (stays, moves):
        message = await desktop.next("drain", timeout=10)
        eq(message, {"type": "drain", "graceMs": int(grace * 1000), "recovery": "resolve-director"}, "the drain message")
    # The desktop that moves asks the director again at once: a draining combined relay places
    # nobody.
    status, headers, body = await post(relay["http"], "/v1/assign", {"v": 1, "relayHostId": moves.host, "reconnect": True}, moves.token)
    SEEN_ASSIGN_STATUSES.add(status)
    eq((status, json.loads(body).get("error"), headers.get("retry-after")), (503, "relay_capacity_exhausted", RETRY_AFTER), "assign while draining")
    status, hdrs = await refused(moves.cell + "/v1/host/control", {"Authorization": f"Bearer {moves.token}"})
    eq((status, hdrs.get("Retry-After")), (503, RETRY_AFTER), "a control upgrade while draining")
    await moves.ws.close(1000)
    code, _, _ = await moves.close_report("control: leaves on drain (1000)")
    eq(code, 1000, "the answer to a drained desktop's 1000")
    # The one that stays is closed 4503 once the grace is over, and so are its pair and the
    # phone that never sent its first frame.
    code, reason, at = await stays.close_report("control: drained (4503)", timeout=grace + 10)
    eq(code, 4503, "a control that stayed through the drain")
    between(at - started, grace - 0.1, grace + PROMPT, "4503 after SIGTERM")
    await expect_close(p, 4503, "phone: its cell drained")
    await expect_close(leg, 4503, "data leg: its cell drained")
    await expect_close(pending_phone, 4503, "phone: drained before its first frame")


# ------------------------------------------------------------------------------------------
# The document's own tables.


def check_document(path):
    text = open(path, encoding="utf-8").read()
    section = text.split("## 3. Close codes", 1)[-1].split("\n## ", 1)[0]
    documented = {int(m) for m in re.findall(r"^\| (\d{4}) \|", section, re.M)}
    eq(documented, set(CLOSE_CODES) | set(DOCUMENTED_ONLY), "close codes in docs/PROTOCOL.md §3")
    for code, name in (CLOSE_CODES | DOCUMENTED_ONLY).items():
        check(re.search(rf"^\| {code} \| {re.escape(name)} \|", section, re.M), f"§3 names {code} {name}")
    refusals = text.split("### 2.", 1)[0].split("## 2.", 1)[-1]
    statuses = set()
    for cell in re.findall(r"^\| ([0-9][^|]*)\|", refusals, re.M):
        statuses |= {int(s) for s in re.findall(r"\b([1-5]\d\d)\b", cell.split("+")[0])}
    eq(statuses, UPGRADE_STATUSES, "upgrade refusals in docs/PROTOCOL.md §2")
    placement = text.split("## 1.", 1)[-1].split("\n## ", 1)[0]
    statuses = {int(s) for s in re.findall(r"^\| ([1-5]\d\d)\b", placement, re.M)}
    eq(statuses, ASSIGN_STATUSES, "/v1/assign answers in docs/PROTOCOL.md §1")
    timings = text.split("## 4. Timings", 1)[-1].split("\n## ", 1)[0]
    for row, value in TIMINGS:
        found = re.search(rf"^\| {re.escape(row)}[^|]*\| ([^|]+) \|", timings, re.M)
        if check(found, f"§4 has a row for {row}"):
            eq(found.group(1).strip(), value, f"§4 {row}")
    flat = " ".join(text.split())
    for reason in REASONS.values():
        check(f"`{reason}`" in flat, f"docs/PROTOCOL.md names the close reason `{reason}`")
    for phrase in [
        "1 MiB on the control socket, per frame and per message",
        "8 MiB per message on phone and data legs",
        "at most 4 KiB with its header (so at most 4,088 bytes of JSON)",
    ]:
        check(phrase in flat, f"docs/PROTOCOL.md says {phrase!r}")


# ------------------------------------------------------------------------------------------


async def run_all(ctx):
    relays = ctx["relays"]
    scenarios = [
        (placement_and_tokens, "defaults"),
        (http_refusals, "defaults"),
        (control_refusals, "defaults"),
        (control_steady_state, "defaults"),
        (invites, "defaults"),
        (phone_refusals, "defaults"),
        (data_leg_refusals, "defaults"),
        (traffic, "defaults"),
        (leg_limits, "defaults"),
        (phones_per_host, "defaults"),
        (replaced_control, "defaults"),
        (keepalive, "short"),
        (splice_liveness, "short"),
        (wedge, "defaults"),
        (capacity, "cap"),
        (drain, "drain"),
    ]

    async def one(scenario, relay_name):
        SCENARIO.set(scenario.__name__)
        started = time.monotonic()
        try:
            await scenario(ctx, relays[relay_name])
        except Exception as error:  # a scenario that broke off is a failure, with its trace
            fail(f"{scenario.__name__}: {type(error).__name__}: {error}\n{traceback.format_exc()}")
        took = time.monotonic() - started
        failed = any(name == scenario.__name__ for name, _ in FAILURES)
        verdict = "FAILED" if failed else "ok"
        print(f"{verdict:6} {scenario.__name__} ({relay_name}, {took:.1f} s)", flush=True)

    await asyncio.gather(*(one(s, r) for s, r in scenarios))


def main():
    ctx = json.loads(sys.argv[1])
    print(f"websockets {websockets.__version__} on Python {sys.version.split()[0]}", flush=True)
    check_document(ctx["doc"])
    asyncio.run(run_all(ctx))
    eq(SEEN_CODES, set(CLOSE_CODES), "close codes seen")
    eq(SEEN_UPGRADE_STATUSES, UPGRADE_STATUSES, "upgrade refusal statuses seen")
    eq(SEEN_ASSIGN_STATUSES, ASSIGN_STATUSES, "/v1/assign statuses seen")
    print("timings measured (value, then the bounds checked):")
    for what, value, low, high in sorted(MEASURED):
        print(f"  {what}: {value:.3f} in [{low:.3f}, {high:.3f}]")
    print("what the library reported:")
    for path in sorted(REPORTED):
        print(f"  {path}: {REPORTED[path]}")
    if FAILURES:
        print(f"{len(FAILURES)} failures:")
        for name, failure in FAILURES:
            print(f"  - {name}: {failure}")
        sys.exit(1)
    print("all passed")


if __name__ == "__main__":
    main()
