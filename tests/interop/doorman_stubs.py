"""Doorman's ORIGINAL schema for the interop scripts, compiled at run time.

The stubs are generated from doorman_original.proto (vendored unmodified, see
README.md) into a temporary directory that is removed when the script exits,
so nothing generated is ever committed and usher's own proto plays no part.
"""

import atexit
import os
import shutil
import sys
import tempfile

PIP_HINT = "python3 -m pip install grpcio==1.85.1 grpcio-tools==1.85.1 protobuf==7.36.2"

try:
    import grpc  # noqa: F401
    from grpc_tools import protoc
    from google.protobuf import unknown_fields
except ImportError as e:  # the Rust test names the same command
    sys.stderr.write(f"interop: {e}; install the gRPC tools: {PIP_HINT}\n")
    sys.exit(3)

HERE = os.path.dirname(os.path.abspath(__file__))
PROTO = "doorman_original.proto"


def load():
    """Compiles the original proto and returns its (messages, services) modules."""
    out = tempfile.mkdtemp(prefix="doorman-original-")
    atexit.register(shutil.rmtree, out, True)
    include = os.path.join(os.path.dirname(protoc.__file__), "_proto")
    rc = protoc.main(["protoc", f"-I{HERE}", f"-I{include}", f"--python_out={out}", f"--grpc_python_out={out}", PROTO])
    if rc != 0:
        sys.exit(f"interop: protoc failed on {PROTO} ({rc})")
    sys.path.insert(0, out)
    import doorman_original_pb2 as pb
    import doorman_original_pb2_grpc as pb_grpc

    return pb, pb_grpc


def unknown(msg, found=None):
    """Field numbers this schema does not know, anywhere in `msg`: {message type: sorted numbers}.

    They were skipped when the message was parsed, as Doorman's Go code skips them.
    """
    found = {} if found is None else found
    nums = {f.field_number for f in unknown_fields.UnknownFieldSet(msg)}
    if nums:
        name = msg.DESCRIPTOR.name
        found[name] = sorted(set(found.get(name, [])) | nums)
    for field, value in msg.ListFields():
        if field.message_type is None:
            continue
        for v in [value] if hasattr(value, "DESCRIPTOR") else value:  # one message, or repeated
            unknown(v, found)
    return found


def missing_required(msg):
    """The required fields `msg` lacks (Go's proto.Unmarshal refuses such a message)."""
    return msg.FindInitializationErrors()
