"""NVMe offload on one device, one process, no test harness: a reproduction
for scripts/gpu_check.sh to run under a debugger (NVMe offload with CUDA
parameters segfaulted in the ZeroOptimizer constructor on an H200, see
benchmarks/results/gpu_check.md). Also runs on CPU (Gloo).

    RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 \\
        python tests/python/scripts/nvme_on_device.py --stage 2 --pin
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "..", "..", "python"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import zeroshard  # noqa: E402

from tiny_models import make_model, param_groups, train  # noqa: E402


class OnDevice(torch.nn.Module):
    """Feeds tiny_models.train's CPU batches to a model on `device`."""

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        super().__init__()
        self.inner, self.device = model, device

    def forward(self, tokens: torch.Tensor, step: int) -> torch.Tensor:
        return self.inner(tokens.to(self.device), step).cpu()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--stage", type=int, default=2, choices=[1, 2, 3])
    parser.add_argument("--pin", action="store_true")
    parser.add_argument("--nvme-path", default=None)
    args = parser.parse_args()
    faulthandler.enable(all_threads=True)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    if cuda:
        torch.cuda.set_device(device)
    model = make_model(seed=0).to(device)
    path = tempfile.mkdtemp(dir=args.nvme_path)
    nvme = {"device": "nvme", "nvme_path": path, "pin_memory": args.pin}
    offload = {"offload_optimizer": {**nvme, "buffer_count": 4}, "sub_group_size": 50}
    stage3 = {}
    if args.stage == 3:
        offload["offload_param"] = {**nvme, "max_in_cpu": 0}
        stage3 = {"module": model, "stage3_param_persistence_threshold": 0}
    print(f"constructing: stage {args.stage}, {device}, pin_memory {args.pin}", flush=True)
    optimizer = zeroshard.ZeroOptimizer(
        param_groups(model, (1e-2, 5e-3)),
        "adamw",
        stage=args.stage,
        weight_decay=0.1,
        reduce_bucket_size=64,
        **stage3,
        **offload,
    )
    print("constructed", flush=True)
    train(OnDevice(model, device), optimizer, 3, 0, 1)
    print("trained 3 steps", flush=True)
    del optimizer, model
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
