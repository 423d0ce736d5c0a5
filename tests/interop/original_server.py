#!/usr/bin/env python3
"""A Doorman root server on the ORIGINAL schema, for usher to lease from.

A port of what youtube/doorman's go/server/doorman (server.go, resource.go,
algorithm.go, store.go) does for a standalone master: the lease store, the
four algorithms (FAIR_SHARE with the original's two rounds), learning mode,
dynamic safe capacity, and the answers' exact shape, including its quirk of
answering GetServerCapacity with `safe_capacity` 0 for a template that sets
none. Like Go's proto.Unmarshal, it refuses a request that lacks a required
field (INTERNAL); fields the original schema does not know are skipped.

It prints one JSON line per event on stdout: {"event": "listening", "addr"}
first, then one per RPC with the request as parsed, the unknown field
numbers it skipped per message type, and the response (or the error).

    original_server.py --config JSON [--listen 127.0.0.1:0] [--max-seconds 300]

--config is a ResourceRepository in JSON, with the YAML's field names:
{"resources": [{"identifier_glob": "*", "capacity": 10,
  "algorithm": {"kind": "FAIR_SHARE", "lease_length": 10, "refresh_interval": 2}}]}
"""

import argparse
import fnmatch
import json
import sys
import threading
import time
from concurrent import futures

import doorman_stubs

pb, pb_grpc = doorman_stubs.load()
import grpc  # noqa: E402  (after the stubs, which explain a missing grpcio)
from google.protobuf import json_format  # noqa: E402

Kind = pb.Algorithm


class Lease:
    def __init__(self):
        self.expiry, self.refresh_interval, self.has, self.wants, self.subclients = 0.0, 0, 0.0, 0.0, 0


class LeaseStore:
    """store.go: one resource's leases, with running sums."""

    def __init__(self):
        self.leases = {}

    def get(self, client):
        return self.leases.get(client, Lease())

    def sum_has(self):
        return sum(lease.has for lease in self.leases.values())

    def sum_wants(self):
        return sum(lease.wants for lease in self.leases.values())

    def count(self):
        return sum(lease.subclients for lease in self.leases.values())

    def assign(self, client, length, interval, has, wants, subclients):
        lease = self.leases.setdefault(client, Lease())
        lease.has, lease.wants, lease.subclients = has, wants, subclients
        lease.expiry, lease.refresh_interval = time.time() + length, interval
        return lease

    def release(self, client):
        self.leases.pop(client, None)

    def clean(self):
        now = time.time()
        for client in [c for c, lease in self.leases.items() if now > lease.expiry]:
            del self.leases[client]


def no_algorithm(store, capacity, r, length, interval):
    return store.assign(r["client"], length, interval, r["wants"], r["wants"], r["subclients"])


def static(store, capacity, r, length, interval):
    return store.assign(r["client"], length, interval, min(capacity, r["wants"]), r["wants"], r["subclients"])


def fair_share(store, capacity, r, length, interval):
    """algorithm.go's FairShare, two rounds of redistribution and all."""
    client, wants, sub = r["client"], r["wants"], r["subclients"]
    old = store.get(client)
    count = store.count() - old.subclients + sub
    available = capacity - store.sum_has() + old.has
    equal_share = capacity / count
    deserved_share = equal_share * sub
    if wants <= deserved_share:
        return store.assign(client, length, interval, min(wants, available), wants, sub)
    extra, want_extra, want_extra_clients = 0.0, sub, {}
    for cid, lease in store.leases.items():
        if cid == client:
            continue
        deserved = lease.subclients * equal_share
        if lease.wants < deserved:
            extra += deserved - lease.wants
        elif lease.wants > deserved:
            want_extra += lease.subclients
            want_extra_clients[cid] = lease
    deserved_extra = extra / want_extra * sub
    if wants < deserved_share + deserved_extra:
        return store.assign(client, length, interval, min(wants, available), wants, sub)
    extra_extra, want_extra_extra = 0.0, sub
    for cid, lease in want_extra_clients.items():
        if lease.wants < deserved_extra + deserved_share:
            extra_extra += deserved_extra + deserved_share - lease.wants
        elif lease.wants > deserved_extra + deserved_share:
            want_extra_extra += lease.subclients
    deserved_extra_extra = extra_extra / want_extra_extra * sub
    gets = min(deserved_share + deserved_extra + deserved_extra_extra, available)
    return store.assign(client, length, interval, gets, wants, sub)


