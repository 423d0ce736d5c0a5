#!/usr/bin/env python3
"""Doorman's Go client, as far as the wire is concerned, against a Doorman server.

The server is `usher server` (with --usher), or original_server.py as a control.

Speaks only Doorman's ORIGINAL schema and sends what youtube/doorman's
go/client/doorman/client.go and go/connection/connection.go send:

- GetCapacity with the client id and, per resource, its priority, `wants`
  and, as `has`, the whole lease it was last given; it refreshes after the
  smallest refresh interval of its leases, floored (at 1.2 s here, to keep
  the run short; the Go client's default floor is 5 s);
- responses matched by resource id; a response that carries `mastership` is
  a redirect: reconnect to `master_address` at once, or back off and retry
  when it is absent;
- ReleaseCapacity of one resource (Resource.Release), and on Close one with
  as many empty ids before the real ones as it holds resources (the Go
  client builds that list with make([]string, n) and then appends to it).

Every answer must parse under the original schema with all its required
fields; fields unknown to it are skipped and reported. Exit 0 and a JSON
summary on the last line of stdout when every check holds; exit 1 with the
reason otherwise.

    original_client.py share --server ADDR --advertise ADDR [--usher]
    original_client.py redirect --follower ADDR --master ADDR
"""

import argparse
import json
import os
import socket
import sys
import time

import doorman_stubs

pb, pb_grpc = doorman_stubs.load()
import grpc  # noqa: E402  (after the stubs, which explain a missing grpcio)

RPC_TIMEOUT_S = 5.0
# The Go client backs off 1 s x 1.3^n up to 60 s and retries forever; here
# a few tries, capped at 2 s, so that a broken server fails the check fast.
MAX_TRIES = 6
MAX_REDIRECTS = 10
EPS = 1e-6


class Failure(Exception):
    pass


def check(cond, what):
    if not cond:
        raise Failure(what)


class Report:
    """What the checks saw, printed as the run's summary."""

    def __init__(self):
        self.unknown = {}
        self.rpcs = 0
        self.redirects = 0
        self.notes = []

    def saw(self, msg):
        self.rpcs += 1
        lacking = doorman_stubs.missing_required(msg)
        check(not lacking, f"{msg.DESCRIPTOR.name} lacks required fields {lacking}: {msg}")
        doorman_stubs.unknown(msg, self.unknown)


REPORT = Report()


class Connection:
    """go/connection: one server address, following mastership redirects."""

    def __init__(self, addr):
        self.addr = addr
        self.current = None
        self.channel = None
        self.stub = None

    def connect(self, addr):
        self.close()
        self.channel = grpc.insecure_channel(addr)
        self.stub = pb_grpc.CapacityStub(self.channel)
        self.current = addr

    def close(self):
        if self.channel is not None:
            self.channel.close()
        self.channel, self.stub, self.current = None, None, None

    def run_master_aware(self, call):
        """runMasterAware: calls until a server answers without `mastership`."""
        last = None
        redirects = 0
        for tries in range(MAX_TRIES):
            if tries > 0:
                time.sleep(min(1.0 * 1.3**tries, 2.0))
            if self.channel is None:
                self.connect(self.addr)
            while True:  # Go's `goto RetryNoSleep`
                try:
                    out = call(self.stub)
                except grpc.RpcError as e:
                    last = f"{e.code()}: {e.details()}"
                    self.close()
                    break
                REPORT.saw(out)
                if not out.HasField("mastership"):
                    return out
                if not out.mastership.HasField("master_address") or not out.mastership.master_address:
                    last = f"{self.current} is not the master and does not know who is"
                    break
                redirects += 1
                REPORT.redirects += 1
                check(redirects <= MAX_REDIRECTS, f"more than {MAX_REDIRECTS} redirects in one call")
                self.connect(out.mastership.master_address)
        raise Failure(f"no answer after {MAX_TRIES} tries from {self.addr}: {last}")


class Resource:
    def __init__(self, rid, wants, priority):
        self.id, self.wants, self.priority = rid, float(wants), priority
        self.lease = None  # the last pb.Lease, sent back as `has`
        self.leases = []  # every lease received, for the refresh checks


