"""The Python tool: runs untrusted code in a throwaway sandbox and returns what it printed.

The code runs under this interpreter's real install (not the venv) in new user, mount, network and PID
namespaces made by util-linux's `unshare`, pivoted into a read-only root of read-only binds (/usr, /lib*,
the interpreter's prefix) with a fresh temporary directory at /sandbox, its cwd and only writable place;
with no capabilities, and rlimits on CPU time, address space, tasks, file size and open files.
docs/rl_sandbox.md says what this guards and what it does not.
"""

import math
import os
import selectors
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from moejax.rl.tools.result import ToolResult

MAX_TASKS = 32  # processes and threads the code may have at once (RLIMIT_NPROC, the sandbox's init too)
MAX_FILE_MB = 64  # the largest file it may write (RLIMIT_FSIZE)
MAX_OPEN_FILES = 256

_PATH = "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"
_ENV = {"PATH": _PATH, "LANG": "C.UTF-8", "HOME": "/sandbox", "TMPDIR": "/sandbox"}
_TOOLS = ("sh", "unshare", "setpriv", "prlimit", "timeout", "mount", "umount", "pivot_root", "cp")
_DEVICES = ("null", "zero", "random", "urandom")
# RLIMIT_NPROC does not bind processes whose host uid is 0, whatever namespace they are in: a root caller's
# sandbox runs as this host uid instead.
_ROOT_CALLER_UID = 65534
_READY = b"\x1emoejax-sandbox-ready\x1e"  # printed by the sandbox's init once set up, before the code runs
_KILL_GRACE_S = 0.5
_working = False  # set once a sandbox has come up: later setup failures are results, not RuntimeErrors


def run_python(code: str, *, timeout_s: float = 5.0, memory_mb: int = 256, output_limit: int = 4096,
               files: dict[str, str] | None = None) -> ToolResult:
  """Runs code as a script in a fresh sandbox; ok when it exits with status 0 within its limits.

  output: its stdout and stderr together, cut to output_limit bytes, then a line such as
  "[killed: wall time limit 5.0 s]" or "[exit status 1]" when not ok. files: name -> text, written into
  its directory (relative paths, subdirectories allowed) before it starts. Raises ValueError for bad
  arguments, and RuntimeError when this machine cannot make the sandbox (never runs the code unsandboxed).
  """
  _check_args(code, timeout_s, memory_mb, output_limit, files)
  missing = [t for t in _TOOLS if shutil.which(t, path=_PATH) is None]
  if missing:
    raise RuntimeError(f"the Python sandbox needs util-linux, coreutils and a POSIX shell; missing: "
                       f"{', '.join(missing)}")
  tmp = tempfile.mkdtemp(prefix="moejax-sandbox-")
  try:
    return _run(code, timeout_s, memory_mb, output_limit, files or {}, tmp)
  finally:
    _remove(tmp)


def _check_args(code, timeout_s, memory_mb, output_limit, files):
  if not isinstance(code, str):
    raise ValueError(f"code must be a str, got {type(code).__name__}")
  if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < 3600:
    raise ValueError(f"timeout_s must be a number of seconds in (0, 3600), got {timeout_s!r}")
  if isinstance(memory_mb, bool) or not isinstance(memory_mb, int) or not 32 <= memory_mb <= 1 << 20:
    raise ValueError(f"memory_mb must be an integer >= 32 (the interpreter needs some), got {memory_mb!r}")
  if isinstance(output_limit, bool) or not isinstance(output_limit, int) or output_limit < 1:
    raise ValueError(f"output_limit must be a positive integer (bytes), got {output_limit!r}")
  if files is None:
    return
  if not isinstance(files, dict):
    raise ValueError(f"files must be a dict of name -> text, got {type(files).__name__}")
  for name, text in files.items():
    parts = name.split("/") if isinstance(name, str) else []
    if not parts or name.startswith("/") or any(p in ("", ".", "..") for p in parts) or "\0" in name:
      raise ValueError(f"file names must be relative paths without '.' or '..' parts, got {name!r}")
    if any("/".join(parts[:i]) in files for i in range(1, len(parts))):
      raise ValueError(f"files[{name!r}] would be inside another file")
    if not isinstance(text, str):
      raise ValueError(f"files[{name!r}] must be a str, got {type(text).__name__}")


