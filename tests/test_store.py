"""``store.Lock``: held until released, never by a forked child; the process's fork hooks do not grow with locks."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from template.engine.store import try_lock


def test_locks_add_no_fork_hook_each_and_a_forked_child_holds_none(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    locks, hooks = [try_lock(tmp_path / "0.lock")], []  # the first lock of the process registers its one hook
    monkeypatch.setattr(os, "register_at_fork", lambda **hook: hooks.append(hook))
    locks += [try_lock(tmp_path / f"{n}.lock") for n in range(1, 50)]
    assert all(locks) and hooks == []  # none more: a long process does not pile them up
    monkeypatch.undo()
    (read, write), (ready, started) = os.pipe(), os.pipe()
    child = os.fork()
    if child == 0:  # a DataLoader worker, alive while its parent releases the lock
        os.close(write)
        os.write(started, b"1")  # after the fork hooks, which run before fork() returns here
        os.read(read, 1)
        os._exit(0)
    try:
        assert os.read(ready, 1) == b"1"
        locks[0].release()
        again = try_lock(tmp_path / "0.lock")
        assert again is not None  # the child's copy of the descriptor was closed as it was forked
        again.release()
    finally:
        os.close(write)  # the child exits
        os.waitpid(child, 0)
        for lock in locks:
            lock.release()


@pytest.mark.parametrize("twice", [False, True])
def test_a_lock_is_exclusive_until_released(tmp_path: Path, twice: bool) -> None:
    lock = try_lock(tmp_path)
    assert lock is not None
    child = os.fork()
    if child == 0:
        os._exit(0 if try_lock(tmp_path) is None else 1)
    assert os.waitpid(child, 0)[1] == 0
    lock.release()
    if twice:
        lock.release()  # a second release does nothing
    again = try_lock(tmp_path)
    assert again is not None
    again.release()
