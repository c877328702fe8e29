"""Checkpoints that tear: a rank killed mid-save, a full disk, a flipped byte, parts of two saves.

Two pipeline ranks run ``smp.save`` / ``smp.load`` in two threads of this process, each
with its own (fake) seed-API state, exchanging their ``all_gather`` through a barrier;
a rank that is "killed" stops where it is and breaks the barrier, as a dead peer breaks
the real collective. The last probes do the same with real processes and ``SIGKILL``.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from fxpipe.errors import CheckpointError
from fxpipe.runtime.train import commit
from fxpipe.smp import checkpoint

STAGES = 2


class _Killed(BaseException):
    """This rank died here (a SIGKILL, as far as the others can tell)."""


class _Pipeline:
    """``STAGES`` ranks in threads: ``run(fn)`` calls ``fn(rank)`` on each and returns results or exceptions."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, stages: int = STAGES) -> None:
        self.stages = stages
        self.local = threading.local()
        self.barrier = threading.Barrier(stages, timeout=20)
        self.slots: list[Any] = [None] * stages
        monkeypatch.setattr(checkpoint, "current", self._state)
        monkeypatch.setattr(
            checkpoint, "_group", lambda st, partial: ("group", stages) if partial else (None, 1)
        )
        monkeypatch.setattr(checkpoint, "_gather", self._gather)

    def _state(self) -> Any:
        rank = self.local.rank
        return type(
            "State",
            (),
            {
                "rank": rank,
                "mp_rank": rank,
                "mp_group": "group",
                "layout": type("Layout", (), {"num_stages": self.stages}),
            },
        )()

    def _gather(
        self, mine: dict[str, Any], group: Any, size: int, doing: str
    ) -> list[dict[str, Any]]:
        if size == 1:
            return [mine]
        try:
            self.slots[self.local.rank] = mine
            self.barrier.wait()
            out = list(self.slots)
            self.barrier.wait()
            return out
        except threading.BrokenBarrierError:
            raise CheckpointError(
                f"{doing}: another rank of the pipeline did not answer; nothing was committed"
            ) from None

    def run(self, fn: Callable[[int], Any]) -> list[Any]:
        results: list[Any] = [None] * self.stages

        def body(rank: int) -> None:
            self.local.rank = rank
            try:
                results[rank] = fn(rank)
            except _Killed as exc:
                results[rank] = exc
                self.barrier.abort()
            except Exception as exc:  # noqa: BLE001 - the probe inspects it
                results[rank] = exc

        threads = [threading.Thread(target=body, args=(r,)) for r in range(self.stages)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        self.barrier.reset()
        return results


def _state(step: int, rank: int) -> dict[str, Any]:
    return {"step": step, "w": torch.full((64,), float(step * 10 + rank))}


def _save(pipe: _Pipeline, f: Path, step: int) -> list[Any]:
    return pipe.run(lambda r: checkpoint.save(_state(step, r), f, partial=True))


def _load(pipe: _Pipeline, f: Path) -> list[Any]:
    return pipe.run(lambda r: checkpoint.load(f, partial=True))


def _steps(results: list[Any]) -> list[Any]:
    return [r["step"] if isinstance(r, dict) else type(r).__name__ for r in results]


def _temps(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".fxpipe-tmp"))


@pytest.fixture
def pipe(monkeypatch: pytest.MonkeyPatch) -> _Pipeline:
    return _Pipeline(monkeypatch)


@pytest.fixture
def saved(pipe: _Pipeline, tmp_path: Path) -> Path:
    """A good checkpoint of step 1."""
    f = tmp_path / "ckpt.pt"
    assert _save(pipe, f, 1) == [None, None]
    return f


def _fail_on(
    rank: int,
    how: Callable[[], BaseException],
    monkeypatch: pytest.MonkeyPatch,
    pipe: _Pipeline,
    after_write: bool = True,
) -> None:
    """Make ``rank``'s write of its part fail with ``how()`` (after its temporary file is written, if asked)."""
    real = commit.write_pending

    def write(obj: Any, path: Path, token: str, protocol: int) -> commit.Part:
        if pipe.local.rank != rank:
            return real(obj, path, token, protocol)
        if after_write:
            real(obj, path, token, protocol)
        raise how()

    monkeypatch.setattr(checkpoint, "write_pending", write)


def test_a_save_round_trips_and_leaves_only_its_files(pipe: _Pipeline, saved: Path) -> None:
    assert _steps(_load(pipe, saved)) == [1, 1]
    assert sorted(p.name for p in saved.parent.iterdir()) == [
        "ckpt.pt.partial.json",
        "ckpt.pt_0",
        "ckpt.pt_1",
    ]


