"""NVMe offload (ZeRO-Infinity) on 2 ranks equals no offload, in a file of its own: it needs
DeepSpeed's async_io op, the longest JIT build of the suite (pin_memory and 12 async_io sources).
The session builds it at the lowest CPU priority from its first test on (conftest:
`async_io_built_in_idle_time`), in the time the other tests leave a core idle, and runs this
file last, when the build is done."""
import pytest

from conftest import train_losses
from test_distributed import FP32_TOL, assert_close

pytestmark = pytest.mark.distributed


def test_nvme_offload_matches_no_offload(launch2, tmp_path):
    # 3 steps, no checkpoint: every step through libaio is slow on this machine's disk.
    reference = train_losses(launch2("zero=stage3", "precision=fp32"))[:3]
    nvme = train_losses(launch2("zero=stage3", "precision=fp32", "offload=nvme", f"offload.nvme_path={tmp_path}",
                                "trainer.max_steps=3", "trainer.save_every=0"))
    assert_close(nvme, reference, FP32_TOL)
