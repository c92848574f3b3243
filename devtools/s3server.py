"""A throwaway S3-compatible server (versitygw, built by the bootstrap) for the tests, the demo and the bench."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from devtools.servers import BOOTSTRAP_HINT, ServerError, end_process, free_port, wait_port


def versitygw_binary() -> Path:
    """The S3 gateway the bootstrap builds into the project's tool directory (.tools/bin)."""
    path = Path(__file__).resolve().parent.parent / ".tools" / "bin" / "versitygw"
    if not path.is_file():
        raise ServerError(f"the S3 server versitygw ({path}) not found: {BOOTSTRAP_HINT}")
    return path


@dataclass
class S3Server:
    """A real S3-compatible server (versitygw, posix backend) in a temporary directory on a free 127.0.0.1 port.

    Each bucket is a directory under ``root/data``; the root user's keys are ``access_key``/``secret_key``.
    Clients use path-style addressing against ``endpoint``. It honours ``If-None-Match: *`` on PUT (a
    conditional create), which the landing zone's manifests rely on.
    """

    access_key: str = "cdcd-test-access"
    secret_key: str = "cdcd-test-secret-key"
    region: str = "us-east-1"
    root: Path = field(init=False)
    port: int = field(init=False)
    proc: subprocess.Popen[bytes] | None = field(init=False, default=None)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60) -> S3Server:
        binary_path = versitygw_binary()
        self.root = Path(tempfile.mkdtemp(prefix="cdcd-s3-"))
        (self.root / "data").mkdir()
        self.port = free_port()
        log = self.root / "versitygw.log"
        # the keys go in the environment, not the command line (ps shows the command line)
        env = {**os.environ, "ROOT_ACCESS_KEY_ID": self.access_key, "ROOT_SECRET_ACCESS_KEY": self.secret_key}
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                [str(binary_path), "--port", f"127.0.0.1:{self.port}", "--region", self.region, "--quiet",
                 "posix", str(self.root / "data")],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        try:
            wait_port(self.port, self.proc, log, timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def create_bucket(self, name: str) -> str:
        """A new empty bucket (a directory of the posix backend, as the gateway's CreateBucket makes it)."""
        bucket = self.root / "data" / name
        bucket.mkdir()
        return name

    def bucket_dir(self, name: str) -> Path:
        """Where the bucket's objects are on disk: tests may look, or break things, behind the server's back."""
        return self.root / "data" / name

    def stop(self) -> None:
        end_process(self.proc, 20)
        shutil.rmtree(self.root, ignore_errors=True)
