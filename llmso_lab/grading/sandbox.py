"""Run one student process in a sandbox, and report how strong that sandbox is.

Two levels, chosen by `isolation()`:

* **isolated** (the grader runs as root on Linux, as in a container, CI or Gradescope). A small supervisor
  (this file run as a script, standard library only) creates new PID, mount, network, IPC and UTS
  namespaces and forks the namespace's init. The init builds a fresh root file system from a tmpfs and
  read-only bind mounts (the system directories, the Python installation, and the grader-prepared student
  library mounted over the instructor's package), enters it with `pivot_root` (the old root is detached, so
  the instructor's checkout, `solutions/`, the hidden checks and other submissions do not exist in it), brings
  up loopback only (no network), then forks the student's process, which drops to a dedicated unprivileged
  uid (one per concurrent job), sets `no_new_privs` and rlimits, and execs Python. When a cgroup hierarchy is
  writable, the job also gets its own cgroup with a process and a memory limit. Every process the student
  starts lives in the PID namespace, so `setsid`, double forks and daemons cannot outlive it: when the init
  exits (or the supervisor kills it on timeout) the kernel kills the rest, and the supervisor returns only
  after all of them are gone. The student cannot signal the grader (another uid, another PID namespace).
* **uid** (root, but no namespaces: a default Docker container, as Gradescope's): the same supervisor without
  the namespaces. The student's process runs as a dedicated unprivileged uid with rlimits (and the cgroup where
  writable); when it ends, every process of that uid is killed, so detached ones die too, and it cannot
  signal the grader. It reads what file permissions let any user read: the packaged autograder makes the
  library and hidden checks root-only (`describe()` warns when they are not).
* **reduced** (not root, or not Linux): a child process in its own session with rlimits only. It can read
  whatever the grader's user can read and a process that calls `setsid` may outlive the exercise. Fine for a
  student's own checks, not for grading untrusted work: run the grader as root (e.g. in a container).

`describe()` says which level ran; the grader prints it. `LLMSO_LAB_SANDBOX=uid` or `=reduced` forces a
weaker level (tests use it to exercise all three).
"""
from __future__ import annotations

import ctypes
import fcntl
import glob
import json
import os
import resource   # imported before the supervisor's root changes: it is an extension module
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time

UID_BASE = 61000          # sandbox uids: UID_BASE + slot, one slot per concurrently running job
NUM_SLOTS = 64
PIDS_MAX = 256            # processes + threads per job (cgroup pids.max and RLIMIT_NPROC)
SLOT_DIR = os.path.join(tempfile.gettempdir(), "llmso-lab-sandbox-slots")

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 36, 38
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
SYSTEM_DIRS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32", "usr", "etc")
DEVICES = ("null", "zero", "full", "random", "urandom")


# ---- grader side -------------------------------------------------------------------------------
class Isolation:
    def __init__(self, level: str, reason: str) -> None:
        assert level in ("isolated", "uid", "reduced"), level
        self.level, self.reason = level, reason

    @property
    def isolated(self) -> bool:
        return self.level == "isolated"

    @property
    def supervised(self) -> bool:
        """Run by the supervisor as a dedicated uid (isolated and uid levels)."""
        return self.level != "reduced"

    def describe(self, exposed: list[str] = ()) -> str:
        """One line for the instructor; `exposed`: instructor paths the student's uid could read (uid level)."""
        cgroup = ", cgroup" if _cgroup_roots() else ""
        if self.isolated:
            return ("sandbox: isolated (PID/mount/network namespaces, read-only student bundle, unprivileged uid, "
                    f"rlimits{cgroup})")
        if self.level == "uid":
            warn = (f" WARNING: readable by any user, so by the submission: {', '.join(exposed)} (chmod -R go-rwx)"
                    if exposed else "")
            return (f"sandbox: uid ({self.reason}): an unprivileged uid with rlimits{cgroup}; all its processes are "
                    f"killed when an exercise ends; no read-only file system view.{warn}")
        return (f"sandbox: REDUCED ({self.reason}): rlimits only; the submission can read what this user can read "
                "and a process it detaches may outlive it. Grade untrusted work as root or in a container.")


_ISOLATION: Isolation | None = None


def isolation() -> Isolation:
    """Which sandbox this process can give (probed once: a real namespace setup, ~0.1 s)."""
    global _ISOLATION
    if _ISOLATION is None:
        _ISOLATION = _probe()
    return _ISOLATION