def proportional_share(store, capacity, r, length, interval):
    client, wants, sub = r["client"], r["wants"], r["subclients"]
    count, old = store.count(), store.get(client)
    if client not in store.leases:
        count += sub
    equal_share = capacity / count
    equal_share_per_client = equal_share * sub
    unused = capacity - store.sum_has() + old.has
    if store.sum_wants() <= capacity or wants <= equal_share_per_client:
        return store.assign(client, length, interval, min(wants, unused), wants, sub)
    extra_capacity, extra_need = 0.0, 0.0
    for cid, lease in store.leases.items():
        w, s = (wants, sub) if cid == client else (lease.wants, lease.subclients)
        share = equal_share * s
        if w < share:
            extra_capacity += share - w
        else:
            extra_need += w - share
    gets = equal_share_per_client + (wants - equal_share_per_client) * (extra_capacity / extra_need)
    return store.assign(client, length, interval, min(gets, unused), wants, sub)


def learn(store, capacity, r, length, interval):
    return store.assign(r["client"], length, interval, r["has"], r["wants"], r["subclients"])


ALGORITHMS = {
    Kind.NO_ALGORITHM: no_algorithm,
    Kind.STATIC: static,
    Kind.PROPORTIONAL_SHARE: proportional_share,
    Kind.FAIR_SHARE: fair_share,
}


class Resource:
    def __init__(self, rid, template, became_master_at):
        self.id, self.config, self.store = rid, template, LeaseStore()
        algo = template.algorithm
        learning = algo.learning_mode_duration if algo.HasField("learning_mode_duration") else algo.lease_length
        self.learning_end = became_master_at + learning if learning > 0 else 0.0

    def decide(self, r):
        self.store.clean()
        algo = self.config.algorithm
        decide = learn if self.learning_end > time.time() else ALGORITHMS[algo.kind]
        lease = decide(self.store, self.config.capacity, r, algo.lease_length, algo.refresh_interval)
        return pb.Lease(expiry_time=int(lease.expiry), refresh_interval=lease.refresh_interval, capacity=lease.has)

    def safe_capacity(self):
        """resource.go's SetSafeCapacity: configured, else capacity / clients."""
        if self.config.HasField("safe_capacity"):
            return self.config.safe_capacity
        return self.config.capacity / self.store.count()


