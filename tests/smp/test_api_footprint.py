"""A seed-API job leaves nothing behind: no temporary build folders, ``nn.Module`` as PyTorch defines it.

The spawned ranks end with ``os._exit`` (no ``atexit``, as after a ``SIGKILL``), so what
is removed must be removed while the job runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from scenarios import footprint_job
from spawn import spawn


@pytest.fixture(scope="module")
def footprint(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    temp = tmp_path_factory.mktemp("tmpdir")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TMPDIR", str(temp))  # the ranks' tempfile.gettempdir()
        results = [r.value for r in spawn(footprint_job, 2, timeout=300)]
    return results, temp


@pytest.mark.distributed
def test_first_step_build_leaves_no_temporary_files(footprint: Any) -> None:
    results, temp = footprint
    for rank in results:
        assert (
            rank["files_after_partitioning"] == []
        )  # gone once the stages are loaded, not at exit
        assert rank["build_dir"] is None  # a first-step build is not kept on disk
        assert rank["stage_source"].startswith(
            "class Stage"
        )  # its source still reads in tracebacks
    assert sorted(p.name for p in temp.iterdir() if not p.name.startswith("torchinductor_")) == []


@pytest.mark.distributed
def test_nn_module_and_the_optimizer_are_restored(footprint: Any) -> None:
    for rank in footprint[0]:
        assert rank["patched_after_init"]  # smp.init records constructor arguments ...
        assert not rank[
            "patched_after_partitioning"
        ]  # ... until the model is built and partitioned
        assert not rank["patched_after_shutdown"]
        assert rank["optimizer_methods"] == [
            "load_state_dict",
            "local_state_dict",
            "state_dict",
            "step",
        ]
        assert rank["optimizer_methods_after_shutdown"] == [
            "step"
        ]  # the LR scheduler's wrapper, not fxpipe's


@pytest.mark.distributed
def test_distributed_optimizer_is_the_users_object_and_schedulers_work(footprint: Any) -> None:
    for rank in footprint[0]:
        assert rank["same_object"] and rank["optimizer_class"] == "SGD"  # its class untouched
        assert rank["lrs"] == [0.05, 0.025] and rank["scheduler_warnings"] == []
