"""`ServerProcess`: `python -m kvsession serve` as a child process, for tests, benchmarks and
examples. It starts on port 0 and reads the address the server prints (no race for a free
port); every wait is bounded."""

from __future__ import annotations

import contextlib
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from kvsession.serve.listen import LISTENING


class ServerProcess:
    """A server subprocess on `model`; `url` (http://host:port) once it listens. stderr goes
    to `stderr_path` (or is inherited); stdout lines after the address are echoed when
    `echo`. `stop()` sends SIGTERM and returns the exit status."""

    def __init__(self, model, *args: str, stderr_path: Path | None = None,
                 start_timeout_s: float = 120.0, echo: bool = False):
        self.stderr_path = Path(stderr_path) if stderr_path else None
        self._stderr = open(self.stderr_path, "w") if self.stderr_path else None
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvsession", "serve", "--model", str(model), "--port", "0",
             *args], stdout=subprocess.PIPE, stderr=self._stderr, text=True)
        self._lines: queue.Queue = queue.Queue()
        self._echo = echo
        threading.Thread(target=self._read, daemon=True, name="kvsession-serve-stdout").start()
        m = self.wait_for(rf"{re.escape(LISTENING)} (http://\S+)", start_timeout_s)
        self.url = m.group(1)

    def _read(self) -> None:
        for line in self.proc.stdout:
            if self._echo:
                print(f"[server] {line.rstrip()}", flush=True)
            self._lines.put(line)
        self._lines.put(None)

    def stderr_tail(self, chars: int = 3000) -> str:
        if self.stderr_path is None or not self.stderr_path.is_file():
            return ""
        return self.stderr_path.read_text()[-chars:]

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        """The first stdout line matching `pattern` within `timeout` seconds; if none,
        the server is stopped and RuntimeError says why (with its stderr)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                line = self._lines.get(timeout=max(0.01, left)) if left > 0 else None
            except queue.Empty:
                line = None
            if line is None:
                with contextlib.suppress(subprocess.TimeoutExpired):  # killed: say why
                    self.stop(timeout=10)
                raise RuntimeError(f"no line matching {pattern!r} from the server (exit "
                                   f"status {self.proc.poll()}); stderr:\n{self.stderr_tail()}")
            if m := re.search(pattern, line):
                return m

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, then wait up to `timeout` s for the exit status (killed past it)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
            raise
        finally:
            if self._stderr is not None:
                self._stderr.close()
