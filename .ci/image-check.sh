#!/usr/bin/env bash
# The image check, without a Docker engine (there is none here):
#
#   bash .ci/image-check.sh
#
# 1. makes a scratch copy of exactly the build context that `docker build .`
#    would send (the repository's files filtered by .dockerignore);
# 2. runs the Dockerfile's builder stage on it, instruction by instruction as
#    the Dockerfile writes them (WORKDIR, COPY, ENV, RUN with its BuildKit cache
#    mounts), with the host's toolchain: a file the build needs but the context
#    lacks, or a step that no longer works, fails here as it would in Docker;
# 3. runs the binary that the runtime stage copies: `--version` and a short
#    `usher demo`;
# 4. checks that it links only libraries that the runtime base image
#    (distroless cc-debian12: glibc and libgcc_s) has, with ldd.
#
# Environment:
#   USHER_CI_CACHE   cache root (default ~/.cache/usher-ci): the scratch copy,
#                    and $USHER_CI_CACHE/image-target plays the builder's
#                    `target` cache mount, so a later run compiles only usher
#                    itself, as a warm BuildKit cache would
set -euo pipefail
cd "$(dirname "$0")/.."

CACHE="${USHER_CI_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/usher-ci}"
mkdir -p "$CACHE"
exec python3 - "$CACHE" <<'EOF'
import os, re, shlex, shutil, subprocess, sys, time

cache = sys.argv[1]
# Libraries of distroless cc-debian12 (libc6 and libgcc-s1) that a Rust binary may link.
ALLOWED = {
    "linux-vdso.so.1", "libc.so.6", "libm.so.6", "libgcc_s.so.1", "libpthread.so.0",
    "libdl.so.2", "librt.so.1", "ld-linux-x86-64.so.2", "ld-linux-aarch64.so.1",
}

def fail(msg):
    sys.exit(f"FAIL: {msg}")

# ---- the build context: git's files through .dockerignore -------------------
def glob_re(pat):
    out, i = "", 0
    while i < len(pat):
        if pat.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pat[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pat[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pat[i]), i + 1
    return re.compile(out + r"\Z")

rules = []
for line in open(".dockerignore"):
    line = line.strip()
    if not line or line.startswith("#"):
        continue
    neg = line.startswith("!")
    pat = os.path.normpath(line[1:] if neg else line).lstrip("/")
    rules.append((glob_re(pat), neg))

def in_context(path):
    # Docker: the last rule matching the path or one of its parents decides.
    parts = path.split("/")
    keep = True
    for rx, neg in rules:
        if any(rx.match("/".join(parts[:n])) for n in range(1, len(parts) + 1)):
            keep = neg
    return keep

files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                       check=True, capture_output=True).stdout.decode().split("\0")
files = [f for f in files if f and os.path.isfile(f) and in_context(f)]
root = os.path.join(cache, "image-check")   # a fixed path: cargo's fingerprints stay valid
shutil.rmtree(root, ignore_errors=True)
context = os.path.join(root, "context")
for f in files:
    os.makedirs(os.path.join(context, os.path.dirname(f)), exist_ok=True)
    shutil.copy2(f, os.path.join(context, f))
print(f"== build context: {len(files)} files let in by .dockerignore")

# ---- the Dockerfile's stages ---------------------------------------------------
lines, cur = [], ""
for raw in open("Dockerfile"):
    s = raw.rstrip("\n")
    if not cur and (not s.strip() or s.lstrip().startswith("#")):
        continue
    if s.lstrip().startswith("#"):
        continue  # a comment inside a continued instruction
    if s.endswith("\\"):
        cur += s[:-1] + " "
        continue
    lines.append((cur + s).strip())
    cur = ""
stages, args = {}, {}
name = None
for l in lines:
    op, _, rest = l.partition(" ")
    op = op.upper()
    if op == "ARG" and name is None:
        k, _, v = rest.partition("=")
        args[k] = v
    elif op == "FROM":
        m = re.search(r"\bAS\s+(\S+)", rest, re.I)
        name = m.group(1) if m else f"stage{len(stages)}"
        stages[name] = [("FROM", rest)]
    elif name is not None:
        stages[name].append((op, rest))
if "build" not in stages:
    fail("the Dockerfile has no stage named `build`")

fs = os.path.join(root, "fs")   # the builder's filesystem root
def host(path, workdir):
    return os.path.join(fs, os.path.normpath(os.path.join(workdir, path)).lstrip("/"))