def _probe() -> Isolation:
    forced = os.environ.get("LLMSO_LAB_SANDBOX", "")
    if forced not in ("", "uid", "reduced"):
        raise ValueError(f"LLMSO_LAB_SANDBOX={forced!r}: use 'uid' or 'reduced' (or leave it unset)")
    if forced == "reduced":
        return Isolation("reduced", "LLMSO_LAB_SANDBOX=reduced")
    if not sys.platform.startswith("linux"):
        return Isolation("reduced", f"the sandbox needs Linux, this is {sys.platform}")
    if os.geteuid() != 0:
        return Isolation("reduced", "the grader is not running as root")
    if forced == "uid":
        return Isolation("uid", "LLMSO_LAB_SANDBOX=uid")
    if os.uname().machine not in SYS_PIVOT_ROOT:
        return Isolation("uid", f"no pivot_root syscall number for {os.uname().machine}")
    try:
        proc = subprocess.run([sys.executable, "-I", "-S", __file__, "--probe"], capture_output=True, text=True,
                              timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        return Isolation("uid", f"namespace probe failed ({exc})")
    if proc.returncode != 0 or proc.stdout.strip() != "ok":
        return Isolation("uid", f"namespaces unavailable: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    return Isolation("isolated", "")


def _others_may(path: str, bit: int) -> bool:
    """Can a user who is neither the owner nor in the group reach `path` and read (4) / execute (1) it?"""
    parts = os.path.abspath(path).split(os.sep)
    for i in range(2, len(parts)):   # every directory on the way must be searchable
        if not os.stat(os.sep.join(parts[:i])).st_mode & 0o001:
            return False
    return bool(os.stat(path).st_mode & bit)


def exposed_paths(paths: list[str]) -> list[str]:
    """Those of `paths` that any user can reach and read (what the uid level cannot hide)."""
    return [p for p in paths if os.path.exists(p) and _others_may(p, 0o004)]


def runnable_by_others(executable: str) -> bool:
    """Can the sandbox uid run this interpreter (every directory on the way to it, and to the file a symlink
    points to, searchable)?"""
    path = os.path.abspath(executable)
    return _others_may(os.path.dirname(path), 0o001) and _others_may(os.path.realpath(path), 0o001)


def remove_stale_job_dirs(gid: int) -> list[str]:
    """Delete job folders left in the temp dir by a grader that was killed (no cleanup ran) and readable by the group
    `gid`. Called when a job takes the slot of that gid: the slot's lock is held, so no live job owns such a folder,
    and a new job of the same gid must not find another job's library copy or answers there."""
    removed = []
    for path in glob.glob(os.path.join(tempfile.gettempdir(), "llmso-grade-*")):
        try:
            if os.stat(path, follow_symlinks=False).st_gid == gid:
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
        except OSError:
            continue
    return removed


class Slot:
    """A sandbox uid held for one job (an flock, released when the job ends or the grader dies). Taking it removes
    the stale folders a killed grader left for that uid's group (`remove_stale_job_dirs`)."""

    def __enter__(self) -> "Slot":
        os.makedirs(SLOT_DIR, mode=0o700, exist_ok=True)
        for _ in range(600):
            for i in range(NUM_SLOTS):
                fd = os.open(os.path.join(SLOT_DIR, f"slot-{i}.lock"), os.O_RDWR | os.O_CREAT, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    os.close(fd)
                    continue
                self.fd, self.uid = fd, UID_BASE + i
                remove_stale_job_dirs(self.uid)
                return self
            time.sleep(0.1)
        raise RuntimeError(f"all {NUM_SLOTS} sandbox slots stayed busy for a minute")

    def __exit__(self, *exc) -> None:
        os.close(self.fd)


def run_supervised(level: str, argv: list[str], env: dict[str, str], *, work_dir: str, root_dir: str,
                   binds: list[tuple[str, str, bool]], uid: int, rlimits: dict[str, int], memory_bytes: int,
                   pass_fds: tuple[int, ...], log_fd: int, timeout_s: float) -> subprocess.Popen:
    """Start the supervisor for one job (see the module docstring); it prints {"status", "timed_out"} when the
    job's last process is gone. Isolated: `work_dir` becomes /job (writable, the student's cwd) and `binds`
    (host path, path inside, writable) make the file system. Uid: the student's cwd is `work_dir` itself."""
    isolated = level == "isolated"
    spec = {"level": level, "argv": argv, "env": env, "cwd": "/job" if isolated else work_dir, "uid": uid, "gid": uid,
            "rlimits": rlimits, "root": root_dir,
            "binds": [[src, dst, rw] for src, dst, rw in binds] + [[work_dir, "/job", True]],
            "fds": list(pass_fds), "log_fd": log_fd, "timeout_s": timeout_s,
            "memory_bytes": memory_bytes, "cgroup_name": f"llmso-lab-{uid}-{os.getpid()}-{time.monotonic_ns()}"}
    os.makedirs(root_dir, exist_ok=True)
    os.chown(work_dir, uid, uid)
    os.chmod(work_dir, 0o700)
    # The job description goes through stdin, not argv: the job's init is a fork of the supervisor, and its
    # /proc/PID/cmdline (readable by the student) would otherwise show the paths, uid and binds.
    proc = subprocess.Popen([sys.executable, "-I", "-S", __file__, "--job-on-stdin"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(*pass_fds, log_fd),
                            start_new_session=True)
    proc.stdin.write(json.dumps(spec).encode())   # read at once by the supervisor: no deadlock on a large spec
    proc.stdin.close()
    proc.stdin = None   # so that communicate() does not flush it
    return proc


def restrict_to_job(path: str, gid: int) -> None:
    """Make the tree at `path` readable by the job's group only (owner root, group `gid`: directories 0750, files
    0640; `path` itself 0710). At the uid level the student's process reads its library copy by its host path
    under /tmp; another job's uid (another group) can neither list nor read it, and the student cannot write it."""
    for dirpath, dirnames, filenames in os.walk(path):
        for name in filenames:
            f = os.path.join(dirpath, name)
            os.chown(f, 0, gid, follow_symlinks=False)
            os.chmod(f, 0o640)
        os.chown(dirpath, 0, gid)
        os.chmod(dirpath, 0o750)
    os.chmod(path, 0o710)


def _cgroup_roots() -> list[tuple[str, str]]:
    """[(kind, our cgroup dir)] for the writable pids/memory hierarchies ("v1-pids", "v1-memory", "v2")."""
    if os.geteuid() != 0:
        return []
    try:
        lines = open("/proc/self/cgroup").read().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        path = path.lstrip("/")
        if controllers == "" and os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
            base = os.path.join("/sys/fs/cgroup", path)
            try:
                enabled = open(os.path.join(base, "cgroup.subtree_control")).read().split()
            except OSError:
                continue
            if {"pids", "memory"} <= set(enabled) and os.access(base, os.W_OK):
                found.append(("v2", base))
        for kind in ("pids", "memory"):
            if kind in controllers.split(","):
                base = os.path.join("/sys/fs/cgroup", kind, path)
                if os.access(base, os.W_OK):
                    found.append((f"v1-{kind}", base))
    return found


# ---- supervisor side (this file run as a script; standard library only) --------------------------
def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(libc, src, dst, fstype, flags, data=None) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(libc.mount(enc(src), enc(dst), enc(fstype), ctypes.c_ulong(flags), enc(data)), f"mount {src} on {dst}")


def _bind(libc, src: str, dst: str, writable: bool, device: bool = False) -> None:
    if os.path.isdir(src):
        os.makedirs(dst, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        open(dst, "a").close()
    _mount(libc, src, dst, None, MS_BIND | MS_REC)
    flags = MS_BIND | MS_REMOUNT | MS_NOSUID | (0 if device else MS_NODEV) | (0 if writable else MS_RDONLY)
    _mount(libc, None, dst, None, flags)


def _loopback_up() -> None:
    """ifconfig lo up (a fresh network namespace has only a loopback device, and it is down)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sH14s", b"lo", 0, b"")
        flags = struct.unpack("16sH14s", fcntl.ioctl(s.fileno(), 0x8913, req))[1]   # SIOCGIFFLAGS
        fcntl.ioctl(s.fileno(), 0x8914, struct.pack("16sH14s", b"lo", flags | 1, b""))  # SIOCSIFFLAGS, IFF_UP


def _build_root(libc, spec: dict) -> None:
    """Mount the new root (tmpfs + read-only binds) and pivot into it. Runs as root in the new namespaces."""
    root = spec["root"]
    _mount(libc, None, "/", None, MS_REC | MS_PRIVATE)           # nothing we mount leaks to the host
    _mount(libc, "tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=16m,mode=0755")
    for name in SYSTEM_DIRS:
        host = "/" + name
        if os.path.islink(host):
            os.symlink(os.readlink(host), os.path.join(root, name))
        elif os.path.isdir(host):
            _bind(libc, host, os.path.join(root, name), False)
    dev = os.path.join(root, "dev")
    os.makedirs(dev, exist_ok=True)
    _mount(libc, "tmpfs", dev, "tmpfs", MS_NOSUID, "size=64k,mode=0755")
    for name in DEVICES:
        _bind(libc, "/dev/" + name, os.path.join(dev, name), True, device=True)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, os.path.join(dev, name))
    mem_mb = max(64, spec["memory_bytes"] // 2**20 // 4)
    for path, mode in ((os.path.join(dev, "shm"), "1777"), (os.path.join(root, "tmp"), "1777")):
        os.makedirs(path, exist_ok=True)
        _mount(libc, "tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, f"size={mem_mb}m,mode={mode}")
    for src, dst, rw in spec["binds"]:   # after /tmp, so that a bind below /tmp stays visible
        if os.path.exists(src):
            _bind(libc, src, root + dst, rw)
    os.makedirs(os.path.join(root, "proc"), exist_ok=True)
    _mount(libc, "proc", os.path.join(root, "proc"), "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    old = os.path.join(root, ".old_root")
    os.makedirs(old)
    _check(libc.syscall(SYS_PIVOT_ROOT[os.uname().machine], root.encode(), old.encode()), "pivot_root")
    os.chdir("/")
    _check(libc.umount2(b"/.old_root", MNT_DETACH), "umount old root")
    os.rmdir("/.old_root")
    _mount(libc, None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _exec_student(libc, spec: dict) -> None:
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(spec["log_fd"], 1)
    os.dup2(spec["log_fd"], 2)
    for name, value in spec["rlimits"].items():
        resource.setrlimit(getattr(resource, f"RLIMIT_{name}"), (value, value))
    resource.setrlimit(resource.RLIMIT_NPROC, (PIDS_MAX, PIDS_MAX))
    os.setgroups([])
    os.setresgid(spec["gid"], spec["gid"], spec["gid"])
    os.setresuid(spec["uid"], spec["uid"], spec["uid"])
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    keep = {0, 1, 2, *spec["fds"]}
    for fd in os.listdir("/proc/self/fd"):
        if int(fd) not in keep:
            try:
                os.close(int(fd))
            except OSError:
                pass
    os.chdir(spec["cwd"])
    os.execve(spec["argv"][0], spec["argv"], spec["env"])


def _init(libc, spec: dict, sync_fd: int) -> None:
    """PID 1 of the job's namespace: build the root, start the student's process, reap until it exits."""
    _check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "pdeathsig")
    os.read(sync_fd, 1)   # the supervisor has put us in the job's cgroup
    os.close(sync_fd)
    # Our own mount namespace (not the supervisor's: pivot_root moves every process of the namespace).
    _check(libc.unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS), "unshare")
    _build_root(libc, spec)
    _loopback_up()
    student = os.fork()
    if student == 0:
        try:
            _exec_student(libc, spec)
        except BaseException as exc:   # noqa: BLE001 - report and die; nothing else may run here
            os.write(2, f"sandbox: could not start the student process: {exc}\n".encode())
        os._exit(127)
    while True:   # as PID 1 we also reap orphans; when the student's process is done, so is the job
        pid, status = os.wait()
        if pid == student:
            code = os.waitstatus_to_exitcode(status)
            os._exit(code if code >= 0 else 128 - code)   # killed by signal N: 128 + N, as a shell says


def _cgroup_enter(spec: dict, pid: int) -> list[str]:
    made = []
    for kind, base in _cgroup_roots():
        path = os.path.join(base, spec["cgroup_name"])
        try:
            os.mkdir(path)
            made.append(path)
            limits = {"v2": [("pids.max", PIDS_MAX), ("memory.max", spec["memory_bytes"]), ("memory.swap.max", 0)],
                      "v1-pids": [("pids.max", PIDS_MAX)],
                      "v1-memory": [("memory.limit_in_bytes", spec["memory_bytes"])]}[kind]
            for name, value in limits:
                if os.path.exists(os.path.join(path, name)):
                    with open(os.path.join(path, name), "w") as f:
                        f.write(str(value))
            with open(os.path.join(path, "cgroup.procs"), "w") as f:
                f.write(str(pid))
        except OSError:
            continue
    return made


def _cgroup_remove(paths: list[str]) -> None:
    for path in paths:
        for i in range(100):
            try:
                os.rmdir(path)
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.05)


def _kill_uid(uid: int, seconds: float = 10.0) -> None:
    """Kill every process of `uid` (uid level: the student's detached processes too). A forked killer takes the
    uid, so kill(-1) reaches exactly that uid's processes; orphans are reaped by us, their subreaper."""
    killer = os.fork()
    if killer == 0:
        try:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                try:
                    os.kill(-1, signal.SIGKILL)   # every process of this uid except the killer itself
                except ProcessLookupError:
                    os._exit(0)
                time.sleep(0.01)
        except BaseException:   # noqa: BLE001
            pass
        os._exit(1)
    while True:
        try:
            pid, _ = os.waitpid(-1, 0)   # the killer, and orphans that were re-parented to us
        except ChildProcessError:
            return
        if pid == killer:
            while True:   # reap what is left without blocking
                try:
                    if os.waitpid(-1, os.WNOHANG)[0] == 0:
                        return
                except ChildProcessError:
                    return


def _supervise(spec: dict) -> dict:
    libc = _libc()
    for fd in (*spec["fds"], spec["log_fd"]):
        os.set_inheritable(fd, True)
    isolated = spec["level"] == "isolated"
    if isolated:
        _check(libc.unshare(CLONE_NEWPID), "unshare")   # our next child is PID 1 of a new PID namespace
    else:
        _check(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "subreaper")   # orphans come to us, not to init
    sync_r, sync_w = os.pipe()
    init = os.fork()
    if init == 0:
        os.close(sync_w)
        try:
            if isolated:
                _init(libc, spec, sync_r)
            else:
                _check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "pdeathsig")
                os.read(sync_r, 1)
                _exec_student(libc, spec)
        except BaseException as exc:   # noqa: BLE001
            os.write(2, f"sandbox: {exc}\n".encode())
        os._exit(126)
    os.close(sync_r)
    cgroups = _cgroup_enter(spec, init)
    os.write(sync_w, b"x")
    os.close(sync_w)
    killed = {"by_grader": False}

    def stop(signum, frame):   # the grader gives up on the job: kill the namespace's init, then wait
        killed["by_grader"] = True
        try:
            os.kill(init, signal.SIGKILL)
        except ProcessLookupError:
            pass

    signal.signal(signal.SIGTERM, stop)
    pidfd = os.pidfd_open(init)
    timed_out = not select.select([pidfd], [], [], spec["timeout_s"])[0]
    if timed_out:
        stop(None, None)
    _, status = os.waitpid(init, 0)   # isolated: returns only once every process of the namespace is gone
    if not isolated:
        _kill_uid(spec["uid"])
    _cgroup_remove(cgroups)
    return {"status": os.waitstatus_to_exitcode(status), "timed_out": timed_out, "killed": killed["by_grader"],
            "cgroups": len(cgroups)}


def _probe_main() -> None:
    """Can this machine give the isolated level? Try the namespaces, a tmpfs and a fork inside."""
    libc = _libc()
    _check(libc.unshare(CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS), "unshare")
    pid = os.fork()
    if pid == 0:
        try:
            _mount(libc, None, "/", None, MS_REC | MS_PRIVATE)
            _mount(libc, "tmpfs", tempfile.gettempdir(), "tmpfs", 0, "size=1m")   # private: the host sees nothing
            _loopback_up()
            os._exit(0 if os.getpid() == 1 else 3)
        except BaseException as exc:   # noqa: BLE001
            os.write(2, f"{exc}\n".encode())
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    print("ok" if os.waitstatus_to_exitcode(status) == 0 else "failed")


if __name__ == "__main__":
    if sys.argv[1] == "--probe":
        _probe_main()
    elif sys.argv[1] == "--job-on-stdin":
        job_spec = json.loads(sys.stdin.read())
        print(json.dumps(_supervise(job_spec)), flush=True)
