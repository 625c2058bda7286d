"""Launched on two CPU ranks (gloo) by tests/test_data.py: `prepare_data` as a two-process recipe runs it.

argv: the tiny target's directory, the prompts file, the data directory. Prints "rank R: N rows" from each rank's
own rows file, and the main rank "dataset: N rows".
"""

import json
import sys
from pathlib import Path

import torch.distributed as dist

from mirror_train.data.pipeline import DataConfig, prepare_data
from mirror_train.data.selfdistill import SelfDistillConfig, load_selfdistill
from mirror_train.target import Target


def main(target_dir: str, prompts: str, data_dir: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    data = DataConfig(
        dir=data_dir,
        selfdistill=SelfDistillConfig(prompts=prompts, num_prompts=10, max_new_tokens=4, batch_size=2),
        forced_prompts=0,
        heldout=SelfDistillConfig(prompts=prompts, num_prompts=2, max_new_tokens=4, seed=1),
        top_k=4,
    )
    prepare_data(data, Target.load(target_dir), [2], rank, world, dist.barrier)
    dist.barrier()  # the caller's: the main rank has made the rest
    rows = Path(data_dir) / "selfdistill" / "work" / f"rows.rank{rank}.jsonl"
    # one write per line (print writes its text and its newline apart where stdout is unbuffered, and two ranks'
    # lines then interleave: "rank 0: 5 rowsrank 1: 5 rows")
    print(f"rank {rank}: {len(rows.read_text().splitlines())} rows\n", end="", flush=True)
    if rank == 0:
        ds = load_selfdistill(Path(data_dir) / "selfdistill")
        ranks = json.loads((Path(data_dir) / "selfdistill" / "provenance.json").read_text())["ranks"]
        print(f"dataset: {len(ds)} rows, {len(set(ds['id']))} prompts, from {ranks} ranks\n", end="", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
