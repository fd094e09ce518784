"""The Python sandbox: output and failures come back as results; each way out of it (files outside its
directory, the network, the host's CPU, memory and process table, a flood of output) ends in ok=False
within its time limit, and the next call still works; its directory is gone afterwards."""

import os
import socket
import sys
import tempfile
import time

import pytest

from moejax.rl.tools import ToolResult, run_python, sandbox

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the sandbox is made of Linux namespaces")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MARGIN_S = 2.0  # setup, the kill, and a loaded 2-core machine


def _timed(code, **kwargs):
  start = time.monotonic()
  result = run_python(code, **kwargs)
  elapsed = time.monotonic() - start
  assert isinstance(result, ToolResult)
  assert elapsed < kwargs.get("timeout_s", 5.0) + MARGIN_S, (elapsed, result)
  return result


def _still_works():
  assert run_python("print('still fine')") == ToolResult(True, "still fine\n")


def test_prints():
  assert _timed("print('hello', 6 * 7)") == ToolResult(True, "hello 42\n")


def test_stdout_and_stderr_both_come_back():
  result = _timed("import sys\nprint('to out', flush=True)\nprint('to err', file=sys.stderr)")
  assert result == ToolResult(True, "to out\nto err\n")


@pytest.mark.parametrize("code,expected", [
  ("def f():\n  raise ValueError('boom')\nf()", ["Traceback", 'line 2, in f', "ValueError: boom",
                                                 "[exit status 1]"]),
  ("import sys; print('partial'); sys.exit(3)", ["partial", "[exit status 3]"]),
  ("print('unclosed'", ["SyntaxError"]),
  ("x = '\ud800'", ["SyntaxError"]),  # a lone surrogate: not valid UTF-8 source
  ("input()", ["EOFError"]),  # stdin is empty
])
def test_failures_are_results(code, expected):
  result = _timed(code)
  assert not result.ok
  for text in expected:
    assert text in result.output, result.output


ESCAPES = {
  "read /etc/hostname": ("print(open('/etc/hostname').read())", "No such file or directory"),
  "read the repository": (f"print(open({os.path.abspath(__file__)!r}).read())", "No such file or directory"),
  "list the host root": ("import os; print(os.listdir('/.oldroot'))\nopen('/home')", "No such file"),
  "connect outside": ("import socket; socket.create_connection(('1.1.1.1', 53), timeout=1)",
                      "Network is unreachable"),
  "resolve a name": ("import socket; socket.getaddrinfo('example.com', 80)", "name resolution"),
  "write the repository": (f"open({os.path.join(REPO, 'sandbox-escape.txt')!r}, 'w').write('x')",
                           "No such file or directory"),
  "write /tmp": ("open('/tmp/sandbox-escape.txt', 'w').write('x')", "No such file or directory"),
  "write its root": ("open('/escape.txt', 'w').write('x')", "Read-only file system"),
  "write the interpreter": (f"open({sys.base_prefix + '/escape.txt'!r}, 'w').write('x')",
                            "Read-only file system"),
  "remount read-write": ("import subprocess, sys\nr = subprocess.run(['mount', '-o', 'remount,rw', '/usr'])\n"
                         "sys.exit(r.returncode)", "permission denied"),
  "user namespace": ("import os; os.unshare(os.CLONE_NEWUSER)", "No space left on device"),
  "infinite loop": ("while True: pass", "[killed: wall time limit 1.5 s]"),
  "memory hog": ("chunks = []\nwhile True: chunks.append(bytearray(1 << 24))", "MemoryError"),
  "fork storm": ("import os\nwhile True:\n  try:\n    os.fork()\n  except OSError:\n    pass",
                 "[killed: wall time limit 1.5 s]"),
  "100 MB print": ("for _ in range(100): print('x' * 1_000_000)", "[killed: output limit 4096 bytes]"),
  "cpu time": ("import resource\nresource.setrlimit(resource.RLIMIT_CPU, (1, 2))\nwhile True: pass",
               "[killed: cpu time limit"),
}


