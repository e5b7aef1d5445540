"""The sandbox's child: contains itself (limits, namespaces, audit hook), then runs
the program `SCRATCH/main.py`; standard library only, run as a script by `run_python`.

`python -I -S -B _sandbox_child.py SCRATCH MEMORY_MB CPU_SECONDS`. A refused operation ends
the child at once with one of `REFUSED`'s exit codes (`os._exit` in the audit hook: the
program cannot catch it), after a `sandbox: refused ...` line on stderr.
"""

from __future__ import annotations

import os
import resource
import runpy
import signal
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["EXIT_SETUP", "REFUSED", "main"]

EXIT_SETUP = 110  # the child could not contain itself or read the program: nothing ran
EXIT_FILESYSTEM, EXIT_NETWORK, EXIT_PROCESS, EXIT_MEMORY = 111, 112, 113, 114
REFUSED = {
    EXIT_FILESYSTEM: "filesystem",
    EXIT_NETWORK: "network",
    EXIT_PROCESS: "process",
    EXIT_MEMORY: "memory",
}

FILE_SIZE_LIMIT = 16 << 20  # also caps stdout and stderr, which are files
OPEN_FILES_LIMIT = 256
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
_NAMESPACES = (  # the most isolating first
    CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWPID,
    CLONE_NEWNET | CLONE_NEWPID,
    CLONE_NEWUSER | CLONE_NEWNET,
    CLONE_NEWNET,
)

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
_READ_EVENTS = frozenset({"os.listdir", "os.scandir", "os.getxattr", "os.listxattr"})
_WRITE_EVENTS = frozenset({
    "os.chmod", "os.chown", "os.chflags", "os.lchflags", "os.mkdir", "os.remove", "os.rmdir",
    "os.truncate", "os.utime", "os.setxattr", "os.removexattr",
})  # fmt: skip
_PROCESS_EVENTS = (
    "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
    "os.startfile", "subprocess.Popen", "pty.spawn", "webbrowser.open", "os.kill", "os.killpg",
    "resource.setrlimit", "resource.prlimit", "cpython.PyInterpreterState_New",
    "sqlite3.enable_load_extension", "sqlite3.load_extension",
    # The audit hook's own state is reachable only through the garbage collector.
    "gc.get_objects", "gc.get_referrers", "gc.get_referents",
)  # fmt: skip
_REFUSED_EVENTS = {
    "os.link": EXIT_FILESYSTEM,  # a link in the scratch directory to a file outside it
    "os.symlink": EXIT_FILESYSTEM,
    **dict.fromkeys(_PROCESS_EVENTS, EXIT_PROCESS),
}
_REFUSED_PREFIXES = (
    ("socket.", EXIT_NETWORK), ("syslog.", EXIT_NETWORK), ("urllib.", EXIT_NETWORK),
    ("http.client.", EXIT_NETWORK), ("ftplib.", EXIT_NETWORK), ("smtplib.", EXIT_NETWORK),
    ("poplib.", EXIT_NETWORK), ("imaplib.", EXIT_NETWORK), ("nntplib.", EXIT_NETWORK),
    ("telnetlib.", EXIT_NETWORK), ("ctypes.", EXIT_PROCESS),
)  # fmt: skip
# Modules that reach the system without audit events of their own: native calls
# (ctypes), fork+exec (_posixsubprocess, so `subprocess`), databases opened in C, other
# interpreters (which have no audit hooks of ours).
_REFUSED_IMPORTS = frozenset({
    "ctypes", "_ctypes", "_posixsubprocess", "_xxsubinterpreters", "_gdbm", "_dbm",
    "dbm.gnu", "dbm.ndbm",
})  # fmt: skip


def _limit(memory_mb: int, cpu_s: int) -> None:
    """Kernel limits: address space, CPU time, file size, open files, no core files (each at
    most its hard limit already).

    No RLIMIT_NPROC: the kernel exempts uid 0 from it, even inside a user namespace (tried),
    and for another user it counts all that user's processes, so a value small enough to
    matter also refuses threads, which would make rewards depend on the machine. The audit
    hook refuses new processes instead."""
    for limit, value in (
        (resource.RLIMIT_AS, memory_mb << 20),
        (resource.RLIMIT_CPU, cpu_s),
        (resource.RLIMIT_FSIZE, FILE_SIZE_LIMIT),
        (resource.RLIMIT_NOFILE, OPEN_FILES_LIMIT),
        (resource.RLIMIT_CORE, 0),
    ):
        # The hard CPU limit a second later: SIGKILL if SIGXCPU is ignored.
        want = (value, value + 1 if limit == resource.RLIMIT_CPU else value)
        hard = resource.getrlimit(limit)[1]
        if hard != resource.RLIM_INFINITY:
            want = (min(want[0], hard), min(want[1], hard))
        resource.setrlimit(limit, want)


