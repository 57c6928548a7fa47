"""Headless Chromium for the tests of the gateway's pages (`/status`, `/chat`): finding (or installing) the browser,
rendering a page's DOM, and driving a page through the DevTools protocol.

`ensure_chromium()` returns the browser's path. When none is installed and the tests run as root on a Debian-like
machine (CI on a clean clone), it installs Debian's `chromium` with apt-get, once per test session; otherwise (not
root, no apt-get, apt failed) the test is skipped with the reason.

`Page` drives one tab over `--remote-debugging-pipe` (the DevTools protocol as NUL-separated JSON on file
descriptors 3 and 4: no port, no websocket library): evaluate JavaScript, type text, click an element, wait for a
condition, take a screenshot.
"""
from __future__ import annotations

import base64
import fcntl
import json
import os
import queue
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest

NAMES = ("chromium", "chromium-browser", "google-chrome", "chrome")
APT_TIMEOUT = 900  # seconds for `apt-get update` and for `apt-get install` each
_install: Dict[str, Any] = {}  # the outcome of this session's one installation attempt: {"error": str | None}


def find_chromium() -> Optional[str]:
    for name in NAMES:
        path = shutil.which(name)
        if path:
            return path
    return None


def _apt(*args: str) -> None:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    # another apt (a second test run, the machine's own updates) holding the lock: wait for it rather than fail
    command = ["apt-get", "-q", "-o", "DPkg::Lock::Timeout=300", *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=APT_TIMEOUT, env=env)
    if result.returncode != 0:
        tail = (result.stderr.strip() or result.stdout.strip()).splitlines()[-3:]
        raise RuntimeError(f"`{' '.join(command)}` exited with {result.returncode}: {' | '.join(tail)}")


def install_chromium() -> Optional[str]:
    """Install Debian's `chromium` (apt-get update, then install). None when done, else why it was not."""
    if os.name != "posix" or os.geteuid() != 0:
        return "not running as root, so the tests do not install it"
    if shutil.which("apt-get") is None:
        return "no apt-get on this machine to install it with"
    try:
        _apt("update")
        _apt("install", "-y", "--no-install-recommends", "chromium")
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        return f"apt-get failed: {e}"
    return None if find_chromium() else "apt-get installed chromium but no browser is on PATH"


def ensure_chromium() -> str:
    """The browser's path, installed first if missing and possible (once per session); else the test is skipped."""
    path = find_chromium()
    if path is not None:
        return path
    if "error" not in _install:
        _install["error"] = install_chromium()
    path = find_chromium()
    if path is None:
        pytest.skip(f"no Chromium found and {_install['error'] or 'none was installed'} "
                    "(apt-get install chromium): the page is not tested in a browser")
    return path


def render(url: str, screenshot: Optional[Path] = None, window: str = "1280,560") -> str:
    """The DOM of `url` after its scripts ran, from headless Chromium (and a screenshot if asked)."""
    browser = ensure_chromium()
    base = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--virtual-time-budget=6000",
            f"--window-size={window}"]
    if screenshot is not None:
        subprocess.run([*base, f"--screenshot={screenshot}", url], capture_output=True, timeout=120, check=True)
    result = subprocess.run([*base, "--dump-dom", url], capture_output=True, timeout=120, text=True, check=True)
    return result.stdout


def _high(fd: int) -> int:
    """`fd` moved to a descriptor >= 10 (close-on-exec), out of the way of the 3 and 4 a child's dup2 sets."""
    moved = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
    os.close(fd)
    return moved


class PageError(AssertionError):
    pass


