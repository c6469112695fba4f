"""Whether the default process group is the job the launcher started.

A script that guards ``init_process_group`` with its own single-process fallback (``rank=0,
world_size=1``) and is then started by torchrun gets one one-rank group per process: every rank
trains alone, nothing is sharded, and nothing fails. The launcher's ``WORLD_SIZE`` says so, and dtq
reads it the first time it shards or gathers anything.
"""

from __future__ import annotations

import os

import torch.distributed as dist

from dtq._warn import warn_once

_checked = False


def check_launched_world() -> None:
    """Warn once when the default process group has one rank while the environment's
    ``WORLD_SIZE`` (set by torchrun, and by the other launchers' bootstraps) says the job has more.
    Checked once per process, the first time a process group is up."""
    global _checked
    if _checked or not (dist.is_available() and dist.is_initialized()):
        return
    _checked = True
    launched = os.environ.get("WORLD_SIZE", "")
    if not launched.isdigit() or int(launched) <= 1 or dist.get_world_size() != 1:
        return
    warn_once(
        "world-size-1-under-a-launcher",
        f"dtq: the default process group has 1 rank, but WORLD_SIZE={launched} in the environment: this "
        f"process (RANK={os.environ.get('RANK', '?')}) trains alone and nothing is sharded across the "
        f"{launched} processes the launcher started. Initialize with torch.distributed.init_process_group() "
        "(no rank, world_size or init_method: it reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT), "
        "or unset WORLD_SIZE if one-rank groups are intended",
    )