def _run(code, timeout_s, memory_mb, output_limit, files, tmp) -> ToolResult:
  global _working
  work = os.path.join(tmp, "work")
  os.mkdir(work)
  os.mkdir(os.path.join(tmp, "root"))
  # surrogatepass: a lone surrogate in the code is then Python's syntax error to report, not ours.
  with open(os.path.join(tmp, "main.py"), "w", encoding="utf-8", errors="surrogatepass") as f:
    f.write(code)
  for name, text in files.items():
    path = os.path.join(work, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8", errors="surrogatepass") as f:
      f.write(text)
  as_root = _host_root()
  if as_root:  # the sandbox's host uid must own its directory to write there
    for d, subdirs, names in os.walk(work):
      for p in [d] + [os.path.join(d, n) for n in subdirs + names]:
        os.chown(p, _ROOT_CALLER_UID, _ROOT_CALLER_UID, follow_symlinks=False)
  cpu_s = math.ceil(timeout_s)
  proc = subprocess.Popen(_command(as_root, cpu_s, memory_mb), cwd=tmp, env=_ENV, stdin=subprocess.DEVNULL,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
  try:
    setup, out, reason = _collect(proc, time.monotonic() + timeout_s, output_limit)
    if reason is not None:
      reason = reason.format(timeout_s=timeout_s, output_limit=output_limit)
  finally:
    _kill(proc)
  if setup is None:
    _working = True
  elif reason is None:  # it never came up
    message = setup.decode("utf-8", "replace").strip() or f"exit status {proc.returncode}"
    if not _working:
      raise RuntimeError("could not make the Python sandbox here (it needs unprivileged user, mount, network "
                         f"and PID namespaces through util-linux unshare): {message}")
    return ToolResult(False, f"{message}\n[sandbox setup failed]")
  if reason is None and proc.returncode != 0:
    reason = _exit_reason(proc.returncode, cpu_s)
  text = bytes(out[:output_limit]).decode("utf-8", "replace")
  if reason is None:
    return ToolResult(True, text)
  return ToolResult(False, text + ("" if text.endswith("\n") or not text else "\n") + reason)


def _command(as_root, cpu_s, memory_mb) -> list[str]:
  """unshare's command line. A first shell, with a private mount namespace, builds the sandbox's root
  under tmp/root; a second, the init of new user, mount, network and PID namespaces, pivots into it and
  runs the code. A root caller builds as root (so it can read a prefix under /root) and drops to
  _ROOT_CALLER_UID for the rest; others build as root of a user namespace of their own."""
  q = shlex.quote
  build = ["set -e", "umask 022", "mount -t tmpfs -o mode=0755 moejax-sandbox root", "cd root"]
  for path, link in _host_paths():
    rel = q(path.lstrip("/"))
    if link is not None:  # a merged-/usr link such as /lib -> usr/lib
      build.append(f"ln -s {q(link)} {rel}")
    else:
      build += [f"mkdir -p {rel}", f"mount --bind {q(path)} {rel}",
                f"mount -o remount,bind,ro,nosuid,nodev {rel}"]
  build.append("mkdir dev sandbox")
  for dev in _DEVICES:
    build += [f"touch dev/{dev}", f"mount --bind /dev/{dev} dev/{dev}"]
  build += ["mount --bind ../work sandbox", "cp ../main.py main.py", "mkdir .newroot .oldroot proc",
            "mount -o remount,bind,ro ."]
  limits = [f"--cpu={cpu_s}:{cpu_s + 1}", f"--as={memory_mb << 20}", f"--nproc={MAX_TASKS}",
            f"--fsize={MAX_FILE_MB << 20}", f"--nofile={MAX_OPEN_FILES}", "--core=0"]
  python = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
  init = [
    "set -e",
    # The caller's SIGTERM: this init kills all else in its namespace and exits, for unshare to reap (a
    # SIGKILL would orphan it to the host's init). Only ever as init of a PID namespace of its own.
    "trap '[ $$ != 1 ] || kill -s KILL -- -1 2>/dev/null || :; exit 143' TERM",
    # Without this the code could make a user namespace of its own, root in it, and mount a tmpfs there
    # that no rlimit bounds.
    "echo 0 > /proc/sys/user/max_user_namespaces",
    # pivot_root refuses a new root copied from a more privileged namespace (locked): pivot into a fresh
    # bind of it (the paths above "." are closed to a root caller's sandbox uid: no canonicalising). The
    # host's tree then leaves this namespace whole, nothing of it left to reach; umount reads the mount
    # table from a /proc of the sandbox's own, there only for that.
    "mount --no-canonicalize --rbind . .newroot", "cd -P .newroot", "pivot_root . .oldroot",
    "mount -t proc proc /proc", "umount -l /.oldroot", "umount /proc", "cd /sandbox", "unset OLDPWD PWD",
    "printf " + q(_READY.decode().replace("\x1e", "\\036")),
    # No capabilities (it is root of its user namespace), no setuid gains; then the limits, and a wall-clock
    # one of its own should the caller die without killing it. The code runs as a child, not exec'd: this
    # shell stays the namespace's init, and its exit kills whatever the code left behind; in the background,
    # so that the trap runs at once.
    "setpriv --no-new-privs --inh-caps=-all --ambient-caps=-all --bounding-set=-all -- prlimit "
    + " ".join(limits) + f" -- timeout -s KILL {cpu_s + 2} {q(python)} -I -u -B /main.py &", "wait $!",
  ]
  drop = f"setpriv --reuid={_ROOT_CALLER_UID} --regid={_ROOT_CALLER_UID} --clear-groups " if as_root else ""
  build.append(f"exec {drop}unshare --user --map-root-user --mount --net --pid --fork --kill-child "
               f"-- sh -c {q(chr(10).join(init))}")
  outer = ["unshare", "--mount"] if as_root else ["unshare", "--user", "--map-root-user", "--mount"]
  return outer + ["sh", "-c", "\n".join(build)]


def _host_root() -> bool:
  """Whether this process is root of the host (uid 0 mapped to itself), not root of a user namespace."""
  if os.geteuid() != 0:
    return False
  with open("/proc/self/uid_map") as f:
    return any(line.split()[:2] == ["0", "0"] for line in f)


def _host_paths() -> list[tuple[str, str | None]]:
  """(path, symlink target or None) for the host paths the interpreter needs, parents before children."""
  out = []
  for path in ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
    if os.path.islink(path):
      out.append((path, os.readlink(path)))
    elif os.path.isdir(path):
      out.append((path, None))
  executable = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
  extra = {os.path.realpath(sys.base_prefix), os.path.realpath(sys.base_exec_prefix),
           os.path.dirname(executable)}
  for path in sorted(extra, key=len):
    if not any(path == p or path.startswith(p.rstrip("/") + "/") for p, _ in out):
      out.append((path, None))
  return out


def _collect(proc, deadline, limit):
  """(setup output if the sandbox never came up else None, the code's output, kill reason or None), read
  as it comes so that a flood is never held whole; stops at EOF, the deadline or past limit bytes."""
  fd = proc.stdout.fileno()
  before, out, ready = bytearray(), bytearray(), False
  with selectors.DefaultSelector() as sel:
    sel.register(fd, selectors.EVENT_READ)
    while True:
      left = deadline - time.monotonic()
      if left <= 0:
        return (None if ready else before), out, "[killed: wall time limit {timeout_s} s]"
      if not sel.select(left):
        continue
      chunk = os.read(fd, 1 << 16)
      if not chunk:
        return (None if ready else before), out, None
      if ready:
        out += chunk
      else:
        before += chunk
        i = before.find(_READY)
        if i >= 0:
          ready, out, before = True, before[i + len(_READY):], before[:i]
      if len(out) + len(before) > limit:
        return (None if ready else before), out, "[killed: output limit {output_limit} bytes]"


def _kill(proc):
  """Ends the sandbox if still running and reaps it. SIGTERM has its init end it (see _command); SIGKILL,
  for an init not yet trapping it, also kills the init, and with it every process of its PID namespace."""
  for sig in (signal.SIGTERM, signal.SIGKILL):
    if proc.poll() is None:
      try:
        os.killpg(proc.pid, sig)
        proc.wait(_KILL_GRACE_S)
      except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
  proc.wait()
  # EOF once the last process holding the pipe is gone: the namespace's processes die asynchronously.
  deadline = time.monotonic() + _KILL_GRACE_S
  with selectors.DefaultSelector() as sel:
    sel.register(proc.stdout, selectors.EVENT_READ)
    while (left := deadline - time.monotonic()) > 0 and sel.select(left):
      if not os.read(proc.stdout.fileno(), 1 << 16):
        break
  proc.stdout.close()


def _exit_reason(returncode, cpu_s) -> str:
  # The init shell reports code killed by signal n as status 128 + n, and unshare passes that on.
  sig = -returncode if returncode < 0 else returncode - 128 if returncode > 128 else 0
  if sig == signal.SIGXCPU:
    return f"[killed: cpu time limit {cpu_s} s]"
  name = {s.value: s.name for s in signal.Signals}.get(sig)
  return f"[exit status {returncode}: killed by {name}]" if name else f"[exit status {returncode}]"


def _remove(tmp):
  """Removes tmp, also where the code left directories it cannot write."""
  for attempt in range(3):
    if os.geteuid() != 0:  # root needs no permissions; chmod by others never follows a link here
      for d, subdirs, _ in os.walk(tmp):
        for p in [os.path.join(d, s) for s in subdirs]:
          if not os.path.islink(p):
            os.chmod(p, 0o700)
    try:
      shutil.rmtree(tmp)
      return
    except FileNotFoundError:
      return
    except OSError:  # a dying process of the sandbox may still have been writing
      if attempt == 2:
        raise
      time.sleep(0.1)
