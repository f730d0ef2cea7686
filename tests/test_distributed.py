"""`init_worker` under `torchrun`: which device each local rank takes from --devices (one CPU
listed serves every rank; a GPU list shorter than the node's processes is refused). The process
group itself is not started: `init_process_group` is recorded instead."""

from __future__ import annotations

import pytest
import torch

import common.distributed as distributed
from common.distributed import init_worker


@pytest.fixture
def torchrun_rank(monkeypatch: pytest.MonkeyPatch):
    """Set torchrun's variables for local rank `local` of `local_world` on one node; returns
    the backends `init_process_group` was called with and the GPUs `set_device` was given."""
    calls: dict[str, list] = {"backend": [], "gpu": []}
    monkeypatch.delenv("DFLASH_DEVICES", raising=False)  # set only by our own launch
    monkeypatch.setattr(
        distributed.dist,
        "init_process_group",
        lambda backend, **_: calls["backend"].append(backend),
    )
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls["gpu"].append(str(device)))

    def set_rank(local: int, local_world: int) -> dict[str, list]:
        for name, value in (
            ("RANK", local),
            ("WORLD_SIZE", local_world),
            ("LOCAL_RANK", local),
            ("LOCAL_WORLD_SIZE", local_world),
        ):
            monkeypatch.setenv(name, str(value))
        return calls

    return set_rank


@pytest.mark.parametrize("devices", [["cpu"], ["cpu", "cpu"]])
def test_a_listed_cpu_serves_every_torchrun_rank(torchrun_rank, devices) -> None:
    """`torchrun --nproc_per_node 3 dflash extract --devices cpu`: rank 1 took cuda:1 (and on
    a CPU-only torch crashed in torch.cuda.set_device); the CPU is no per-rank device."""
    calls = torchrun_rank(2, 3)
    ctx = init_worker(devices)
    assert (ctx.rank, ctx.world_size, ctx.local_rank, ctx.device) == (2, 3, 2, torch.device("cpu"))
    assert calls == {"backend": ["gloo"], "gpu": []}


def test_each_torchrun_rank_takes_its_listed_gpu(torchrun_rank) -> None:
    calls = torchrun_rank(1, 2)
    assert init_worker(["cuda:2", "cuda:3"]).device == torch.device("cuda:3")
    assert calls == {"backend": ["nccl"], "gpu": ["cuda:3"]}


@pytest.mark.parametrize("local", [0, 2])
def test_fewer_gpus_than_torchrun_processes_is_refused_on_every_rank(torchrun_rank, local):
    """`--devices 2,3` under `torchrun --nproc_per_node 4`: rank 2 took cuda:2 beside rank 0,
    two ranks on one GPU; every rank now refuses it before the process group, naming --devices."""
    calls = torchrun_rank(local, 4)
    with pytest.raises(ValueError, match=r"--devices lists 2 GPU\(s\) \(2,3\) .* 4 processes"):
        init_worker(["cuda:2", "cuda:3"])
    assert calls == {"backend": [], "gpu": []}