class Client:
    """go/client/doorman.Client, driven step by step instead of by a goroutine."""

    def __init__(self, addr, client_id, min_refresh):
        self.conn = Connection(addr)
        self.id = client_id
        self.min_refresh = min_refresh
        self.resources = {}
        self.next_at = time.monotonic()

    def resource(self, rid, wants, priority=0):
        check(wants > 0, "the Go client refuses wants <= 0")
        self.resources[rid] = Resource(rid, wants, priority)
        self.perform_requests()  # adding a resource triggers a request at once

    def perform_requests(self):
        req = pb.GetCapacityRequest(client_id=self.id)
        for rid, r in self.resources.items():
            rr = req.resource.add(resource_id=rid, priority=r.priority, wants=r.wants)
            if r.lease is not None:
                rr.has.CopyFrom(r.lease)
        out = self.conn.run_master_aware(lambda s: s.GetCapacity(req, timeout=RPC_TIMEOUT_S))
        for pr in out.response:
            r = self.resources.get(pr.resource_id)
            check(r is not None, f"{self.id}: a response for {pr.resource_id!r}, never asked for")
            check(pr.gets.capacity >= 0, f"{self.id}: a negative lease {pr.gets}")
            check(pr.gets.refresh_interval >= 1, f"{self.id}: refresh interval below 1 s: {pr.gets}")
            lease = pb.Lease()
            lease.CopyFrom(pr.gets)
            r.lease = lease
            r.leases.append(lease)
        answered = {pr.resource_id for pr in out.response}
        check(answered == set(self.resources), f"{self.id}: asked {sorted(self.resources)}, answered {sorted(answered)}")
        interval = min(r.lease.refresh_interval for r in self.resources.values()) if self.resources else 3600
        self.next_at = time.monotonic() + max(interval, self.min_refresh)

    def has(self, rid):
        r = self.resources.get(rid)
        return r.lease.capacity if r is not None and r.lease is not None else 0.0

    def release(self, rid):
        """Resource.Release: forget it, and tell the server."""
        del self.resources[rid]
        req = pb.ReleaseCapacityRequest(client_id=self.id, resource_id=[rid])
        self.conn.run_master_aware(lambda s: s.ReleaseCapacity(req, timeout=RPC_TIMEOUT_S))

    def close(self):
        """Client.Close, with its list of len(resources) empty ids before the real ones."""
        ids = [""] * len(self.resources) + list(self.resources)
        req = pb.ReleaseCapacityRequest(client_id=self.id, resource_id=ids)
        self.conn.run_master_aware(lambda s: s.ReleaseCapacity(req, timeout=RPC_TIMEOUT_S))
        self.resources = {}
        self.conn.close()


def discovery(addr):
    with grpc.insecure_channel(addr) as ch:
        out = pb_grpc.CapacityStub(ch).Discovery(pb.DiscoveryRequest(), timeout=RPC_TIMEOUT_S)
    REPORT.saw(out)
    return out


def client_id(n):
    """The Go client's default id: hostname:pid:counter."""
    return f"{socket.gethostname()}:{os.getpid()}:{n}"


def check_within(clients, rid, capacity):
    total = sum(c.has(rid) for c in clients)
    check(total <= capacity + EPS, f"leases of {rid} add up to {total}, above its capacity {capacity}")
    return total


def refresh_until(clients, rid, capacity, target, deadline, what):
    """Refreshes each client when its lease says, until every lease of `rid` is its target."""
    rounds = 0
    while True:
        total = check_within(clients, rid, capacity)
        got = {c.id: round(c.has(rid), 3) for c in clients}
        if all(abs(c.has(rid) - t) <= 0.01 for c, t in zip(clients, target)):
            REPORT.notes.append(f"{what}: {got} after {rounds} refreshes (total {total:g})")
            return
        check(time.monotonic() < deadline and rounds < 200, f"{what}: leases {got}, expected {target}")
        c = min(clients, key=lambda c: c.next_at)
        time.sleep(max(0.0, c.next_at - time.monotonic()))
        c.perform_requests()
        rounds += 1


def check_refreshed(c, rid):
    leases = c.resources[rid].leases
    check(len(leases) >= 2, f"{c.id} refreshed {rid} only {len(leases)} time(s)")
    expiries = [lease.expiry_time for lease in leases]
    check(expiries == sorted(expiries), f"{c.id}: the expiry of {rid} went back: {expiries}")
    check(expiries[-1] > expiries[0], f"{c.id}: refreshing {rid} never moved its expiry: {expiries}")
    check(expiries[-1] > time.time(), f"{c.id}: the lease of {rid} has expired: {expiries[-1]}")


