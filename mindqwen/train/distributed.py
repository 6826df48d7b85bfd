"""Data parallel through ``msrun``, and the parallel-layout check for Ascend clusters.

Under ``msrun`` every worker calls :func:`init_data_parallel`, gets its rank, reads its shard of
each global batch, and the step all-reduces gradients (``nn.DistributedGradReducer``, mean). Outside
``msrun`` nothing is initialised: a single process never needs the launcher.
"""
from __future__ import annotations

import os
from typing import Tuple

import mindspore as ms

# Set by msrun for every worker.
_LAUNCHER_VARS = ("MS_WORKER_NUM", "MS_ROLE")


def launched_by_msrun() -> bool:
    return all(v in os.environ for v in _LAUNCHER_VARS) and int(os.environ["MS_WORKER_NUM"]) > 1


def init_data_parallel() -> Tuple[int, int]:
    """(rank, world size); initialises communication only under a multi-worker msrun."""
    if not launched_by_msrun():
        return 0, 1
    from mindspore.communication import get_group_size, get_rank, init
    init()  # HCCL on Ascend, MindSpore's own collective (MCCL) on CPU
    ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True)
    return get_rank(), get_group_size()


def check_layout(data_parallel: int, tensor_parallel: int, pipeline_parallel: int, devices: int) -> None:
    """dp · tp · pp must equal the number of devices."""
    product = data_parallel * tensor_parallel * pipeline_parallel
    if product != devices:
        raise ValueError(f"parallel layout data_parallel={data_parallel} × tensor_parallel={tensor_parallel} × "
                         f"pipeline_parallel={pipeline_parallel} = {product}, but {devices} devices are used")