def test_a_full_disk_on_one_rank_commits_nothing(pipe: _Pipeline, saved: Path, monkeypatch) -> None:
    _fail_on(
        1,
        lambda: OSError(errno.ENOSPC, "No space left on device"),
        monkeypatch,
        pipe,
        after_write=False,
    )
    results = _save(pipe, saved, 2)
    assert all(isinstance(r, CheckpointError) for r in results)
    assert all(
        "No space left on device" in str(r) and "previous checkpoint" in str(r) for r in results
    )
    monkeypatch.undo()
    pipe = _Pipeline(monkeypatch)
    assert _steps(_load(pipe, saved)) == [1, 1] and _temps(saved.parent) == []


def test_a_rank_killed_before_the_commit_leaves_the_previous_checkpoint(
    pipe: _Pipeline, saved: Path, monkeypatch
) -> None:
    _fail_on(1, _Killed, monkeypatch, pipe)
    results = _save(pipe, saved, 2)
    assert isinstance(results[0], CheckpointError) and isinstance(results[1], _Killed)
    assert _temps(saved.parent) != []  # what the killed rank left, until the next save or load
    monkeypatch.undo()
    pipe = _Pipeline(monkeypatch)
    assert _steps(_load(pipe, saved)) == [1, 1]
    assert _temps(saved.parent) == []


def test_a_rank_killed_between_commit_and_rename_is_rolled_forward(
    pipe: _Pipeline, saved: Path, monkeypatch
) -> None:
    real = checkpoint.publish

    def publish(path: Path, part: commit.Part) -> None:
        if pipe.local.rank == 0:
            raise _Killed
        real(path, part)

    monkeypatch.setattr(checkpoint, "publish", publish)
    results = _save(pipe, saved, 2)
    assert isinstance(results[0], _Killed) and results[1] is None
    assert torch.load(Path(f"{saved}_0"), weights_only=True)["step"] == 1  # on disk: a torn set
    monkeypatch.undo()
    pipe = _Pipeline(monkeypatch)
    assert _steps(_load(pipe, saved)) == [2, 2] and _temps(saved.parent) == []


def test_a_killed_save_is_cleaned_up_by_the_next_save(
    pipe: _Pipeline, saved: Path, monkeypatch
) -> None:
    _fail_on(0, _Killed, monkeypatch, pipe)
    _save(pipe, saved, 2)
    monkeypatch.undo()
    pipe = _Pipeline(monkeypatch)
    assert _save(pipe, saved, 3) == [None, None] and _temps(saved.parent) == []
    assert _steps(_load(pipe, saved)) == [3, 3]


def test_a_flipped_byte_is_refused_on_every_rank(pipe: _Pipeline, saved: Path) -> None:
    part = Path(f"{saved}_1")
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0x01
    part.write_bytes(bytes(data))
    results = _load(pipe, saved)
    assert "does not match its checkpoint record" in str(results[1])
    assert "the part of stage 1 cannot be loaded" in str(results[0])


def test_a_part_from_another_save_is_refused(pipe: _Pipeline, saved: Path, tmp_path: Path) -> None:
    shutil.copy(Path(f"{saved}_1"), tmp_path / "old_1")
    assert _save(pipe, saved, 2) == [None, None]
    shutil.copy(tmp_path / "old_1", Path(f"{saved}_1"))
    results = _load(pipe, saved)
    assert all(isinstance(r, CheckpointError) for r in results), results


def test_ranks_with_records_of_different_saves_refuse_together(
    pipe: _Pipeline, saved: Path, tmp_path: Path, monkeypatch
) -> None:
    """Machines that each keep their own copy (local disks): rank 1 still holds save 1, rank 0 save 2."""
    old = commit.read_record(commit.record_path(saved, True))
    shutil.copy(Path(f"{saved}_1"), tmp_path / "old_1")
    assert _save(pipe, saved, 2) == [None, None]
    shutil.copy(tmp_path / "old_1", Path(f"{saved}_1"))
    real = checkpoint.read_record
    monkeypatch.setattr(
        checkpoint, "read_record", lambda path: old if pipe.local.rank == 1 else real(path)
    )
    results = _load(pipe, saved)
    assert all("come from different saves" in str(r) for r in results), results


def test_a_checkpoint_without_record_loads_with_a_warning(pipe: _Pipeline, saved: Path) -> None:
    commit.record_path(saved, True).unlink()
    with pytest.warns(UserWarning, match="has no commit record"):
        assert _steps(_load(pipe, saved)) == [1, 1]