class Server(pb_grpc.CapacityServicer):
    def __init__(self, repo, addr):
        self.repo, self.addr = repo, addr
        self.resources = {}
        self.lock = threading.Lock()
        self.became_master_at = time.time()

    def resource(self, rid):
        if rid not in self.resources:
            self.resources[rid] = Resource(rid, self.template(rid), self.became_master_at)
        return self.resources[rid]

    def template(self, rid):
        """server.go's findConfigForResource: an exact match first, then globs in order
        (fnmatch standing in for Go's filepath.Match)."""
        for t in self.repo.resources:
            if t.identifier_glob == rid:
                return t
        for t in self.repo.resources:
            if fnmatch.fnmatchcase(rid, t.identifier_glob):
                return t
        raise KeyError(rid)  # validated away: the last template is "*"

    def Discovery(self, request, context):
        return self.serve("Discovery", request, context, self.discovery)

    def GetCapacity(self, request, context):
        return self.serve("GetCapacity", request, context, self.get_capacity)

    def GetServerCapacity(self, request, context):
        return self.serve("GetServerCapacity", request, context, self.get_server_capacity)

    def ReleaseCapacity(self, request, context):
        return self.serve("ReleaseCapacity", request, context, self.release_capacity)

    def serve(self, name, request, context, handler):
        event = {"event": "rpc", "rpc": name, "unknown": doorman_stubs.unknown(request)}
        event["request"] = json_format.MessageToDict(request, preserving_proto_field_name=True)
        lacking = doorman_stubs.missing_required(request)
        try:
            if lacking:
                raise Refused(grpc.StatusCode.INTERNAL, f"proto: required fields not set: {lacking}")
            with self.lock:
                response = handler(request)
        except Refused as e:
            event["error"] = f"{e.code.name}: {e.details}"
            emit(event)
            context.abort(e.code, e.details)
        event["response"] = json_format.MessageToDict(response, preserving_proto_field_name=True)
        emit(event)
        return response

    def discovery(self, _request):
        return pb.DiscoveryResponse(is_master=True, mastership=pb.Mastership(master_address=self.addr))

    def get_capacity(self, request):
        out = pb.GetCapacityResponse()
        for req in request.resource:
            res = self.resource(req.resource_id)
            r = {"client": request.client_id, "has": req.has.capacity, "wants": req.wants, "subclients": 1}
            gets = res.decide(r)
            out.response.add(resource_id=res.id, gets=gets, safe_capacity=res.safe_capacity())
        return out

    def get_server_capacity(self, request):
        out = pb.GetServerCapacityResponse()
        decided = []
        for req in request.resource:
            if any(band.num_clients < 1 for band in req.wants):
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "subclients should be > 0")
            r = {
                "client": request.server_id,
                "has": req.has.capacity,
                "wants": sum(band.wants for band in req.wants),
                "subclients": sum(band.num_clients for band in req.wants),
            }
            decided.append((req.resource_id, r))
        for rid, r in decided:
            res = self.resource(rid)
            gets = res.decide(r)
            # Go sends config.GetSafeCapacity(): 0 when the template sets none.
            out.response.add(
                resource_id=res.id, gets=gets, algorithm=res.config.algorithm, safe_capacity=res.config.safe_capacity
            )
        return out

    def release_capacity(self, request):
        for rid in request.resource_id:
            if rid in self.resources:
                self.resources[rid].store.release(request.client_id)
        return pb.ReleaseCapacityResponse()


class Refused(Exception):
    def __init__(self, code, details):
        super().__init__(details)
        self.code, self.details = code, details


def emit(event):
    print(json.dumps(event), flush=True)


def validate(repo):
    """config.go's checks, enough to refuse a config Doorman would refuse."""
    check = [
        (len(repo.resources) > 0 and repo.resources[-1].identifier_glob == "*", "the last template must be *"),
    ]
    for t in repo.resources:
        a = t.algorithm
        check.append((a.refresh_interval >= 1, f"{t.identifier_glob}: refresh_interval < 1"))
        check.append((a.lease_length >= 1, f"{t.identifier_glob}: lease_length < 1"))
        check.append((a.lease_length >= a.refresh_interval, f"{t.identifier_glob}: lease_length < refresh_interval"))
    for ok, what in check:
        if not ok:
            sys.exit(f"original_server: bad config: {what}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="a ResourceRepository in JSON")
    p.add_argument("--listen", default="127.0.0.1:0")
    p.add_argument("--max-seconds", type=float, default=300.0, help="stop after this long whatever happens")
    args = p.parse_args()
    repo = json_format.ParseDict(json.loads(args.config), pb.ResourceRepository())
    validate(repo)
    grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    port = grpc_server.add_insecure_port(args.listen)
    addr = f"{args.listen.rsplit(':', 1)[0]}:{port}"
    pb_grpc.add_CapacityServicer_to_server(Server(repo, addr), grpc_server)
    grpc_server.start()
    emit({"event": "listening", "addr": addr})
    grpc_server.wait_for_termination(timeout=args.max_seconds)
    grpc_server.stop(grace=1)


if __name__ == "__main__":
    main()
