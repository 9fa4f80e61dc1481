"""Builds the amaxd client; the protobuf module is generated at build time
from ../../proto (it is never committed)."""
import os
import shutil
import tempfile

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
PROTO_ROOT = os.path.normpath(os.path.join(HERE, "..", "..", "proto"))


class BuildWithProto(build_py):
    def run(self):
        super().run()
        from grpc_tools import protoc  # build requirement

        out = os.path.join(self.build_lib, "amaxd", "_gen")
        os.makedirs(out, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            src = os.path.join(PROTO_ROOT, "amaxd", "v1", "amaxd.proto")
            # The .pyi stub gives type checkers the messages' fields (py.typed).
            rc = protoc.main(["protoc", f"-I{PROTO_ROOT}", f"--python_out={tmp}",
                              f"--pyi_out={tmp}", src])
            if rc != 0:
                raise RuntimeError(f"protoc failed on {src}")
            for name in ("amaxd_pb2.py", "amaxd_pb2.pyi"):
                shutil.copy(os.path.join(tmp, "amaxd", "v1", name), out)
        with open(os.path.join(out, "__init__.py"), "w") as f:
            f.write("# Generated at build time from proto/amaxd/v1/amaxd.proto.\n")


setup(cmdclass={"build_py": BuildWithProto})