class Page:
    """One headless Chromium tab at `url`, driven through the DevTools protocol over a pipe (use as a context
    manager: the browser is stopped on exit)."""

    def __init__(self, url: str, width: int = 1100, height: int = 760):
        browser = ensure_chromium()
        self._profile = tempfile.mkdtemp(prefix="swarmgate-chromium-")
        # the child's ends moved above the low descriptors that the child's dup2 calls below overwrite
        to_browser_r, self._to_browser = map(_high, os.pipe())
        self._from_browser, from_browser_w = map(_high, os.pipe())

        def child_fds():  # the browser reads commands on fd 3 and writes replies on fd 4
            os.dup2(to_browser_r, 3)
            os.dup2(from_browser_w, 4)

        self.proc = subprocess.Popen(
            [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--remote-debugging-pipe",
             f"--user-data-dir={self._profile}", "--no-first-run", f"--window-size={width},{height}", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, pass_fds=(3, 4),
            preexec_fn=child_fds)
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._ids = iter(range(1, 1 << 30))
        self._replies: "queue.Queue[dict]" = queue.Queue()
        self.events: List[dict] = []
        threading.Thread(target=self._read, name="chromium-pipe", daemon=True).start()
        try:
            target = self.send("Target.createTarget", {"url": "about:blank"}, session=False)["targetId"]
            self._session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True},
                                      session=False)["sessionId"]
            self.send("Page.enable")
            self.send("Runtime.enable")
            self.send("Emulation.setDeviceMetricsOverride", {"width": width, "height": height,
                                                             "deviceScaleFactor": 1, "mobile": False})
            self.goto(url)
        except BaseException:
            self.close()
            raise

    def _read(self) -> None:
        buffer = b""
        with os.fdopen(self._from_browser, "rb", buffering=0) as pipe:
            while True:
                data = pipe.read(1 << 16)
                if not data:
                    return
                buffer += data
                while b"\0" in buffer:
                    raw, buffer = buffer.split(b"\0", 1)
                    self._replies.put(json.loads(raw))

    def send(self, method: str, params: Optional[dict] = None, session: bool = True, timeout: float = 60) -> dict:
        """One DevTools command (on the tab's session unless `session=False`); its result, or PageError."""
        message: Dict[str, Any] = {"id": next(self._ids), "method": method, "params": params or {}}
        if session:
            message["sessionId"] = self._session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            try:
                reply = self._replies.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise PageError(f"no answer to {method} within {timeout:g}s") from None
            if reply.get("id") == message["id"]:
                if "error" in reply:
                    raise PageError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            if "method" in reply:
                self.events.append(reply)

    def goto(self, url: str) -> None:
        self.send("Page.navigate", {"url": url})
        # (the final address may differ: a redirect)
        self.wait_for("document.readyState === 'complete' && location.href !== 'about:blank'", timeout=60)

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (promises awaited); a thrown error is a PageError."""
        result = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                                "awaitPromise": True})
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            raise PageError(f"{expression[:200]}: {details.get('exception', {}).get('description') or details}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 120, interval: float = 0.1) -> Any:
        """Poll `expression` until it is truthy; its value. PageError after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise PageError(f"still false after {timeout:g}s: {expression}")
            time.sleep(interval)

    def click(self, selector: str) -> None:
        """A real mouse click (press and release) at the middle of the element `selector`."""
        box = self.evaluate(f"(() => {{ const r = document.querySelector({json.dumps(selector)})"
                            ".getBoundingClientRect(); return [r.x + r.width / 2, r.y + r.height / 2]; })()")
        for kind in ("mousePressed", "mouseReleased"):
            self.send("Input.dispatchMouseEvent", {"type": kind, "x": box[0], "y": box[1], "button": "left",
                                                   "clickCount": 1})

    def type(self, selector: str, text: str) -> None:
        """Focus the element `selector` and type `text` into it (as an IME commit: input events fire)."""
        self.evaluate(f"document.querySelector({json.dumps(selector)}).focus()")
        self.send("Input.insertText", {"text": text})

    def screenshot(self, path: Path) -> None:
        data = self.send("Page.captureScreenshot", {"format": "png"})["data"]
        Path(path).write_bytes(base64.b64decode(data))

    def close(self) -> None:
        try:
            os.close(self._to_browser)
        except OSError:
            pass
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        shutil.rmtree(self._profile, ignore_errors=True)

    def __enter__(self) -> "Page":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


if __name__ == "__main__":  # `make test`: install the browser before the suite (never fails the run)
    found = find_chromium()
    problem = None if found else install_chromium()
    print(f"browser tests: {find_chromium() or 'skipped, no Chromium: ' + str(problem)}")