@pytest.mark.parametrize(
    ("damage", "fragment"),
    [
        (lambda p: p.write_text("{broken"), "is not valid JSON"),
        (
            lambda p: p.write_text('{"format": "fxpipe-checkpoint", "id": 5}'),
            "id: expected a string",
        ),
        (lambda p: p.write_text('{"format": "zip"}'), "is not an fxpipe checkpoint record"),
    ],
)
def test_a_damaged_record_is_refused(
    damage: Callable[[Path], Any], fragment: str, pipe: _Pipeline, saved: Path
) -> None:
    damage(commit.record_path(saved, True))
    assert all(fragment in str(r) for r in _load(pipe, saved))


def test_a_checkpoint_of_another_partition_count_is_refused(saved: Path, monkeypatch) -> None:
    pipe = _Pipeline(monkeypatch, stages=3)
    assert all(
        "saved by a job with 2 partitions, this one has 3" in str(r) for r in _load(pipe, saved)
    )


def test_full_checkpoints_are_checked_too(saved: Path, monkeypatch) -> None:
    f = saved.parent / "full.pt"
    monkeypatch.setattr(checkpoint, "current", lambda: type("S", (), {"rank": 0, "mp_rank": 0})())
    checkpoint.save({"step": 1}, f, partial=False)
    assert checkpoint.load(f, partial=False)["step"] == 1
    data = bytearray(f.read_bytes())
    data[-1] ^= 0x01
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="does not match its checkpoint record"):
        checkpoint.load(f, partial=False)


def _mount_tmpfs(folder: Path) -> bool:
    folder.mkdir()
    try:
        proc = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(folder)],
            capture_output=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return proc.returncode == 0


def test_a_really_full_disk(tmp_path: Path, monkeypatch) -> None:
    """A 1 MiB tmpfs (where this machine lets us mount one; else a write that fails with ENOSPC):
    a 2 MiB save fails whole, and the small checkpoint before it still loads."""
    folder = tmp_path / "small"
    mounted = _mount_tmpfs(folder)
    try:
        pipe = _Pipeline(monkeypatch)
        f = folder / "ckpt.pt"
        assert _save(pipe, f, 1) == [None, None]
        if not mounted:
            _fail_on(
                1,
                lambda: OSError(errno.ENOSPC, "No space left on device"),
                monkeypatch,
                pipe,
                after_write=False,
            )
        results = pipe.run(
            lambda r: checkpoint.save({"step": 2, "w": torch.zeros(1 << 19)}, f, partial=True)
        )
        assert all(
            isinstance(r, CheckpointError) and "No space left on device" in str(r) for r in results
        ), results
        monkeypatch.undo()
        pipe = _Pipeline(monkeypatch)
        assert _steps(_load(pipe, f)) == [1, 1] and _temps(folder) == []
    finally:
        if mounted:
            subprocess.run(["umount", str(folder)], capture_output=True, timeout=20)


# -- real processes -------------------------------------------------------------------------------


def _kill_mid_save_job(rank: int, world: int, folder: str) -> None:
    import signal

    import fxpipe.smp as smp

    smp.init({"partitions": 2, "microbatches": 1}, timeout_s=30)
    f = Path(folder) / "ckpt.pt"
    smp.save(_state(1, rank), f, partial=True)
    if rank == 1:  # dies with its part of save 2 half done: written, not agreed on
        real = commit.write_pending

        def write_then_die(*args: Any) -> Any:
            real(*args)
            os.kill(os.getpid(), signal.SIGKILL)

        checkpoint.write_pending = write_then_die  # type: ignore[assignment]
    smp.save(_state(2, rank), f, partial=True)


def _load_job(rank: int, world: int, folder: str) -> int:
    import fxpipe.smp as smp

    smp.init({"partitions": 2, "microbatches": 1}, timeout_s=30)
    return int(smp.load(Path(folder) / "ckpt.pt", partial=True)["step"])


@pytest.mark.slow
@pytest.mark.distributed
def test_sigkill_mid_save_in_a_real_job(tmp_path: Path) -> None:
    from spawn import spawn  # tests/runtime's one spawn helper

    results = spawn(_kill_mid_save_job, 2, str(tmp_path), timeout=120, expect_failure=True)
    assert "CheckpointError" in results[0].error and "did not answer" in results[0].error, results[
        0
    ].error
    assert "exited with code -9" in results[1].error, results[1].error
    assert [r.value for r in spawn(_load_job, 2, str(tmp_path), timeout=120)] == [1, 1]
    assert _temps(tmp_path) == []