env = dict(os.environ)
workdir = "/"
started = time.monotonic()
for op, rest in stages["build"][1:]:
    if op == "WORKDIR":
        workdir = os.path.normpath(os.path.join(workdir, rest))
        os.makedirs(host(".", workdir), exist_ok=True)
    elif op == "ENV":
        for part in shlex.split(rest):
            k, _, v = part.partition("=")
            env[k] = v
    elif op == "ARG":
        k, _, v = rest.partition("=")
        env.setdefault(k, v)
    elif op == "COPY":
        words = [w for w in rest.split() if not w.startswith("--")]
        *srcs, dst = words
        for src in srcs:
            s = os.path.join(context, src)
            if not os.path.exists(s):
                fail(f"COPY {src}: not in the build context (.dockerignore or a missing file)")
            d = host(dst, workdir)
            if os.path.isdir(s):
                shutil.copytree(s, d, dirs_exist_ok=True)
            else:
                if dst.endswith("/"):
                    d = os.path.join(d, os.path.basename(src))
                os.makedirs(os.path.dirname(d), exist_ok=True)
                shutil.copy2(s, d)
        print(f"  COPY {' '.join(srcs)} -> {dst}")
    elif op == "RUN":
        cmd = rest
        while cmd.startswith("--"):
            flag, _, cmd = cmd.partition(" ")
            cmd = cmd.lstrip()
            m = re.fullmatch(r"--mount=(.*)", flag)
            if not m:
                fail(f"RUN flag {flag} is not understood by this check")
            opts = dict(o.partition("=")[::2] for o in m.group(1).split(","))
            target = opts.get("target", "")
            if opts.get("type") != "cache":
                fail(f"RUN --mount type {opts.get('type')} is not understood by this check")
            if target.startswith("/usr/local/cargo/"):
                continue  # the host's own CARGO_HOME plays the cargo registry cache
            if not target.startswith(workdir + "/"):
                fail(f"cache mount {target}: only mounts under WORKDIR or /usr/local/cargo are understood")
            # A target directory of its own, never the repository's: cargo fingerprints a
            # package by its path relative to the workspace, so in a shared target dir the
            # repository's build would pass for the scratch copy's and nothing would be
            # built from the copy at all.
            keep = os.path.join(cache, "image-" + os.path.basename(target))
            os.makedirs(keep, exist_ok=True)
            link = host(target, "/")
            os.makedirs(os.path.dirname(link), exist_ok=True)
            os.symlink(keep, link)
        print(f"  RUN {cmd}", flush=True)
        t = time.monotonic()
        r = subprocess.run(["bash", "-ec", cmd], cwd=host(".", workdir), env=env)
        if r.returncode != 0:
            fail(f"RUN {cmd}: exit {r.returncode}")
        print(f"  ... done in {time.monotonic() - t:.0f} s")
print(f"== builder stage ran through in {time.monotonic() - started:.0f} s")

# ---- the runtime stage's binary ----------------------------------------------------
copy = next((rest for stage in stages.values() for op, rest in stage
             if op == "COPY" and "--from=build" in rest), None)
if copy is None:
    fail("no COPY --from=build in the runtime stage")
src = [w for w in copy.split() if not w.startswith("--")][0]
binary = host(src, "/")
if not os.access(binary, os.X_OK):
    fail(f"COPY --from=build {src}: the builder stage left no executable there")
def run(*a, timeout=60):
    r = subprocess.run([binary, *a], capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        fail(f"usher {' '.join(a)}: exit {r.returncode}\n{r.stderr}")
    return r.stdout
print(f"== the binary ({src}): {run('--version').strip()}")
out = run("demo", "--duration", "2s", "--quiet", timeout=120)
print("  usher demo --duration 2s --quiet: ok" + (f" ({out.strip().splitlines()[-1]})" if out.strip() else ""))

ldd = subprocess.run(["ldd", binary], capture_output=True, text=True).stdout
libs = sorted({os.path.basename(l.split()[0]) for l in ldd.splitlines() if l.strip()})
extra = [l for l in libs if l not in ALLOWED]
if extra:
    fail(f"the binary links {extra}, which distroless cc-debian12 does not have:\n{ldd}")
print(f"== ldd: links only {', '.join(libs)} (all in distroless cc-debian12)")
EOF
