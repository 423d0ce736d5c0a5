#!/usr/bin/env python3
"""Runs a set of Kubernetes manifests as local processes and checks that they work.

    run-manifests.py --bin target/debug/usher --name NAME [--namespace NS] [--configmap NAME=FILE]... MANIFEST...

Every pod of every Deployment and StatefulSet becomes a network namespace of
its own (a veth on a private bridge, 10.244.0.0/16, inside a network namespace
this script makes: nothing reaches or leaves the machine's network), and every
container of the usher and etcd images a local process in it:
  - its args (and command) as written, `$(VAR)` expanded from its env, the env
    as written (downward API: the pod's name, namespace and IP; Secret keys);
  - its ConfigMap, Secret, emptyDir and volumeClaimTemplate volumes bind-mounted
    at their mountPaths, verbatim, in a private mount namespace;
  - its runAsUser/runAsGroup (setpriv);
  - the usher image runs the usher binary, the etcd image Debian's etcd.
Cluster names (pods of headless Services, Services, in all their short forms)
resolve through a private /etc/hosts to the pods' addresses. Names outside the
manifests (the example app's upstream api.github.com, an existing etcd) resolve
to local stand-ins on the bridge: an HTTPS upstream with a throwaway CA (the
sidecars get SSL_CERT_FILE for it: the only env added), and an etcd with TLS,
client certificates and auth when the servers are told to use one.
Secrets the manifests name are made as docs/deploy.md and the README say: the
servers' TLS certificate names `<fullname>.<namespace>.svc` and
`*.<headless Service>.<namespace>.svc.cluster.local`.

Then it checks each container's startup, readiness and liveness probes, that
every sidecar holds a lease for each of its resources, and that one request
through each sidecar is admitted and reaches the local upstream. It prints the
time from each sidecar's start to its first admitted request; with
USHER_MANIFESTS_MAX_ADMIT_S=N it fails when that is longer than N seconds.
"""
import argparse, base64, http.client, http.server, json, os, re, shutil, socket, ssl, subprocess
import sys, tempfile, threading, time

import yaml

CLUSTER_DOMAIN = "cluster.local"
BRIDGE_IP = "10.244.0.1"
UPSTREAM_BODY = b"usher-local-upstream\n"


def log(msg):
    print(f"  [{ARGS.name}] {msg}", flush=True)


def stop_all(sig):
    for p in PROCS:
        try:
            os.killpg(p.pid, sig)
        except OSError:
            pass


def fail(msg):
    print(f"FAIL [{ARGS.name}]: {msg}", flush=True)
    stop_all(9)
    sys.exit(1)


def sh(*cmd, **kw):
    return subprocess.run(cmd, check=True, capture_output=True, text=True, **kw).stdout


