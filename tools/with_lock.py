"""Runs a command while holding an exclusive lock on a file: a portable flock(1) (macOS has
none). The lock is the kernel's (fcntl.flock), so it goes away with the process, and a killed
build never leaves a stale lock behind.

    python tools/with_lock.py build/.build.lock python setup.py -q build_ext --inplace
"""

import fcntl
import os
import sys


def main(argv: list[str]) -> int:
    """Takes the lock on argv[0], then replaces this process with the command argv[1:]."""
    if len(argv) < 2:
        print("usage: with_lock.py LOCKFILE COMMAND [ARG...]", file=sys.stderr)
        return 2
    path, command = argv[0], argv[1:]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.set_inheritable(fd, True)  # the command holds the lock until it exits
    os.execvp(command[0], command)
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