def share(args):
    """Several clients share a FAIR_SHARE resource, refresh, release and close."""
    deadline = time.monotonic() + args.timeout
    d = discovery(args.server)
    check(d.is_master, f"Discovery at the only server: is_master {d.is_master}")
    check(d.mastership.master_address == args.advertise, f"Discovery names {d.mastership.master_address!r}")

    cap, wants = args.capacity, [60.0, 30.0, 50.0]
    clients = [Client(args.server, client_id(i), args.min_refresh) for i in range(3)]
    for c, w in zip(clients, wants):
        c.resource("shared", w)
        check_within(clients, "shared", cap)
    # A second resource in the same requests: STATIC caps each client.
    clients[0].resource("static", args.static_capacity + 3)
    check(clients[0].has("static") == args.static_capacity, f"STATIC grant {clients[0].has('static')}")
    # Max-min fairness: 30 fits under a third; the other two split the rest.
    refresh_until(clients, "shared", cap, [35.0, 30.0, 35.0], deadline, "fair shares")

    clients[0].release("shared")
    # Everyone left fits now; with the released 35 still counted, c2 could not reach 50.
    refresh_until(clients[1:], "shared", cap, [30.0, 50.0], deadline, "after ReleaseCapacity")
    for c in clients:  # one more refresh each, when its lease says
        time.sleep(max(0.0, c.next_at - time.monotonic()))
        c.perform_requests()
        check_within(clients, "shared", cap)
    for c in clients[1:]:
        check_refreshed(c, "shared")
    check_refreshed(clients[0], "static")
    check(clients[0].has("static") == args.static_capacity, "the STATIC lease held through the refreshes")

    for c in clients:
        c.close()
    last = Client(args.server, client_id(3), args.min_refresh)
    last.resource("shared", cap)
    refresh_until([last], "shared", cap, [cap], deadline, "after every client closed")
    last.close()

    if args.usher:
        # usher's extensions reached this client, which skipped them, and
        # none of them takes a number Doorman could have used.
        seen = REPORT.unknown.get("ResourceResponse", [])
        check(seen, "usher's extension fields never reached the client: nothing was skipped")
        for name, nums in REPORT.unknown.items():
            check(all(n >= 100 for n in nums), f"{name} carries unknown fields {nums} below 100")
    else:
        check(not REPORT.unknown, f"a Doorman server sent fields unknown to Doorman: {REPORT.unknown}")


def redirect(args):
    """A client given a follower's address is sent to the master."""
    deadline = time.monotonic() + args.timeout
    d = discovery(args.follower)
    while not d.mastership.master_address:
        check(time.monotonic() < deadline, "the follower never named the master")
        time.sleep(0.1)
        d = discovery(args.follower)
    check(not d.is_master, "Discovery at the follower says is_master")
    check(d.mastership.master_address == args.master, f"the follower names {d.mastership.master_address!r}")
    check(discovery(args.master).is_master, "Discovery at the master says it is not")

    c = Client(args.follower, client_id(0), args.min_refresh)
    c.resource("shared", 10)
    check(REPORT.redirects >= 1, "GetCapacity at the follower was not redirected")
    check(c.conn.current == args.master, f"the client ended at {c.conn.current}")
    # What it wants, or more: below the capacity (100) usher's FAIR_SHARE also
    # hands out spare capacity (docs/server.md, "Spare capacity").
    check(10 - EPS <= c.has("shared") <= 100 + EPS, f"the master granted {c.has('shared')}")
    # ReleaseCapacity takes the same path (runMasterAware) from a fresh connection.
    before = REPORT.redirects
    conn = Connection(args.follower)
    req = pb.ReleaseCapacityRequest(client_id=c.id, resource_id=["shared"])
    conn.run_master_aware(lambda s: s.ReleaseCapacity(req, timeout=RPC_TIMEOUT_S))
    check(REPORT.redirects > before, "ReleaseCapacity at the follower was not redirected")
    check(conn.current == args.master, f"the release ended at {conn.current}")
    conn.close()
    # The release took: a newcomer at the master gets the whole capacity.
    last = Client(args.master, client_id(1), args.min_refresh)
    last.resource("shared", args.capacity)
    refresh_until([last], "shared", args.capacity, [args.capacity], deadline, "after the redirected release")
    last.close()
    c.conn.close()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--timeout", type=float, default=60.0, help="seconds for the whole scenario")
    p.add_argument("--min-refresh", type=float, default=1.2, help="floor of the refresh interval, seconds")
    sub = p.add_subparsers(dest="scenario", required=True)
    s = sub.add_parser("share")
    s.add_argument("--server", required=True)
    s.add_argument("--advertise", required=True, help="the address the server advertises as master")
    s.add_argument("--capacity", type=float, default=100.0, help="of resource `shared` (FAIR_SHARE)")
    s.add_argument("--static-capacity", type=float, default=5.0, help="of resource `static` (STATIC)")
    s.add_argument("--usher", action="store_true", help="expect usher's extension fields (numbers >= 100)")
    r = sub.add_parser("redirect")
    r.add_argument("--follower", required=True)
    r.add_argument("--master", required=True)
    r.add_argument("--capacity", type=float, default=100.0, help="of resource `shared`")
    args = p.parse_args()
    try:
        {"share": share, "redirect": redirect}[args.scenario](args)
    except Failure as e:
        print(f"interop check failed: {e}", file=sys.stderr)
        print(json.dumps({"ok": False, "error": str(e), **vars(REPORT)}))
        return 1
    print(json.dumps({"ok": True, **vars(REPORT)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
