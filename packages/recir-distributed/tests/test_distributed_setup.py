"""What a launcher needs from recir.distributed: modes by name, meshes from flag text, the process group."""

from __future__ import annotations

import subprocess
import sys

import pytest
import recir.distributed as rd
from recir.transforms import ConfigError


def test_parallel_mode_by_name():
    assert rd.parallel_mode("dp") == rd.DataParallel()
    assert rd.parallel_mode("fsdp") == rd.FullyShardedDataParallel()
    assert rd.parallel_mode("hybrid") == rd.HybridParallel(tables=rd.table_wise())
    assert rd.parallel_mode("auto") == "auto"
    assert rd.parallel_mode("dp", "row") == rd.HybridParallel(tables=rd.row_wise())
    assert rd.parallel_mode("fsdp", "column") == rd.HybridParallel(
        tables=rd.column_wise(), dense=rd.FullyShardedDataParallel()
    )
    assert rd.parallel_mode("hybrid", "auto") == rd.parallel_mode("auto", "auto") == "auto"
    with pytest.raises(ConfigError, match="automatic placement keeps dense state replicated"):
        rd.parallel_mode("fsdp", "auto")
    with pytest.raises(ConfigError, match="Fix: table sharding 'auto'"):
        rd.parallel_mode("auto", "row")
    with pytest.raises(ConfigError, match="unknown table sharding 'diagonal'; expected one of row, table"):
        rd.parallel_mode("dp", "diagonal")
    with pytest.raises(ConfigError, match="unknown parallel mode 'ddp2'; expected one of dp, fsdp"):
        rd.parallel_mode("ddp2")


def test_mesh_parse():
    assert rd.Mesh.parse("data=8") == rd.Mesh(axes={"data": 8})
    assert rd.Mesh.parse(" data=2, model=2 ").axes == {"data": 2, "model": 2}
    for bad in ("data8", "data=0", "data=x", "data=2,"):
        with pytest.raises(ConfigError, match="expected NAME=SIZE"):
            rd.Mesh.parse(bad)
    with pytest.raises(ConfigError, match="is not one of"):
        rd.Mesh.parse("batch=2")
    with pytest.raises(ConfigError, match="^--mesh 'data': expected NAME=SIZE"):
        rd.Mesh.parse("data", name="--mesh")


def test_setup_process_group_without_torchrun_makes_one_process():
    code = (
        "import os, torch.distributed as dist, recir.distributed as rd\n"
        "[os.environ.pop(k, None) for k in ('RANK', 'MASTER_ADDR', 'WORLD_SIZE')]\n"
        "assert rd.setup_process_group() == (0, 1)\n"
        "assert dist.get_backend() == 'gloo'\n"
        "assert rd.setup_process_group() == (0, 1)  # an initialised group is used as it is\n"
        "dist.destroy_process_group()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