@pytest.mark.parametrize("name", list(ESCAPES))
def test_escapes_fail_in_bounded_time(name):
  code, expected = ESCAPES[name]
  result = _timed(code, timeout_s=1.5 if name != "cpu time" else 4.0)
  assert not result.ok
  assert expected in result.output, result.output
  assert len(result.output) <= 4096 + 100
  assert not os.path.exists(os.path.join(REPO, "sandbox-escape.txt"))
  assert not os.path.exists("/tmp/sandbox-escape.txt")
  _still_works()


def test_processes_are_bounded():
  code = ("import os, time\nn = 0\ntry:\n  while True:\n    if os.fork() == 0:\n      time.sleep(60)\n"
          "    n += 1\nexcept OSError as e:\n  print(n, e.errno)")
  result = _timed(code, timeout_s=3.0)  # the sleeping children die with the sandbox's init
  n, errno = map(int, result.output.split())
  assert result.ok and 0 < n < sandbox.MAX_TASKS and errno == 11, result
  _still_works()


def test_no_connection_to_a_server_on_the_host():
  with socket.socket() as server:
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.setblocking(False)
    port = server.getsockname()[1]
    result = _timed(f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=1)",
                    timeout_s=2.0)
    assert not result.ok and "Network is unreachable" in result.output, result.output
    with pytest.raises(BlockingIOError):  # nothing ever reached it
      server.accept()
  _still_works()


def test_files_are_given_and_writable():
  code = ("import os\nprint(open('data/in.txt').read(), open('top.txt').read())\n"
          "open('data/in.txt', 'a').write('!')\nopen('new.txt', 'w').write('n')\nprint(sorted(os.listdir()))")
  result = _timed(code, files={"data/in.txt": "hello", "top.txt": "top"})
  assert result == ToolResult(True, "hello top\n['data', 'new.txt', 'top.txt']\n")


@pytest.mark.parametrize("code", [
  "open('left.txt', 'w').write('x')",
  "import os\nos.makedirs('a/b')\nopen('a/b/f', 'w').write('x')\nos.chmod('a/b', 0o500)\nos.chmod('a', 0)",
  "import os\nopen('f', 'w').write('x')\nif os.fork() == 0:\n  os.setsid()\n  while True:\n"
  "    open('f', 'w').write('x')\nwhile True: pass",
])
def test_directory_is_removed(code, tmp_path, monkeypatch):
  monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
  _timed(code, timeout_s=1.0)
  assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("kwargs,match", [
  (dict(code=b"print(1)"), "code must be a str"),
  (dict(code=None), "code must be a str"),
  (dict(code="", timeout_s=0), "timeout_s"),
  (dict(code="", timeout_s=-1.0), "timeout_s"),
  (dict(code="", timeout_s=float("nan")), "timeout_s"),
  (dict(code="", timeout_s="5"), "timeout_s"),
  (dict(code="", memory_mb=0), "memory_mb"),
  (dict(code="", memory_mb=256.0), "memory_mb"),
  (dict(code="", output_limit=0), "output_limit"),
  (dict(code="", files=["a.txt"]), "files must be a dict"),
  (dict(code="", files={"/etc/passwd": "x"}), "relative paths"),
  (dict(code="", files={"../up.txt": "x"}), "relative paths"),
  (dict(code="", files={"a.txt": b"x"}), "must be a str"),
  (dict(code="", files={"a": "x", "a/b.txt": "y"}), "inside another file"),
])
def test_bad_arguments(kwargs, match):
  with pytest.raises(ValueError, match=match):
    run_python(**kwargs)


def test_missing_tools_are_named(monkeypatch, tmp_path):
  monkeypatch.setattr(sandbox, "_PATH", str(tmp_path))
  with pytest.raises(RuntimeError, match="missing: sh, unshare"):
    run_python("print(1)")


def test_setup_failure_raises_until_a_sandbox_has_worked(monkeypatch):
  monkeypatch.setattr(sandbox, "_DEVICES", sandbox._DEVICES + ("no-such-device",))
  monkeypatch.setattr(sandbox, "_working", False)
  with pytest.raises(RuntimeError, match="could not make the Python sandbox here.*no-such-device"):
    run_python("print(1)")
  monkeypatch.setattr(sandbox, "_working", True)
  result = run_python("print(1)")
  assert not result.ok and result.output.endswith("[sandbox setup failed]"), result
