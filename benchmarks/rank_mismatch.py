"""What happens when one rank calls ``step()`` or ``flush()`` once more than the others (docs/limitations.md).

    python benchmarks/rank_mismatch.py        # 6 cases, 2 gloo processes each, 2-4 minutes

Each case starts 2 CPU processes (gloo, process-group timeout ``--timeout`` seconds), trains 4
micro-batches of a tiny model under ``ClippedOptimizer(accumulation_steps=2)`` (DDP, or FSDP2's
``fully_shard``), lets rank 0 alone call ``step()`` (or ``flush()``) once more, then has both ranks
train 2 more micro-batches and meet at a barrier.  It records, per rank, how the process ended (exit
code or signal), after how many seconds, and the first line of the error, and writes
``rank_mismatch.json`` and ``rank_mismatch.md`` into ``--out``.  The cases:

* ``ddp-step``, ``ddp-flush``: DDP;
* ``fsdp-step``, ``fsdp-flush``: FSDP2;
* ``fsdp-flush-detail``: FSDP2 with ``TORCH_DISTRIBUTED_DEBUG=DETAIL``;
* ``ddp-no-extra-call-detail``: DDP with ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` and no extra call (on
  torch 2.13 with gloo the processes end in a segmentation fault before their first micro-batch).

NCCL needs GPUs and is not run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CASES: dict[str, tuple[str, str, dict[str, str]]] = {  # name: (wrapper, extra call, environment)
    "ddp-step": ("ddp", "step", {}),
    "ddp-flush": ("ddp", "flush", {}),
    "fsdp-step": ("fsdp", "step", {}),
    "fsdp-flush": ("fsdp", "flush", {}),
    "fsdp-flush-detail": ("fsdp", "flush", {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}),
    "ddp-no-extra-call-detail": ("ddp", "none", {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}),
}


def worker(rank: int, port: int, wrapper: str, call: str, timeout: float) -> None:
    """One rank: 4 micro-batches, rank 0's extra call, 2 more micro-batches, a barrier."""
    import torch
    import torch.distributed as dist
    from torch import nn

    import clipopt

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=timeout))
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    if wrapper == "ddp":
        model: nn.Module = nn.parallel.DistributedDataParallel(net)
    else:
        from torch.distributed.fsdp import fully_shard

        for layer in net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        model = fully_shard(net)
    opt = clipopt.ClippedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), accumulation_steps=2)

    def micro_batch() -> None:
        model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    for _ in range(4):
        micro_batch()
    print(f"ready {time.time()}", flush=True)  # the clock from which the runner counts
    if rank == 0 and call != "none":
        opt.step() if call == "step" else opt.flush()
    for _ in range(2):
        micro_batch()
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _first_error(text: str) -> str:
    """The first line that names what went wrong (gloo's enforce message, the RuntimeError)."""
    for line in text.splitlines():
        if "what():" in line or line.startswith(("RuntimeError", "torch.distributed")) or "Error:" in line:
            return line.strip().removeprefix("[rank0]: ").removeprefix("[rank1]: ")[:400]
    return ""


def _outcome(code: int, out: str, ended_at: float) -> dict[str, Any]:
    """How one rank ended, seconds from the end of its 4 micro-batches (an upper bound: read after
    the process has been waited for), and its first error line."""
    ready = [float(line.split()[1]) for line in out.splitlines() if line.startswith("ready ")]
    ended = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit {code}"
    seconds = round(ended_at - ready[0], 1) if ready else None
    return {"ended": ended, "seconds_after_the_extra_call": seconds, "error": _first_error(out)}


def run_case(name: str, timeout: float, limit: float) -> dict[str, Any]:
    """Both ranks of one case, as subprocesses; killed after ``limit`` seconds."""
    wrapper, call, extra = CASES[name]
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DISTRIBUTED_DEBUG"}
    env.update(extra, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
    port = _free_port()
    start = time.monotonic()
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--worker", str(rank), str(port), wrapper, call, str(timeout)],
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    ranks = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=max(1.0, limit - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        ranks.append(_outcome(proc.returncode, out, time.time()))
    return {"case": name, "wrapper": wrapper, "extra_call": call, "env": extra, "ranks": ranks}


def write_markdown(record: dict[str, Any], path: Path) -> None:
    lines = [
        f"One extra `step()`/`flush()` on rank 0 of 2 gloo processes; torch {record['torch']}, "
        f"process-group timeout {record['timeout']:g} s.",
        "",
        "| case | rank 0 | rank 1 |",
        "|---|---|---|",
    ]
    for case in record["cases"]:
        cells = []
        for r in case["ranks"]:
            cells.append(f"{r['ended']} within {r['seconds_after_the_extra_call']} s: {r['error'] or '-'}")
        lines.append(f"| {case['case']} | " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--timeout", type=float, default=15.0, help="process-group timeout, seconds")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated subset of the cases")
    args = parser.parse_args()
    import torch

    cases = []
    for name in args.cases.split(","):
        cases.append(run_case(name, args.timeout, limit=args.timeout * 3 + 60))
        print(json.dumps(cases[-1]), flush=True)
    record = {"torch": torch.__version__, "timeout": args.timeout, "cases": cases}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "rank_mismatch.json").write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    write_markdown(record, args.out / "rank_mismatch.md")
    print((args.out / "rank_mismatch.md").read_text(encoding="utf-8"))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        rank, port, wrapper, call, timeout = sys.argv[2:7]
        worker(int(rank), int(port), wrapper, call, float(timeout))
    else:
        main()
