#!/usr/bin/env bash
# What scripts/gpu_check.py needs on the lent GPU machine and its image lacks, gathered here into .gpu_carry/ (ignored
# by git): wheels of the versions this checkout is tested with (its image has transformers 5.17, older than the
# 5.24 this project needs, and no `datasets`; /work/.library/device/KINDS.md lists the image) and the Spec-Bench
# questions. Then, in one device call with carry [".gpu_carry"] (docs/engine.md, "scripts/gpu_check.py"):
#   python -m pip install -q --no-deps .gpu_carry/wheels/*.whl && python -m pip install -q --no-deps -e . &&
#   MIRROR_TRAIN_SPECBENCH_QUESTIONS=.gpu_carry/question.jsonl PYTHONUNBUFFERED=1 python scripts/gpu_check.py --out $OUT
# Only 64 MiB travel with the tree: hf_xet (downloads only) is left out, and pyarrow is the image's own.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
dest=.gpu_carry/wheels
rm -rf "$dest" && mkdir -p "$dest"
grep -qx '/.gpu_carry/' .git/info/exclude 2>/dev/null || echo '/.gpu_carry/' >>.git/info/exclude
# transformers and what it pulls in that the image lacks or has too old; datasets and what it adds to the image
names="transformers huggingface_hub tokenizers safetensors kernels regex typer click rich shellingham pygments
markdown_it_py mdurl httpx2 httpcore2 h11 anyio idna filelock fsspec packaging tqdm typing_extensions
pydantic pydantic_core annotated_types annotated_doc typing_inspection tomlkit truststore datasets dill multiprocess"
pins=$("$PY" - $names <<'PY'
import importlib.metadata as m, sys
print(" ".join(f"{n}=={m.version(n)}" for n in sys.argv[1:]))
PY
)
platforms=""
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    platforms="$platforms --platform $p"
done
# shellcheck disable=SC2086
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $platforms \
    -d "$dest" $pins
cp ../shared/data/specbench/question.jsonl .gpu_carry/
du -sh .gpu_carry