# ---- certificates (openssl) ----------------------------------------------------------
def make_ca(d, name):
    key, crt = f"{d}/{name}-ca.key", f"{d}/{name}-ca.crt"
    sh("openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days", "2",
       "-subj", f"/CN={name} test CA", "-keyout", key, "-out", crt,
       "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    return key, crt


def make_leaf(d, ca, name, sans, subject="/O=usher"):
    key, csr, crt = f"{d}/{name}.key", f"{d}/{name}.csr", f"{d}/{name}.crt"
    ext = f"{d}/{name}.ext"
    with open(ext, "w") as f:
        alt = ",".join(("IP:" if re.fullmatch(r"[0-9.]+", s) else "DNS:") + s for s in sans)
        f.write(f"subjectAltName={alt}\nextendedKeyUsage=serverAuth,clientAuth\nkeyUsage=digitalSignature\n")
    sh("openssl", "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-subj", subject,
       "-keyout", key, "-out", csr)
    sh("openssl", "x509", "-req", "-in", csr, "-CA", ca[1], "-CAkey", ca[0], "-CAcreateserial", "-days", "2",
       "-out", crt, "-extfile", ext)
    return key, crt


# ---- the model ---------------------------------------------------------------------------
class Pod:
    def __init__(self, name, ns, labels, spec, hostname=None, subdomain=None, claims=()):
        self.name, self.ns, self.labels, self.spec = name, ns, labels, spec
        self.hostname, self.subdomain, self.claims = hostname, subdomain, claims
        self.ip = None
        self.pid = None


def load(files):
    docs = []
    for f in files:
        with open(f) as fh:
            docs += [d for d in yaml.safe_load_all(fh) if d]
    return docs


def ns_of(d, default):
    return d["metadata"].get("namespace") or default


def selects(sel, labels):
    return bool(sel) and all(labels.get(k) == v for k, v in sel.items())


def pods_of(docs, default_ns):
    pods = []
    for d in docs:
        if d["kind"] not in ("Deployment", "StatefulSet"):
            continue
        t = d["spec"]["template"]
        n = d["spec"].get("replicas", 1)
        for i in range(n):
            name = f"{d['metadata']['name']}-{i}"
            sts = d["kind"] == "StatefulSet"
            pods.append(Pod(name, ns_of(d, default_ns), t["metadata"].get("labels") or {}, t["spec"],
                            hostname=name if sts else None,
                            subdomain=d["spec"].get("serviceName") if sts else None,
                            claims=[c["metadata"]["name"] for c in d["spec"].get("volumeClaimTemplates") or []]))
    return pods


# ---- the local stand-ins -------------------------------------------------------------------
class Upstream(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("content-length", str(len(UPSTREAM_BODY)))
        self.end_headers()
        self.wfile.write(UPSTREAM_BODY)

    def log_message(self, *a):
        pass


def start_upstream(ca, work, names):
    key, crt = make_leaf(work, ca, "upstream", names)
    for port, tls in ((443, True), (80, False)):
        srv = http.server.ThreadingHTTPServer((BRIDGE_IP, port), Upstream)
        if tls:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(crt, key)
            srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
        threading.Thread(target=srv.serve_forever, daemon=True).start()


def etcd_call(ctx, path, body, token=None):
    c = http.client.HTTPSConnection(BRIDGE_IP, 2379, context=ctx, timeout=5)
    headers = {"content-type": "application/json"}
    if token:
        headers["authorization"] = token
    c.request("POST", path, json.dumps(body), headers)
    r = c.getresponse()
    text = r.read().decode()
    if r.status != 200:
        fail(f"external etcd {path}: {r.status} {text}")
    return json.loads(text)


def start_external_etcd(work, ca, names, client, password, key_prefix):
    """An existing etcd as production runs it: TLS, client certificates, auth with a user."""
    key, crt = make_leaf(work, ca, "etcd-server", names + [BRIDGE_IP])
    url = f"https://{BRIDGE_IP}:2379"
    spawn(["etcd", "--name", "ext", "--data-dir", f"{work}/ext-etcd", "--listen-client-urls", url,
           "--advertise-client-urls", url, "--listen-peer-urls", f"http://{BRIDGE_IP}:2390",
           "--initial-advertise-peer-urls", f"http://{BRIDGE_IP}:2390", "--initial-cluster", f"ext=http://{BRIDGE_IP}:2390",
           "--cert-file", crt, "--key-file", key, "--trusted-ca-file", ca[1], "--client-cert-auth"],
          f"{work}/logs/external-etcd.log")
    ctx = ssl.create_default_context(cafile=ca[1])
    ctx.load_cert_chain(client[1], client[0])
    ctx.check_hostname = False
    deadline = time.monotonic() + 30
    while True:
        try:
            etcd_call(ctx, "/v3/maintenance/status", {})
            break
        except (OSError, ssl.SSLError):
            if time.monotonic() > deadline:
                fail("the external etcd did not start")
            time.sleep(0.2)
    b64 = lambda s: base64.b64encode(s.encode()).decode()
    end = key_prefix[:-1] + chr(ord(key_prefix[-1]) + 1)
    for path, body in [
        ("/v3/auth/user/add", {"name": "root", "password": "root-pw"}),
        ("/v3/auth/role/add", {"name": "root"}),
        ("/v3/auth/user/grant", {"user": "root", "role": "root"}),
        ("/v3/auth/role/add", {"name": "usher"}),
        ("/v3/auth/role/grant", {"name": "usher", "perm": {"permType": "READWRITE", "key": b64(key_prefix), "range_end": b64(end)}}),
        ("/v3/auth/user/add", {"name": "usher", "password": password}),
        ("/v3/auth/user/grant", {"user": "usher", "role": "usher"}),
        ("/v3/auth/enable", {}),
    ]:
        etcd_call(ctx, path, body)
    log(f"external etcd at {url}: TLS, client certificates, auth (user usher on {key_prefix})")


# ---- processes -------------------------------------------------------------------------------
PROCS = []


def spawn(argv, logfile, **kw):
    p = subprocess.Popen(argv, stdout=open(logfile, "w"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                         start_new_session=True, **kw)
    PROCS.append(p)
    return p


def sandbox(pod, i):
    """The pod's network namespace: a sleeping process in it, a veth to the bridge."""
    p = subprocess.Popen(["unshare", "--net", "sleep", "infinity"], start_new_session=True)
    PROCS.append(p)
    # Wait until unshare has made the namespace: on a busy machine a fixed pause
    # was sometimes too short, and the veth went to the outer namespace.
    ours, deadline = os.readlink("/proc/self/ns/net"), time.monotonic() + 10
    while True:
        try:
            if os.readlink(f"/proc/{p.pid}/ns/net") != ours:
                break
        except OSError:
            pass
        if time.monotonic() > deadline:
            fail(f"{pod.name}: no network namespace after 10 s")
        time.sleep(0.01)
    pod.pid, pod.ip = p.pid, f"10.244.{1 + i // 250}.{1 + i % 250}"
    veth = f"vp{i}"
    sh("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", str(pod.pid))
    sh("ip", "link", "set", veth, "master", "cl0", "up")
    sh("nsenter", "-t", str(pod.pid), "-n", "sh", "-c",
       f"ip link set lo up && ip addr add {pod.ip}/16 dev eth0 && ip link set eth0 up && ip route add default via {BRIDGE_IP}")


def env_of(c, pod, secrets):
    env = {}
    for e in c.get("env") or []:
        if "value" in e:
            v = str(e["value"])
        else:
            vf = e["valueFrom"]
            if "fieldRef" in vf:
                v = {"metadata.name": pod.name, "metadata.namespace": pod.ns, "status.podIP": pod.ip}[vf["fieldRef"]["fieldPath"]]
            elif "secretKeyRef" in vf:
                ref = vf["secretKeyRef"]
                v = secrets[(pod.ns, ref["name"])][ref["key"]]
            else:
                fail(f"{pod.name}: env {e['name']}: valueFrom {list(vf)} is not supported")
        env[e["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), v)
    return env


def expand(args, env):
    return [re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), a) for a in args]


# ---- probes and requests ------------------------------------------------------------------------
def http_get(host, port, path, timeout=2):
    try:
        c = http.client.HTTPConnection(host, port, timeout=timeout)
        c.request("GET", path)
        r = c.getresponse()
        return r.status, r.read().decode(errors="replace")
    except (OSError, http.client.HTTPException):
        return None, ""


def port_of(c, port):
    if isinstance(port, int):
        return port
    for p in c.get("ports") or []:
        if p.get("name") == port:
            return p["containerPort"]
    fail(f"container {c['name']}: no port named {port}")


def wait_probe(pod, c, probe, deadline_s):
    spec = (c.get(probe) or {}).get("httpGet")
    if not spec:
        return None
    port = port_of(c, spec["port"])
    t0 = time.monotonic()
    while time.monotonic() - t0 < deadline_s:
        status, body = http_get(pod.ip, port, spec["path"])
        if status == 200:
            return time.monotonic() - t0
        time.sleep(0.2)
    fail(f"{pod.name}/{c['name']}: {probe} GET {spec['path']} on :{port} never answered 200 in {deadline_s} s "
         f"(last: {status} {body.strip()[:200]})")


REQUESTER = r"""
import http.client, sys, time
port, budget = int(sys.argv[1]), float(sys.argv[2])
t0 = time.monotonic()
seen = {}
while time.monotonic() - t0 < budget:
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        c.request("GET", "/", headers={"host": "127.0.0.1"})
        r = c.getresponse()
        body = r.read()
        seen[r.status] = seen.get(r.status, 0) + 1
        if r.status == 200 and body == b"usher-local-upstream\n":
            print(f"ADMITTED {time.monotonic() - t0:.2f} {seen}", flush=True)
            sys.exit(0)
    except OSError as e:
        seen[type(e).__name__] = seen.get(type(e).__name__, 0) + 1
    time.sleep(0.25)
print(f"NEVER {seen}", flush=True)
"""


# ---- the run ------------------------------------------------------------------------------------
def main():
    work = tempfile.mkdtemp(prefix=f"run-manifests-{ARGS.name}-")
    os.makedirs(f"{work}/logs")
    os.chmod(work, 0o755)
    docs = load(ARGS.manifests)
    default_ns = ARGS.namespace
    pods = pods_of(docs, default_ns)
    if not pods:
        fail("no workloads")
    configmaps = {(ns_of(d, default_ns), d["metadata"]["name"]): d.get("data") or {} for d in docs if d["kind"] == "ConfigMap"}
    for spec in ARGS.configmap:
        name, _, f = spec.partition("=")
        for ns in {p.ns for p in pods}:
            configmaps[(ns, name)] = {"resources.yaml": open(f).read()}
    services = [d for d in docs if d["kind"] == "Service"]

    # The network: a bridge, and each pod's namespace on it.
    sh("ip", "link", "set", "lo", "up")
    sh("ip", "link", "add", "cl0", "type", "bridge")
    sh("ip", "addr", "add", f"{BRIDGE_IP}/16", "dev", "cl0")
    sh("ip", "link", "set", "cl0", "up")
    for i, p in enumerate(pods):
        sandbox(p, i)

    # Names: pods of headless Services, Services, and the stand-ins outside the manifests.
    hosts = {}
    for p in pods:
        if p.subdomain:
            for suffix in (f"svc.{CLUSTER_DOMAIN}", "svc", ""):
                hosts.setdefault(".".join(x for x in (p.hostname, p.subdomain, p.ns, suffix) if x), []).append(p.ip)
    for s in services:
        ns = ns_of(s, default_ns)
        chosen = [p for p in pods if p.ns == ns and selects(s["spec"].get("selector"), p.labels)]
        for port in s["spec"].get("ports") or []:
            tp = port.get("targetPort", port["port"])
            for p in chosen:
                cport = next((cp["containerPort"] for c in p.spec.get("containers", []) + p.spec.get("initContainers", [])
                              for cp in c.get("ports") or [] if cp.get("name") == tp or cp["containerPort"] == tp), None)
                if cport is not None and cport != port["port"]:
                    fail(f"Service {s['metadata']['name']}: port {port['port']} -> {cport}: this check maps names, not ports")
        for suffix in (f"svc.{CLUSTER_DOMAIN}", "svc", ""):
            name = ".".join(x for x in (s["metadata"]["name"], ns, suffix) if x)
            for p in chosen:
                hosts.setdefault(name, []).append(p.ip)

    # Secrets and stand-ins the manifests refer to.
    ca = make_ca(work, "cluster")
    secrets = {}
    wanted = set()
    for p in pods:
        for v in p.spec.get("volumes") or []:
            if "secret" in v:
                wanted.add((p.ns, v["secret"]["secretName"]))
        for c in p.spec.get("containers", []) + p.spec.get("initContainers", []):
            for e in c.get("env") or []:
                ref = (e.get("valueFrom") or {}).get("secretKeyRef")
                if ref:
                    wanted.add((p.ns, ref["name"]))
    # Every container's args, $(VAR) expanded from its plain and downward-API env.
    def plain_env(c, p):
        env = {}
        for e in c.get("env") or []:
            ref = (e.get("valueFrom") or {}).get("fieldRef", {}).get("fieldPath")
            v = e.get("value") or {"metadata.name": p.name, "metadata.namespace": p.ns, "status.podIP": p.ip}.get(ref)
            if v is not None:
                env[e["name"]] = str(v)
        return env
    all_args = " ".join(a for p in pods for c in p.spec.get("containers", []) + p.spec.get("initContainers", [])
                        for a in expand(c.get("args") or [], plain_env(c, p)))
    externals = set()
    for data in configmaps.values():
        for text in data.values():
            externals |= set(re.findall(r"url:\s*\"?https?://([a-z0-9.-]+)", text))
    etcd_hosts = set()
    m = re.search(r"--etcd-endpoints=(\S+)", all_args)
    if m:
        for u in m.group(1).split(","):
            h = re.sub(r"^\w+://", "", u).rsplit(":", 1)[0]
            if h not in hosts:
                etcd_hosts.add(h)
    for h in externals | etcd_hosts:
        hosts.setdefault(h, []).append(BRIDGE_IP)
    with open(f"{work}/hosts", "w") as f:
        f.write("127.0.0.1 localhost\n")
        for name, ips in sorted(hosts.items()):
            for ip in ips:
                f.write(f"{ip} {name}\n")
    sh("mount", "--bind", f"{work}/hosts", "/etc/hosts")
    log(f"{len(pods)} pods on 10.244.0.0/16, {len(hosts)} names in a private /etc/hosts")

    for ns, name in sorted(wanted):
        d = f"{work}/secret-{ns}-{name}"
        os.makedirs(d)
        data = {}
        if "etcd" in name and "tls" in name:
            # A client certificate for etcd, without a CommonName (etcd's gateway refuses one with auth on).
            k, c = make_leaf(work, ca, f"etcd-client-{name}", ["usher"])
            data = {"ca.crt": open(ca[1]).read(), "tls.crt": open(c).read(), "tls.key": open(k).read()}
        elif "auth" in name or "password" in name:
            data = {"password": "usher-etcd-pw"}
        else:
            # The servers' certificate, as docs/deploy.md says: the sidecars' Service
            # <fullname>.<namespace>.svc and *.<headless Service>.<namespace>.svc.<clusterDomain>.
            # The sidecars' Service is the one their routes files' doorman.servers name.
            dialled = set()
            for data in configmaps.values():
                for text in data.values():
                    for block in re.findall(r"servers:\s*\[([^\]]*)\]", text):
                        dialled |= {h.strip().strip('"').split(".")[0] for h in block.split(",")}
            sans = []
            for s in services:
                sname, sns = s["metadata"]["name"], ns_of(s, default_ns)
                if s["spec"].get("clusterIP") == "None" and "etcd" not in sname:
                    sans.append(f"*.{sname}.{sns}.svc.{CLUSTER_DOMAIN}")
                elif s["spec"].get("clusterIP") != "None" and sname in dialled:
                    sans.append(f"{sname}.{sns}.svc")
            k, c = make_leaf(work, ca, f"server-{name}", sans)
            log(f"Secret {name}: certificate for {', '.join(sans)}")
            data = {"ca.crt": open(ca[1]).read(), "tls.crt": open(c).read(), "tls.key": open(k).read()}
        for k, v in data.items():
            with open(f"{d}/{k}", "w") as f:
                f.write(v)
            os.chmod(f"{d}/{k}", 0o644)
        os.chmod(d, 0o755)
        secrets[(ns, name)] = data

    if externals:
        start_upstream(ca, work, sorted(externals))
        log(f"local HTTPS upstream for {', '.join(sorted(externals))}")
    if etcd_hosts:
        tls_secret = next((v for (ns, n), v in secrets.items() if "etcd" in n and "tls" in n), None)
        if tls_secret is None:
            fail(f"servers use an etcd outside the manifests ({', '.join(sorted(etcd_hosts))}) without TLS settings")
        keys = re.findall(r"--election-key=(\S+)", all_args) + [k[len("etcd:"):] for k in re.findall(r"--config=(etcd:\S+)", all_args)]
        prefix = os.path.commonprefix(keys).rsplit("/", 1)[0] + "/"
        client = (f"{work}/secret-{pods[0].ns}-{next(n for (_, n) in secrets if 'etcd' in n and 'tls' in n)}/tls.key",
                  f"{work}/secret-{pods[0].ns}-{next(n for (_, n) in secrets if 'etcd' in n and 'tls' in n)}/tls.crt")
        start_external_etcd(work, ca, sorted(etcd_hosts), client, "usher-etcd-pw", prefix)

    # Containers.
    started = []   # (pod, container, start time)
    for p in pods:
        vols = {}
        for v in p.spec.get("volumes") or []:
            d = f"{work}/vol-{p.name}-{v['name']}"
            if "configMap" in v:
                key = (p.ns, v["configMap"]["name"])
                if key not in configmaps:
                    fail(f"{p.name}: ConfigMap {key[1]} is not in the manifests (pass --configmap)")
                os.makedirs(d)
                for k, text in configmaps[key].items():
                    with open(f"{d}/{k}", "w") as f:
                        f.write(text)
                    os.chmod(f"{d}/{k}", 0o644)
                os.chmod(d, 0o755)
            elif "secret" in v:
                d = f"{work}/secret-{p.ns}-{v['secret']['secretName']}"
            elif "emptyDir" in v:
                os.makedirs(d)
                os.chmod(d, 0o777)
            else:
                fail(f"{p.name}: volume {v['name']}: only configMap, secret and emptyDir are supported")
            vols[v["name"]] = d
        for claim in p.claims:
            d = f"{work}/pvc-{p.name}-{claim}"
            os.makedirs(d)
            os.chmod(d, 0o777)
            vols[claim] = d
        pod_sc = p.spec.get("securityContext") or {}
        containers = [c for c in p.spec.get("initContainers", []) if c.get("restartPolicy") == "Always"]
        containers += p.spec.get("containers", [])
        for c in containers:
            image = c["image"].rsplit("/", 1)[-1].split(":")[0]
            if image == "usher" or image.endswith("/usher"):
                argv = [ARGS.bin] + (c.get("args") or [])
            elif image == "etcd":
                argv = ["etcd"] + (c.get("args") or [])
            else:
                log(f"{p.name}/{c['name']}: image {c['image']} is the app, not run; this check plays it")
                continue
            env = env_of(c, p, secrets)
            argv = expand(argv, env)
            sc = {**pod_sc, **(c.get("securityContext") or {})}
            if argv[1:2] == ["proxy"]:
                env["SSL_CERT_FILE"] = ca[1]   # trust the local upstream's throwaway CA
            mounts = " && ".join(f"mkdir -p {m['mountPath']} && mount --bind {vols[m['name']]} {m['mountPath']}"
                                 for m in c.get("volumeMounts") or [])
            user = []
            if "runAsUser" in sc:
                user = ["setpriv", f"--reuid={sc['runAsUser']}", f"--regid={sc.get('runAsGroup', sc['runAsUser'])}",
                        "--clear-groups", "--"]
            cmd = ["nsenter", "-t", str(p.pid), "-n", "--", "unshare", "--mount", "--propagation", "private", "--",
                   "sh", "-c", (mounts + " && " if mounts else "") + 'exec "$@"', "sh", *user, *argv]
            full_env = {"PATH": os.environ["PATH"], "HOME": "/tmp", **env}
            spawn(cmd, f"{work}/logs/{p.name}-{c['name']}.log", env=full_env)
            started.append((p, c, time.monotonic(), argv))
    log(f"{len(started)} containers started")

    # The app's side: one request through each sidecar, from inside its pod.
    budget = 180
    requesters = []
    for p, c, t0, argv in started:
        if argv[1:2] == ["proxy"]:
            routes = yaml.safe_load(open(f"{work}/vol-{p.name}-{next(m['name'] for m in c['volumeMounts'] if m['mountPath'] == '/etc/usher')}/routes.yaml"))
            port = int(str(routes.get("listen", "127.0.0.1:15001")).rsplit(":", 1)[1])
            rt = time.monotonic()
            r = subprocess.Popen(["nsenter", "-t", str(p.pid), "-n", "--", sys.executable, "-c", REQUESTER, str(port), str(budget)],
                                 stdout=subprocess.PIPE, text=True, start_new_session=True)
            PROCS.append(r)
            requesters.append((p, c, t0, rt, r))

    # Probes.
    try:
        for p, c, t0, argv in started:
            what = f"{p.name}/{c['name']}"
            sp = c.get("startupProbe") or {}
            limit = sp.get("failureThreshold", 3) * sp.get("periodSeconds", 10) + 10 if sp else 60
            t = wait_probe(p, c, "startupProbe", limit)
            r = wait_probe(p, c, "readinessProbe", 120)
            lv = wait_probe(p, c, "livenessProbe", 30)
            parts = [f"{n} ok" for n, x in (("startup", t), ("readiness", r), ("liveness", lv)) if x is not None]
            log(f"{what}: {', '.join(parts) or 'no probes'} ({time.monotonic() - t0:.1f} s after start)")
    except SystemExit:
        dump_logs(work)
        raise

    # Leases and the admitted request.
    max_admit = os.environ.get("USHER_MANIFESTS_MAX_ADMIT_S")
    problems = []
    for p, c, t0, rt, r in requesters:
        out, _ = r.communicate(timeout=budget + 30)
        # Every resource of the sidecar leased (polled: during learning mode a lease may lapse briefly).
        t_lease = time.monotonic()
        while True:
            status, body = http_get(p.ip, port_of(c, "usher-admin"), "/debug/status?format=json")
            keys = (json.loads(body).get("lease") or {}).get("keys", []) if status == 200 else []
            modes = {k["resource_id"]: k["mode"] for k in keys}
            if keys and all(m == "leased" for m in modes.values()):
                break
            if time.monotonic() - t_lease > 60:
                problems.append(f"{p.name}: not every resource is leased: {modes or body[:300]}")
                break
            time.sleep(0.5)
        if not out.startswith("ADMITTED"):
            problems.append(f"{p.name}: no request was admitted within {budget} s: {out.strip()}")
            continue
        took = float(out.split()[1])
        took_from_start = took + (rt - t0)
        log(f"{p.name}: leases {modes}; first admitted request {took_from_start:.1f} s after the sidecar started "
            f"(answers before it: {' '.join(out.split()[2:])})")
        if max_admit and took_from_start > float(max_admit):
            problems.append(f"{p.name}: first admitted request after {took_from_start:.1f} s > USHER_MANIFESTS_MAX_ADMIT_S={max_admit}")
    if problems:
        dump_logs(work)
        fail("; ".join(problems))
    stop_all(15)
    time.sleep(0.5)
    stop_all(9)
    shutil.rmtree(work, ignore_errors=True)
    log("passed")


def dump_logs(work):
    for f in sorted(os.listdir(f"{work}/logs")):
        text = re.sub(r"\x1b\[[0-9;]*m", "", open(f"{work}/logs/{f}").read()).splitlines()
        print(f"---- {f} (last 15 lines)")
        print("\n".join(text[-15:]))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--namespace", default="default", help="namespace of objects that name none (helm template --namespace)")
    ap.add_argument("--configmap", action="append", default=[], help="NAME=FILE: a ConfigMap the manifests use but do not define")
    ap.add_argument("manifests", nargs="+")
    ARGS = ap.parse_args()
    ARGS.bin = os.path.abspath(ARGS.bin)
    if os.environ.get("USHER_MANIFESTS_INNER") != "1":
        # A network and mount namespace of our own: the bridge, the pods and /etc/hosts live there.
        os.environ["USHER_MANIFESTS_INNER"] = "1"
        os.execvp("unshare", ["unshare", "--mount", "--net", "--propagation", "private", "--", sys.executable, *sys.argv])
    main()
