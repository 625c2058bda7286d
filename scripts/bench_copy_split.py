"""The draft's held-out top-1 split by whether prompt lookup already proposes the target's token (twenty-fifth session;
ad hoc: python scripts/bench_copy_split.py DRAFT_EXPORT...)."""

import sys

import numpy as np
import torch

from mirror_train.config import load_config
from mirror_train.data.copy_hits import prompt_lookup_hits
from mirror_train.data.features import pack_rows
from mirror_train.drafter_training import DrafterRunConfig, open_caches, target_states, unrolled_forward
from mirror_train.models.draft_artifact import load_draft
from mirror_train.target import Target

torch.set_num_threads(1)
cfg = load_config(DrafterRunConfig, "recipes/configs/drafter_smollm2.yaml")
target = Target.load("testbed")
train, held = open_caches(cfg, target)
for path in sys.argv[1:]:
    draft = load_draft(path, target).eval()
    tot = {"hit": [0, 0], "miss": [0, 0]}
    pl = [0, 0]
    with torch.inference_mode():
        for s in range(held.num_sequences):
            lo, hi = int(held.offsets[s]), int(held.offsets[s + 1])
            ans = np.array(held.is_answer[lo:hi])
            if not ans.any():
                continue
            b = pack_rows(held.windows([(lo, hi)]))
            st = target_states(draft, b)
            outs, rows = unrolled_forward(draft, draft, b, st, 0)
            guess = draft.draft_to_target(outs[0].logits[0].argmax(-1)).numpy()
            lab = b["topk_ids"][0, :, 0].numpy()
            h = prompt_lookup_hits(b["token_ids"][0].tolist(), lab.tolist())
            ok = guess == lab
            for key, m in (("hit", h & ans), ("miss", ~h & ans)):
                tot[key][0] += int((ok & m).sum())
                tot[key][1] += int(m.sum())
    n = tot["hit"][1] + tot["miss"][1]
    hit, miss = (tot[key][0] / tot[key][1] for key in ("hit", "miss"))
    share, overall = tot["hit"][1] / n, (tot["hit"][0] + tot["miss"][0]) / n
    print(f"{path}: positions {n}, PLD first-token hit share {share:.3f}; draft top1 where PLD hits {hit:.3f}, ")
    print(f"    where it misses {miss:.3f}, overall {overall:.3f}")