def _isolate() -> None:
    """New namespaces where the kernel allows: network (no interface but a loopback that is
    down) and process ids (the program is process 1 of its own, so it can signal nothing
    outside, the trainer included); with a user namespace of its own where allowed (how
    unprivileged users can), else without (root), else none: the audit hook still refuses
    sockets and signals."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
    except (ImportError, OSError):
        return
    uid, gid = os.geteuid(), os.getegid()
    try:
        flags = next((f for f in _NAMESPACES if libc.unshare(f) == 0), 0)
    finally:
        # Whoever imports ctypes again asks the audit hook, which refuses.
        for name in [m for m in sys.modules if m == "ctypes" or m.startswith("ctypes.")]:
            del sys.modules[name]
        sys.modules.pop("_ctypes", None)
    if flags & CLONE_NEWUSER:
        # Our own ids inside, as outside: for show only (files are made with the real ids
        # either way), so a kernel that refuses the maps changes nothing that matters.
        maps = {"setgroups": "deny", "uid_map": f"{uid} {uid} 1", "gid_map": f"{gid} {gid} 1"}
        for name, text in maps.items():
            try:
                with open(f"/proc/self/{name}", "w") as f:
                    f.write(text)
            except OSError:
                break
    if flags & CLONE_NEWPID:
        _fork_into_the_pid_namespace()


def _fork_into_the_pid_namespace() -> None:
    """Forks (a new process-id namespace holds only the children of who made it): the child,
    its process 1, goes on to run the program; this process waits and ends as it did."""
    pid = os.fork()
    if pid == 0:
        return
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        code = 128 - code  # a signal whose default is to carry on
    os._exit(code)


def _resolver(lstat: Callable, readlink: Callable, getcwd: Callable) -> Callable[[str], str]:
    """`os.path.realpath` from C functions alone: the program may patch `posixpath`."""
    link_type, type_mask = 0o120000, 0o170000
    oserror = OSError

    def resolve(path: str) -> str:
        if not path.startswith("/"):
            path = getcwd() + "/" + path
        done: list[str] = []
        todo = path.split("/")[::-1]
        hops = 0
        while todo:
            part = todo.pop()
            if part == "" or part == ".":
                continue
            if part == "..":
                if done:
                    done.pop()
                continue
            done.append(part)
            current = "/" + "/".join(done)
            try:
                mode = lstat(current).st_mode
            except oserror:
                continue  # not there (yet): the rest resolves by its text
            if mode & type_mask == link_type:
                hops += 1
                if hops > 40:
                    return "/"  # a link loop: resolves nowhere allowed
                target = readlink(current)
                done.pop()
                if target.startswith("/"):
                    done = []
                todo.extend(target.split("/")[::-1])
        return "/" + "/".join(done)

    return resolve


def _audit_hook(scratch: str, readable: tuple[str, ...]) -> Callable[[str, tuple], None]:
    """The hook: writes only under `scratch`, reads under it and `readable`, no network, no
    new processes. It keeps everything it uses in its closure, never a global or builtin
    name: the program may rebind those."""
    lstat = os.lstat
    resolve = _resolver(lstat, os.readlink, os.getcwd)
    write, exit_, flush = os.write, os._exit, sys.stdout.flush
    type_, str_, bytes_, int_, none, repr_ = type, str, bytes, int, type(None), repr
    base_exception = BaseException
    filesystem, process = EXIT_FILESYSTEM, EXIT_PROCESS
    scratch_under = scratch + "/"
    write_roots = tuple((root, root + "/") for root in (scratch, "/dev/null"))
    read_roots = tuple((root, root + "/") for root in (scratch, *readable))
    write_flags, read_events, write_events = _WRITE_FLAGS, _READ_EVENTS, _WRITE_EVENTS
    refused_events, refused_prefixes = dict(_REFUSED_EVENTS), _REFUSED_PREFIXES
    refused_imports = _REFUSED_IMPORTS

    def refuse(code: int, what: str) -> None:
        try:  # noqa: SIM105 - contextlib is a global the program could patch
            flush()
        except base_exception:
            pass
        write(2, ("\nsandbox: refused " + what + "\n").encode("utf-8", "replace"))
        exit_(code)

    def check(event: str, path: Any, writing: bool) -> None:
        kind = type_(path)
        if kind is int_:
            return  # a descriptor: only allowed paths could be opened
        if kind is none:
            path = "."
        elif kind is bytes_:
            path = path.decode("utf-8", "surrogateescape")
        elif kind is not str_:
            refuse(filesystem, event + " of a " + kind.__name__ + " path")
        real = resolve(path)
        if real.startswith(scratch_under):
            try:
                mode = lstat(real).st_mode & 0o170000
            except base_exception:
                mode = 0
            if mode == 0o020000 or mode == 0o060000:  # a device node made there (by root)
                refuse(filesystem, event + " of the device " + repr_(path))
        for root, under in write_roots if writing else read_roots:
            if real == root or real.startswith(under):
                return
        refuse(filesystem, event + " " + ("writing " if writing else "") + repr_(path))

    def hook(event: str, args: tuple) -> None:
        if event == "open":
            check(event, args[0], args[2] & write_flags != 0)
        elif event in read_events:
            check(event, args[0], False)
        elif event in write_events:
            check(event, args[0], True)
        elif event == "os.rename":
            check(event, args[0], True)
            check(event, args[1], True)
        elif event == "sqlite3.connect":
            database = args[0]
            if not (type_(database) is str_ and (database == ":memory:" or database == "")):
                check(event, database, True)
        elif event == "import":
            name = args[0]
            if type_(name) is not str_ or name in refused_imports or name.startswith("_test"):
                refuse(process, "import " + repr_(name))
        elif event in refused_events:
            refuse(refused_events[event], event)
        else:
            for prefix, code in refused_prefixes:
                if event.startswith(prefix):
                    refuse(code, event)

    return hook


def _readable() -> tuple[str, ...]:
    """What a program may read outside its directory: the Python installation (the standard
    library it imports), randomness, /dev/null, its own /proc entry and this file."""
    here = [os.path.realpath(p) for p in sys.path if p and os.path.exists(p)]
    prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    here += [os.path.realpath(p) for p in prefixes]
    devices = ["/dev/null", "/dev/zero", "/dev/urandom", "/dev/random"]
    # /proc/self, not /proc/PID: in a process-id namespace our PID is 1, the host's init.
    return (*here, *devices, os.path.realpath("/proc/self"), os.path.realpath(__file__))


def _run(path: str) -> None:
    """Runs the program at `path` as `__main__` (runpy, as `python path` would); an uncaught
    exception prints the program's part of the traceback and exits 1, or EXIT_MEMORY for
    MemoryError. The one place model-written code runs: this child, contained before it (no
    config or checkpoint is ever executed)."""
    import builtins

    # What site (skipped: -S) would add, and programs call to stop.
    builtins.exit = builtins.quit = sys.exit  # type: ignore[assignment]
    sys.argv = [path]
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit:
        raise
    except MemoryError:
        # No formatting: the program's objects may still hold all the memory there is.
        os.write(2, b"\nMemoryError\n")
        os._exit(EXIT_MEMORY)
    except BaseException as exc:
        import traceback

        try:
            tb = exc.__traceback__  # from the program's first frame on (none: a syntax error)
            while tb is not None and tb.tb_frame.f_code.co_filename != path:
                tb = tb.tb_next
            traceback.print_exception(type(exc), exc, tb)
        except MemoryError:
            os._exit(EXIT_MEMORY)
        sys.exit(1)


def main(argv: list[str]) -> None:
    """Contains this process, then runs SCRATCH/main.py."""
    try:
        scratch = os.path.realpath(argv[1])
        _limit(int(argv[2]), int(argv[3]))
        _isolate()
        path = scratch + "/main.py"
        readable = _readable()
        sys.dont_write_bytecode = True
    except Exception as exc:  # reported to the parent, which raises
        os.write(2, f"sandbox setup failed: {type(exc).__name__}: {exc}\n".encode())
        os._exit(EXIT_SETUP)
    sys.addaudithook(_audit_hook(scratch, readable))
    _run(path)


if __name__ == "__main__":
    main(sys.argv)
